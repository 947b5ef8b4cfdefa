"""Where a JPEG index's points along a row should lie, for RandomResizedCrop.

A region decode enters each row of its crop at the index's last point at or
before the crop's first MCU column, and decodes (and drops) the MCUs from
there to that column. Two parts:

* **Simulated**: for each JPEG of DATA (its size and MCU width from its
  header, its points per row from the grid rule of ``feeder/decode/_huffman.c``
  with a feeder's share of points for a source of that many files), crops
  drawn as torchvision's RandomResizedCrop draws them (scale 0.08-1, ratio
  3/4-4/3), widened by 4 pixels a side as the decoder widens a region of a
  subsampled file: the mean MCU columns decoded before a crop's first, with
  the points evenly spaced (every cstride columns, the layout before) and
  left-dense (point j of n at j + (m - n) j^2 / n^2, the layout now).
* **Measured** (``--tree NAME=PATH``, one or more): the per-sample work alone
  in 2 processes, every file read first (``feeder.bench.bare``'s bare-work
  row, run from each tree in turn), CPU per image over the later epochs:
  one round per tree, alternating, ``--rounds`` rounds.

    python bench/experiments/index_columns.py DATA [--crops 20] [--tree before=OLD --tree after=NEW]
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics

import numpy as np

from _trees import run_in_tree
from feeder.decode import extension
from feeder.decode.verified import VerifiedJpegs

MIN_CSTRIDE, PAD = 4, 4


def grid_cols(per_row: int, rows: int, max_points: int) -> tuple[int, int]:
    """Points per row and the columns between them when evenly spaced, as
    entropy_install chooses them."""
    if rows - 1 > max_points:
        return 1, per_row
    cstride = MIN_CSTRIDE
    while cstride < per_row and rows * ((per_row + cstride - 1) // cstride) - 1 > max_points:
        cstride *= 2
    cstride = min(cstride, per_row)
    return (per_row + cstride - 1) // cstride, cstride


def left_dense(per_row: int, n: int) -> np.ndarray:
    j = np.arange(n, dtype=np.int64)
    return j + (per_row - n) * j * j // (n * n)


def rrc_left(rng: np.random.Generator, h: int, w: int) -> int:
    """The first column of a RandomResizedCrop draw (torchvision's get_params)."""
    area = h * w
    lo, hi = math.log(3 / 4), math.log(4 / 3)
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(lo, hi))
        cw = int(round(math.sqrt(target * ratio)))
        ch = int(round(math.sqrt(target / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, w - cw + 1))
    return 0  # the central fallback starts at the side for the usual ratios


def simulate(paths: list[str], crops: int) -> dict[str, float]:
    ext = extension.jpeg
    memory = VerifiedJpegs(files=len(paths))
    rng = np.random.default_rng(0)
    before, after, cols = [], [], []
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        w, h, _, _, sub, _ = ext.header(data)
        mw = 16 if sub in ("4:2:0", "4:2:2") else 8
        mh = 16 if sub in ("4:2:0", "4:4:0") else 8
        pad = PAD if mw == 16 or mh == 16 else 0
        per_row, rows = -(-w // mw), -(-h // mh)
        n, cstride = grid_cols(per_row, rows, memory.points_of(len(data)))
        e, d = np.arange(n) * cstride, left_dense(per_row, n)
        for _ in range(crops):
            col = max(0, rrc_left(rng, h, w) - pad) // mw
            cols.append(col)
            before.append(col - e[np.searchsorted(e, col, side="right") - 1])
            after.append(col - d[np.searchsorted(d, col, side="right") - 1])
    return {"files": len(paths), "crops": len(before), "first_col": float(np.mean(cols)),
            "even": float(np.mean(before)), "left_dense": float(np.mean(after))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="an ImageFolder of JPEGs")
    p.add_argument("--crops", type=int, default=20, help="crops drawn per file in the simulation")
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree to measure")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    paths = sorted(glob.glob(os.path.join(args.data, "*", "*")))
    sim = simulate(paths, args.crops)
    print(f"{args.data}: {sim['files']} files, {sim['crops']} RandomResizedCrop draws; a crop's first "
          f"MCU column {sim['first_col']:.2f} on average; MCU columns decoded before it per row: "
          f"evenly spaced points {sim['even']:.2f}, left-dense {sim['left_dense']:.2f}")
    if not args.tree:
        return
    trees = [spec.split("=", 1) for spec in args.tree]
    got: dict[str, list[float]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, path in trees:
            got[name].append(run_in_tree(path, MEASURE, [args.data], timeout=1800)["cpu_us"])
    print("bare work, 2 processes, epochs 2-3, us of CPU per image (rounds; median):")
    for name, vals in got.items():
        print(f"  {name:12} {', '.join(f'{v:.0f}' for v in vals)}; {statistics.median(vals):.0f}")


MEASURE = r"""
import json, sys, time, os
import feeder
from feeder.bench.bare import BareLoader
from feeder.bench.measure import cpu_seconds
loader = BareLoader(sys.argv[1], 224, processes=2)
try:
    for b, _ in loader.epoch(0):
        pass
    c0, n = cpu_seconds(), 0
    for e in (1, 2):
        for b, _ in loader.epoch(e):
            n += b.shape[0]
    cpu = cpu_seconds() - c0
finally:
    loader.close()
print(json.dumps({"cpu_us": 1e6 * cpu / n, "feeder": feeder.__file__}))
"""


if __name__ == "__main__":
    main()
