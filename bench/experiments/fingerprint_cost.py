"""What the verified-JPEG memory's fingerprint costs per file.

Every JPEG of every epoch is fingerprinted (its length and a CRC of all its
bytes, ``feeder/decode/verified.py``) before the region decode decides whether
to read it to its end. This times, on one thread, per file of each directory
given: zlib's CRC-32 (the first version's fingerprint, and what a CPU
without the instruction still runs) and the extension's CRC-32C with the
CPU's instruction (three streams, joined). Best of
``--repeats`` passes of thread CPU time, and the rate in GB/s.

    python bench/experiments/fingerprint_cost.py DIR [DIR ...] [--limit 400] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time
import zlib

from feeder import ImageFolder
from feeder.bench.ceiling import timed_indices
from feeder.decode import _jpeg


def per_file_us(fn, datas: list[bytes], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        for d in datas:
            fn(d)
        best = min(best, (time.thread_time() - t) / len(datas) * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+")
    p.add_argument("--limit", type=int, default=400)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print(f"fingerprint cost, one thread, best of {args.repeats} passes "
          f"(CRC-32C instruction present: {bool(_jpeg.CRC32C_HARDWARE)})")
    ways = [("zlib CRC-32", zlib.crc32), ("CRC-32C, instruction", _jpeg.crc32c)]
    for root in args.dirs:
        source = ImageFolder(root)
        datas = [bytes(source.read(i)[0]) for i in timed_indices(len(source), args.limit)]
        mean_kb = sum(map(len, datas)) / len(datas) / 1024
        print(f"{root}: {len(datas)} files, mean {mean_kb:.0f} KiB")
        for name, fn in ways:
            us = per_file_us(fn, datas, args.repeats)
            print(f"  {name:22s} {us:8.1f} us per file  {mean_kb * 1024 / us / 1e3:6.1f} GB/s")


if __name__ == "__main__":
    main()
