"""What a read stage costs when reads do not wait: CPU per sample and context
switches per sample of a Feeder over an in-memory source that says its reads
may block (so ``read_threads`` counts are honoured as given), for several read
thread counts, in alternating rounds within one process.

The source returns the same few JPEGs from memory, so a read takes no time: what
differs between the rows is the hand-over from read threads to decode threads
(one wake-up per sample, the turnstile of ``engine/read.py``). 0 read threads
read in the decode threads, as ``read_threads="auto"`` does for local storage
and for a block shuffle's cached window.

    python bench/experiments/read_stage_cost.py --read-threads 0,4,32 --px 64 --rounds 3
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import simplejpeg

from feeder import Feeder, ops
from feeder.synthetic import make_image


class MemorySource:
    """``count`` samples cycling over ``len(blobs)`` encoded images, labels 0-9."""

    reads_may_block = True  # so that read_threads is what is asked for

    def __init__(self, blobs: list[bytes], count: int) -> None:
        self.blobs = blobs
        self.count = count

    def __len__(self) -> int:
        return self.count

    def read(self, index: int) -> tuple[bytes, int]:
        return self.blobs[index % len(self.blobs)], index % 10


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime, r.ru_nvcsw + r.ru_nivcsw


def measure(source: MemorySource, read_threads: int, crop: int) -> dict[str, float]:
    """One pass after its first batch: samples per CPU second and per second,
    and context switches per sample."""
    with Feeder(source, 256, [ops.CenterCrop(crop)], decode_threads=2, augment_threads=0,
                read_threads=read_threads, shuffle=False) as f:
        it = iter(f)
        next(it)
        cpu0, sw0 = _usage()
        t0, n = time.perf_counter(), 0
        for images, _ in it:
            n += images.shape[0]
        wall = time.perf_counter() - t0
        cpu, sw = _usage()
    return {"per_cpu_s": n / (cpu - cpu0), "per_s": n / wall, "switches": (sw - sw0) / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--read-threads", default="0,4,32", help="read thread counts (default 0,4,32)")
    p.add_argument("--px", type=int, default=64, help="side of the JPEGs (default 64)")
    p.add_argument("--samples", type=int, default=0,
                   help="samples per pass (default: 40000 at 64 px, scaled down with the pixels)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    args = p.parse_args()
    counts = [int(x) for x in args.read_threads.split(",")]
    blobs = [simplejpeg.encode_jpeg(make_image(args.px, args.px, seed=i), quality=85, colorspace="RGB")
             for i in range(64)]
    samples = args.samples or max(2048, int(40000 * (64 / args.px) ** 2))
    source = MemorySource(blobs, samples)
    crop = min(224, args.px // 2)
    runs: dict[int, list[dict[str, float]]] = {c: [] for c in counts}
    for r in range(args.rounds):
        for c in (counts if r % 2 == 0 else counts[::-1]):
            runs[c].append(measure(source, c, crop))
    print(f"in-memory source, {args.px} px JPEGs, CenterCrop({crop}), batch 256, 2 decode threads, "
          f"{samples} samples per pass; medians of {args.rounds} alternating rounds")
    print(f"{'read threads':>12}  {'samples/CPU s':>13}  {'samples/s':>9}  {'switches/sample':>15}  {'CPU vs 0':>8}")
    base = statistics.median(x["per_cpu_s"] for x in runs[counts[0]])
    for c in counts:
        per_cpu = statistics.median(x["per_cpu_s"] for x in runs[c])
        print(f"{c:>12}  {per_cpu:13.0f}  {statistics.median(x['per_s'] for x in runs[c]):9.0f}  "
              f"{statistics.median(x['switches'] for x in runs[c]):15.2f}  {per_cpu / base:8.3f}")


if __name__ == "__main__":
    main()
