"""A/B of two feeder source trees on the same data: the same Feeder settings,
alternating rounds, each run a fresh child process that imports feeder from its
tree. For checking that an engine change costs no throughput.

    python bench/experiments/engine_ab.py DATA --tree A=/path/to/old --tree B=/path/to/new [--size 224]

Prints, per tree, the median images/s over the rounds, and the median over rounds
of B/A measured in the same round (the machine's drift cancels in the ratio).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _trees import run_in_tree  # this folder's helper (the scripts run as files)

CHILD = r"""
import json, sys, time
import torch
from feeder import Feeder, ImageFolder, ops
root, epochs, batch, decode, augment = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
size = int(sys.argv[6])
decode = decode if decode == "auto" else int(decode)
augment = augment if augment == "auto" else int(augment)
src = ImageFolder(root)
t0 = time.perf_counter()
cpu0 = time.process_time()
n = 0
first = None
with Feeder(src, batch, [ops.RandomResizedCrop(size), ops.RandomHorizontalFlip()], seed=0,
            decode_threads=decode, augment_threads=augment) as f:
    for epoch in range(epochs):
        f.set_epoch(epoch)
        for x, y in f:
            if first is None:
                first = time.perf_counter() - t0
            n += x.shape[0]
wall = time.perf_counter() - t0
print(json.dumps({"img_s": n / wall, "cpu_ms": 1000 * (time.process_time() - cpu0) / n,
                  "first_s": first, "feeder": __import__("feeder").__file__}))
"""


def _load() -> str:
    """The 1-minute load average (the machine may be shared: figures are read beside it)."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def run(tree: str, args) -> dict:
    return run_in_tree(tree, CHILD, [args.data, str(args.epochs), str(args.batch_size),
                                     args.decode_threads, args.augment_threads, str(args.size)], timeout=600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH (two of them)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop's output side")
    p.add_argument("--decode-threads", default="auto")
    p.add_argument("--augment-threads", default="auto")
    args = p.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    if len(trees) != 2:
        p.error("give exactly two --tree NAME=PATH")
    results: dict[str, list[dict]] = {name: [] for name, _ in trees}
    ratios = []
    loads = [_load()]
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        got = {}
        for name, path in order:
            got[name] = run(os.path.abspath(path), args)
            results[name].append(got[name])
            print(f"round {r + 1} {name}: {got[name]['img_s']:.0f} img/s", file=sys.stderr, flush=True)
        (a, _), (b, _) = trees
        ratios.append(got[b]["img_s"] / got[a]["img_s"])
        loads.append(_load())
    print(f"data {args.data}; RandomResizedCrop({args.size}) + flip, batch {args.batch_size}, {args.epochs} epochs, "
          f"decode_threads={args.decode_threads}, augment_threads={args.augment_threads}, uint8 on CPU; "
          f"{args.rounds} alternating rounds, medians")
    print(f"load average (1 min) before the first round and after each: {', '.join(loads)}")
    print(f"{'tree':<8}{'img/s':>8}{'CPU ms/img':>12}{'1st batch s':>13}")
    for name, _ in trees:
        rs = results[name]
        print(f"{name:<8}{statistics.median(x['img_s'] for x in rs):>8.0f}"
              f"{statistics.median(x['cpu_ms'] for x in rs):>12.2f}"
              f"{statistics.median(x['first_s'] for x in rs):>13.3f}")
    (a, _), (b, _) = trees
    print(f"{b}/{a} images/s, same round: median {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
