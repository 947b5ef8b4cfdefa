"""Small images through a Feeder with 2, 3 and 4 decode threads (the transforms
inline): images/s and cores used over epochs 1-4, each count a fresh process,
alternating, ``--rounds`` rounds.

    python bench/experiments/thread_count.py DATA --rounds 3 [--threads 2 3 4]
    python bench/experiments/thread_count.py DATA --threads 2 --intervals 0.005 0.0005 0.05

``--intervals``: run each count under each of these ``sys.setswitchinterval``
values (seconds; Python's default is 0.005): how long a thread back from a call
that let go of the GIL may wait for it before it asks the holder to let go.

DATA: an ImageFolder of small JPEGs (feeder-bench make-data DATA --small).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def one(data: str, threads: int, interval: float | None = None) -> tuple[float, float]:
    if interval is not None:
        sys.setswitchinterval(interval)
    from feeder import Feeder, ImageFolder, ops

    with Feeder(ImageFolder(data), 256, [ops.RandomResizedCrop(64), ops.RandomHorizontalFlip()], seed=0,
                decode_threads=threads, augment_threads=0) as f:
        f.set_epoch(0)
        for _ in f:
            pass
        t, c, n = time.perf_counter(), time.process_time(), 0
        for epoch in range(1, 5):
            f.set_epoch(epoch)
            for x, _ in f:
                n += x.shape[0]
        dt = time.perf_counter() - t
        return n / dt, (time.process_time() - c) / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--intervals", type=float, nargs="+", default=[None])
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(*one(args.data, args.one, args.interval))
        return
    points = [(n, s) for n in args.threads for s in args.intervals]
    got: dict[tuple[int, float | None], list[tuple[float, float]]] = {pt: [] for pt in points}
    for r in range(args.rounds):
        for n, s in points:
            cmd = [sys.executable, __file__, args.data, "--one", str(n)]
            cmd += [] if s is None else ["--interval", str(s)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
            got[n, s].append((float(out[0]), float(out[1])))
            print(f"round {r + 1}, load {os.getloadavg()[0]:.2f}: {label(n, s)}: "
                  f"{got[n, s][-1][0]:.0f} img/s, {got[n, s][-1][1]:.2f} cores")
    for (n, s), runs in got.items():
        print(f"median {label(n, s)}: {statistics.median(x[0] for x in runs):.0f} img/s, "
              f"{statistics.median(x[1] for x in runs):.2f} cores")


def label(threads: int, interval: float | None) -> str:
    return f"decode_threads={threads}" + ("" if interval is None else f", switch interval {interval:g} s")


if __name__ == "__main__":
    main()
