"""Python function calls per sample in each engine thread of a Feeder run, over
small images: RandomResizedCrop(64) + flip, batch 256, ``decode_threads``
decode threads running the transforms inline (``augment_threads=0``).

Every stage thread runs under its own cProfile (the calls a thread makes do not
depend on the machine's load, unlike its time); the figures are the calls of
all passes over all the samples of all passes. The main thread's are counted
over the passes after the first.

    python bench/experiments/engine_calls.py DATA [--epochs 3] [--decode-threads 2]

Run it from each source tree (``PYTHONPATH=tree``) to compare two.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import feeder
from feeder import Feeder, ImageFolder, ops
from feeder.engine import stage as _stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="an ImageFolder of JPEGs (feeder-bench make-data --small)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--decode-threads", type=int, default=2)
    args = p.parse_args()
    profiles: list[tuple[str, cProfile.Profile]] = []
    run = _stage.Stage._main

    def profiled(self, c):
        prof = cProfile.Profile()
        prof.enable()
        try:
            run(self, c)
        finally:
            prof.disable()
            profiles.append((self.name, prof))

    _stage.Stage._main = profiled
    src = ImageFolder(args.data)
    main_prof = cProfile.Profile()
    later = 0
    with Feeder(src, 256, [ops.RandomResizedCrop(64), ops.RandomHorizontalFlip()], seed=0,
                decode_threads=args.decode_threads, augment_threads=0) as f:
        for epoch in range(args.epochs):
            f.set_epoch(epoch)
            if epoch == 1:
                main_prof.enable()
            for x, _ in f:
                later += x.shape[0] if epoch else 0
        main_prof.disable()
    samples = len(src) * args.epochs
    by_stage: dict[str, pstats.Stats] = {}
    for name, prof in profiles:
        if name in by_stage:
            by_stage[name].add(prof)
        else:
            by_stage[name] = pstats.Stats(prof)
    tree = os.path.dirname(os.path.dirname(os.path.abspath(feeder.__file__)))
    parts = [f"{name} {stats.total_calls / samples:.1f}" for name, stats in sorted(by_stage.items())]
    main_calls = pstats.Stats(main_prof).total_calls / max(later, 1)
    print(f"{tree}: {len(src)} files x {args.epochs} passes, decode_threads={args.decode_threads}; "
          f"Python calls per sample by thread: {', '.join(parts)}, main {main_calls:.1f}")


if __name__ == "__main__":
    main()
