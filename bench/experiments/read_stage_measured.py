"""``read_threads="auto"`` for a source that does not say whether its reads wait
(no ``reads_may_block``): the second pass of a Feeder over an in-memory source,
with ``"auto"`` (the first pass's reads measured, the read stage decided from
them) against ``read_threads=32`` (the read stage ``"auto"`` gives such a source
in its first pass, and gave it in every pass before the measure), in
alternating rounds within one process.

    python bench/experiments/read_stage_measured.py --px 64 --rounds 3
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import simplejpeg

from feeder import Feeder, ops
from feeder.synthetic import make_image


class Unsaid:
    """``count`` samples cycling over ``len(blobs)`` encoded images, labels 0-9; no
    ``reads_may_block`` attribute."""

    def __init__(self, blobs: list[bytes], count: int) -> None:
        self.blobs = blobs
        self.count = count

    def __len__(self) -> int:
        return self.count

    def read(self, index: int) -> tuple[bytes, int]:
        return self.blobs[index % len(self.blobs)], index % 10


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


def measure(source: Unsaid, read_threads: int | str, crop: int) -> tuple[float, float, int]:
    """The second pass after its first batch: samples per second, CPU us per sample,
    and the read threads it ran."""
    with Feeder(source, 256, [ops.CenterCrop(crop)], decode_threads=2, augment_threads=0,
                read_threads=read_threads, shuffle=False) as f:
        for _ in f:  # the first pass: the reads "auto" measures
            pass
        f.set_epoch(1)
        it = iter(f)
        next(it)
        cpu0, t0, n = _cpu_s(), time.perf_counter(), 0
        for images, _ in it:
            n += images.shape[0]
        wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
        read = {s.name: s for s in f.stats().stages}["read"]
    return n / wall, 1e6 * cpu / n, int(read.threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--px", type=int, default=64, help="side of the JPEGs (default 64)")
    p.add_argument("--samples", type=int, default=8192, help="samples per pass (default 8192)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    args = p.parse_args()
    blobs = [simplejpeg.encode_jpeg(make_image(args.px, args.px, seed=s), 90) for s in range(8)]
    source = Unsaid(blobs, args.samples)
    settings: list[int | str] = ["auto", 32]
    rows: dict[int | str, list[tuple[float, float, int]]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for setting in settings:
            rows[setting].append(measure(source, setting, args.px // 2))
    print(f"in-memory source without reads_may_block, {args.px} px JPEGs, CenterCrop({args.px // 2}), "
          f"batch 256, 2 decode threads, {args.samples} samples per pass; the second pass; "
          f"medians of {args.rounds} alternating rounds")
    print(f"{'read_threads':>12}  {'pass-2 read threads':>19}  {'samples/s':>9}  {'CPU us/sample':>13}  rounds (samples/s)")
    for setting, got in rows.items():
        rates = [r for r, _, _ in got]
        print(f"{setting!s:>12}  {got[0][2]:>19}  {statistics.median(rates):>9.0f}  "
              f"{statistics.median(c for _, c, _ in got):>13.1f}  {' '.join(f'{r:.0f}' for r in rates)}")


if __name__ == "__main__":
    main()
