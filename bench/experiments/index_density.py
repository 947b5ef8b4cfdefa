"""What the JPEG index's density buys: the region decode's time per image, and
the index's size, for checkpoints every few rows (the first version's row
index) up to every MCU row and every 4 MCUs along it (the finest grid).

For each file of DIR (``--limit``, spread over the set), one RandomResizedCrop
(224) box is drawn as the feeder draws it (``feeder.bench.loaders``'s chain and
plan, seed 0); the index is recorded by a read of the whole file with
``max_points`` = each density (the feeder picks ``max_points`` from
``jpeg_index_bytes`` and the source's length: ``VerifiedJpegs.points_for``);
then, on one thread, every crop is decoded with the extension as the feeder
decodes a crop of bytes it has verified (``decode_region``, ``verify=False``)
with no index and with each density's. Rounds alternate the densities; the
table gives medians over rounds of thread CPU ms per decode, and each density
against the no-index decode and against 16 points; "by size" is the default
feeder's density for each file (its share of the ring, at most one checkpoint
per ``VerifiedJpegs.FILE_BYTES_PER_POINT`` bytes of the file), and ``--caps K,...``
adds rows capped at 1/K of each file instead. ``--as-420`` re-encodes the
files with OpenCV first (4:2:0, quality 90), as most photographs are stored.

    python bench/experiments/index_density.py DIR [--limit 400] [--rounds 5] [--as-420] [--caps 32,64]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import cv2
import numpy as np

from feeder import ImageFolder
from feeder.bench.ceiling import timed_indices
from feeder.bench.loaders import sample_work, transforms
from feeder.decode import _jpeg
from feeder.decode.region import decode_region
from feeder.sample.rng import sample_key
from feeder.decode.verified import VerifiedJpegs

DENSITIES = (16, 64, 256, 1024, 4096)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--limit", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--as-420", action="store_true", help="re-encode as 4:2:0, quality 90 first")
    p.add_argument("--caps", default="",
                   help="comma-separated K: also rows capped at 1/K of each file (FILE_BYTES_PER_POINT "
                        "= K x POINT_BYTES), to weigh another cap against the default's")
    args = p.parse_args()
    source = ImageFolder(args.dir)
    datas = [bytes(source.read(i)[0]) for i in timed_indices(len(source), args.limit)]
    if args.as_420:
        params = [cv2.IMWRITE_JPEG_QUALITY, 90, cv2.IMWRITE_JPEG_SAMPLING_FACTOR,
                  cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420]
        datas = [cv2.imencode(".jpg", cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR),
                              params)[1].tobytes() for d in datas]
    work = sample_work(transforms())
    jobs = []
    for i, data in enumerate(datas):
        w, h, _, _, sub, _ = _jpeg.header(data)
        need, planned = work.plan(h, w, sample_key(0, 0, i))
        jobs.append((data, h, w, need, planned, sub))
    whole = np.empty(max(h * w for _, h, w, *_ in jobs) * 3 + (1 << 16), np.uint8)
    # "by size": what a feeder over these files records by default, its share of
    # the default ring capped by the file's size (VerifiedJpegs.points_of).
    memory = VerifiedJpegs(files=len(source))
    indexes: dict[object, list[bytes]] = {}
    caps = {f"1/{k} file": int(k) for k in args.caps.split(",") if k}

    def most_points(points: object, nbytes: int) -> int:
        if points == "by size":
            return memory.points_of(nbytes)
        if points in caps:
            share = nbytes // (caps[points] * memory.POINT_BYTES)
            return max(memory.MIN_POINTS, min(memory.points, share))
        return points

    for points in DENSITIES + ("by size",) + tuple(caps):
        indexes[points] = []
        for data, h, w, *_ in jobs:
            most = most_points(points, len(data))
            made = _jpeg.decode(data, 0, 0, h, w, 1, whole, 1 << 31, False, True, record=True,
                                max_points=most)[2]
            indexes[points].append(made)
    rows = ("none",) + DENSITIES + ("by size",) + tuple(caps)
    times: dict[object, list[float]] = {r: [] for r in rows}
    for r in range(args.rounds):
        order = rows[r % len(rows):] + rows[:r % len(rows)]
        for row in order:
            t = time.thread_time()
            for j, (data, h, w, need, planned, _) in enumerate(jobs):
                index = None if row == "none" else indexes[row][j]
                decode_region(_jpeg, data, h, w, need, planned, 1, 1 << 31, None, False, index=index)
            times[row].append((time.thread_time() - t) / len(jobs) * 1e3)
    med = {row: statistics.median(v) for row, v in times.items()}
    subs = collections.Counter(job[5] for job in jobs)
    print(f"{args.dir}{' re-encoded 4:2:0 q90' if args.as_420 else ''}: {len(jobs)} files "
          f"({', '.join(f'{k} {v}' for k, v in subs.most_common())}), RandomResizedCrop(224) boxes, "
          f"one thread, median of {args.rounds} rounds")
    print(f"{'max_points':>12} {'index bytes':>12} {'ms/decode':>10} {'/ none':>7} {'/ 16 pts':>9}")
    for row in rows:
        size = "" if row == "none" else f"{statistics.mean(len(x or b'') for x in indexes[row]):.0f}"
        ratio16 = "" if row == "none" else f"{med[row] / med[16]:.3f}"
        print(f"{row:>12} {size:>12} {med[row]:>10.3f} {med[row] / med['none']:>7.3f} {ratio16:>9}")


if __name__ == "__main__":
    main()
