"""The per-sample work alone (``FeederWorkDataset.sample``: what DataLoader's
rows of ``feeder-bench peers`` run in each worker, feeder's own SampleWork)
on one thread, pass after pass over an ImageFolder in a new order each pass,
thread CPU per image: the first pass (every file a first read: read to its
end, its index recorded), the later ones (every file indexed), and a fresh
dataset's second pass after a first pass over half the files (a DataLoader
worker's second epoch with 2 workers: about half its reads are first reads).

    python bench/experiments/work_passes.py DATA [--passes 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from feeder.bench.loaders import FeederWorkDataset


def timed_pass(ds: FeederWorkDataset, order: np.ndarray, epoch: int) -> float:
    start = time.thread_time()
    for i in order:
        ds.sample(int(i), epoch)
    return (time.thread_time() - start) / len(order)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="an ImageFolder of JPEGs")
    p.add_argument("--passes", type=int, default=4)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    ds = FeederWorkDataset(args.data)
    n = len(ds)
    for epoch in range(args.passes):
        ms = 1e3 * timed_pass(ds, rng.permutation(n), epoch)
        print(f"pass {epoch + 1} ({'first reads' if epoch == 0 else 'indexed'}): {ms:.3f} ms per image")
    half = FeederWorkDataset(args.data)
    timed_pass(half, rng.permutation(n)[: n // 2], 0)
    ms = 1e3 * timed_pass(half, rng.permutation(n), 1)
    print(f"a fresh dataset's pass 2 after a pass over half the files: {ms:.3f} ms per image")


if __name__ == "__main__":
    main()
