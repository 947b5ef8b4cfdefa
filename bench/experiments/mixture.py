"""A mixture's proportions over its epochs, and how fast a huge one starts.

Proportions: for mixtures of 2, 3, 5 and 8 sources (skewed weights, small
sources that repeat within an epoch and large ones that stream across epochs),
over several seeds and epochs, the largest ``|drawn_k(n) - weights[k] * n|`` over
every prefix ``n`` of the epoch and every source ``k`` (in samples), the
largest over the contiguous share of each of 8 ranks, and the bound the
docstring states. Start-up: the seconds from building the source to the first
batch of positions of a rank's order (``EpochPlan.order`` then ``take``) and to
a feeder's first batch, for a mixture of 10^9 + 10^6 + 10^4 lazy samples
beside its largest source alone; median of ``--rounds`` rounds, the ratio
within each round.

    PYTHONPATH=. python bench/experiments/mixture.py [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import numpy as np

from feeder import Feeder, Mixture, ops
from feeder.order.mixture import Interleave
from feeder.order.plan import EpochPlan, OrderOptions

PIXELS = np.full((8, 8, 3), 127, np.uint8)


class Lazy:
    """``n`` samples computed on demand: a small decoded image and the index."""

    reads_may_block = False

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def read(self, index: int):
        return PIXELS, index % 1000


def deviations(mix: Mixture, epochs: int, seeds: int, ranks: int = 8) -> tuple[float, float, float]:
    """(largest prefix deviation, largest over a rank's share, the stated bound)."""
    k, n = len(mix.sources), len(mix)
    w = np.asarray(mix.weights)
    worst = share_worst = 0.0
    for seed in range(seeds):
        for epoch in range(epochs):
            order = np.asarray(mix.epoch_order(seed, epoch, True)[:])
            source = mix.source_of(order)
            assert (source == Interleave(mix.counts)(np.arange(n))[0]).all()
            drawn = np.cumsum(np.eye(k, dtype=np.int64)[source], axis=0)
            positions = np.arange(1, n + 1)[:, None]
            worst = max(worst, float(np.abs(drawn - positions * w).max()))
            size = n // ranks
            for r in range(ranks):
                part = np.cumsum(np.eye(k, dtype=np.int64)[source[r * size:(r + 1) * size]], axis=0)
                share_worst = max(share_worst, float(np.abs(
                    part - np.arange(1, size + 1)[:, None] * w).max()))
    depth = math.ceil(math.log2(k)) if k > 1 else 0
    bound = max(1 + depth * (1 + 1 / c) / 2 for c in mix.counts)
    return worst, share_worst, bound


CASES = [
    ("2 sources, 0.9/0.1", [1000, 50_000], [0.9, 0.1]),
    ("2 sources, 0.5/0.5", [300, 20_000], [0.5, 0.5]),
    ("3 sources, 0.6/0.3/0.1", [2000, 500, 30_000], [0.6, 0.3, 0.1]),
    ("5 sources, skewed", [100, 2000, 5000, 700, 12_000], [0.02, 0.08, 0.3, 0.1, 0.5]),
    ("8 sources, equal", [100 * (i + 1) for i in range(8)], [1] * 8),
    ("8 sources, 1..8", [900] * 8, list(range(1, 9))),
]


def proportions(lines: list[str]) -> None:
    lines.append("proportions: largest |drawn_k(n) - weights[k] * n| over every prefix n of each "
                 "epoch (4 epochs x 3 seeds), samples")
    lines.append(f"  {'mixture':28} {'positions':>9} {'prefix':>7} {'8 ranks':>8} {'bound':>6}")
    for name, lengths, weights in CASES:
        mix = Mixture([Lazy(n) for n in lengths], weights)
        worst, share, bound = deviations(mix, epochs=4, seeds=3)
        lines.append(f"  {name:28} {len(mix):9d} {worst:7.3f} {share:8.3f} {bound:6.3f}")


def first_positions(source, batch: int = 256) -> float:
    t = time.perf_counter()
    plan = EpochPlan(source, OrderOptions(batch_size=batch))
    order = plan.order(3, rank=5, world_size=8, seed=1)
    order.take(len(order) // 2, len(order) // 2 + batch)  # a resumed pass's first batch
    order.take(0, batch)
    return time.perf_counter() - t


def first_batch(source, batch: int = 256) -> float:
    t = time.perf_counter()
    with Feeder(source, batch, [ops.Resize((8, 8))], shuffle=True, seed=1, decode_threads=2) as f:
        next(iter(f))
    return time.perf_counter() - t


def startup(lines: list[str], rounds: int) -> None:
    largest = 10 ** 9
    rows = {"order": [], "feeder": []}
    for _ in range(rounds):
        for kind, fn in (("order", first_positions), ("feeder", first_batch)):
            t0 = time.perf_counter()
            alone = fn(Lazy(largest))
            mixed_t = time.perf_counter()
            mix = Mixture([Lazy(largest), Lazy(10 ** 6), Lazy(10 ** 4)], [0.7, 0.2, 0.1])
            built = time.perf_counter() - mixed_t
            mixed = built + fn(mix)
            rows[kind].append((alone, mixed, mixed / alone, time.perf_counter() - t0))
    lines.append(f"start-up, 10^9 + 10^6 + 10^4 lazy samples vs the 10^9 source alone "
                 f"(median of {rounds} rounds, ratio within each round)")
    for kind, what in (("order", "plan + a rank's first 256 positions (and a mid-epoch 256)"),
                       ("feeder", "Feeder(...) to its first batch of 256")):
        alone = statistics.median(r[0] for r in rows[kind])
        mixed = statistics.median(r[1] for r in rows[kind])
        ratio = statistics.median(r[2] for r in rows[kind])
        lines.append(f"  {what:60} alone {alone * 1e3:8.2f} ms  mixture {mixed * 1e3:8.2f} ms  "
                     f"ratio {ratio:5.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    lines: list[str] = []
    proportions(lines)
    startup(lines, args.rounds)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    lines.append(f"load average before {' '.join(load_before)}, after {' '.join(load_after)}; "
                 f"python {platform.python_version()}, numpy {np.__version__}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# PYTHONPATH=. python bench/experiments/mixture.py --rounds {args.rounds} "
                    f"--out {args.out}\n{text}\n")


if __name__ == "__main__":
    main()
