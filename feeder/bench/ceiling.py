"""``ceiling``: the machine's limit for this work, measured.

One thread does the feeder's per-sample work with nothing around it (no
queues, no other threads): read the file, decode it (simplejpeg, with the same
reduced-scale hint the feeder uses), RandomResizedCrop(224) + flip into a
preallocated slot. Its cost per image times the number of cores is the most
images per second any loader could reach on this machine with this decoder,
if the work spread perfectly and nothing else ran.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import cv2
import numpy as np

from .. import ImageFolder
from .._rng import sample_key
from .._threads import available_cores
from . import report
from .loaders import SampleWork, full_decode_transforms, transforms

log = logging.getLogger(__name__)


@dataclass
class Ceiling:
    """Single-thread cost of the per-sample work.

    Attributes:
        images: Images timed.
        total_s: Wall seconds of the timed loop.
        cpu_s: CPU seconds of the timing thread over the loop.
        read_s, decode_s, transform_s: Wall seconds in each part, summed over images.
        cores: Cores this process may run on.
    """

    images: int
    total_s: float
    cpu_s: float
    read_s: float
    decode_s: float
    transform_s: float
    cores: int

    @property
    def per_image_s(self) -> float:
        return self.total_s / self.images if self.images else 0.0

    @property
    def single_thread_images_per_s(self) -> float:
        return self.images / self.total_s if self.total_s > 0 else 0.0

    @property
    def images_per_s(self) -> float:
        """The ceiling: single-thread rate times the cores."""
        return self.cores * self.single_thread_images_per_s

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(per_image_ms=1e3 * self.per_image_s,
                 read_ms=1e3 * self.read_s / max(1, self.images),
                 decode_ms=1e3 * self.decode_s / max(1, self.images),
                 transform_ms=1e3 * self.transform_s / max(1, self.images),
                 single_thread_images_per_s=self.single_thread_images_per_s,
                 ceiling_images_per_s=self.images_per_s)
        return d


def measure(root: str, limit: int = 500, full_decode: bool = False, seed: int = 0) -> Ceiling:
    """Time the per-sample work on one thread over up to ``limit`` images of ``root``.

    The images are spread evenly over the dataset (every class), read once
    untimed first so the figure is of a warm page cache, as in the loaders'
    runs. OpenCV is held to one thread meanwhile (the feeder does the same).

    Args:
        root: ImageFolder root.
        limit: Most images timed.
        full_decode: Switch reduced-scale decode off (as ``scaled-decode`` does).
        seed: Seed of the per-sample crop parameters.

    Returns:
        The measured costs.
    """
    source = ImageFolder(root)
    n = min(limit, len(source))
    indices = np.linspace(0, len(source) - 1, n).astype(int).tolist()
    work = SampleWork(full_decode_transforms() if full_decode else transforms())
    h, w = work.image_size
    out = np.empty((h, w, 3), np.uint8)
    saved = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        for i in indices:  # warm the page cache and the code paths
            source.read(i)
        for i in indices[:20]:
            work(source.read(i)[0], i, out)
        read_s = decode_s = transform_s = 0.0
        clock = time.perf_counter
        cpu0 = time.thread_time()
        start = clock()
        for i in indices:
            t0 = clock()
            data, _ = source.read(i)
            t1 = clock()
            key = sample_key(seed, 0, i)
            img, ctx = work.decode(data, key)
            t2 = clock()
            work.transform(img, key, ctx, out)
            t3 = clock()
            read_s += t1 - t0
            decode_s += t2 - t1
            transform_s += t3 - t2
        total_s = clock() - start
        cpu_s = time.thread_time() - cpu0
    finally:
        cv2.setNumThreads(saved)
    return Ceiling(images=n, total_s=total_s, cpu_s=cpu_s, read_s=read_s, decode_s=decode_s,
                   transform_s=transform_s, cores=available_cores())


COLUMNS = [
    ("work", "work", "{}"),
    ("images", "images", "{:d}"),
    ("read_ms", "read ms", "{:.3f}"),
    ("decode_ms", "decode ms", "{:.3f}"),
    ("transform_ms", "crop+flip ms", "{:.3f}"),
    ("per_image_ms", "total ms/img", "{:.3f}"),
    ("single_thread_images_per_s", "1-thread img/s", "{:.0f}"),
    ("cores", "cores", "{:d}"),
    ("ceiling_images_per_s", "ceiling img/s", "{:.0f}"),
]


def run(args: argparse.Namespace) -> int:
    """The ``ceiling`` subcommand: measure ``--repeats`` times, keep the median."""
    rows = []
    for full in ([False, True] if args.full_decode_too else [False]):
        results = []
        for r in range(args.repeats):
            report.progress(f"ceiling: {'full decode' if full else 'feeder work'} "
                            f"repeat {r + 1}/{args.repeats}")
            results.append(measure(args.dir, limit=args.limit, full_decode=full))
        med = sorted(results, key=lambda c: c.total_s)[len(results) // 2]
        row = {"work": "read+decode+RRC224+flip" + (" (full decode)" if full else "")}
        row.update(med.as_dict())
        row["repeats_ceiling_images_per_s"] = [c.images_per_s for c in results]
        rows.append(row)
    print(report.format_table(rows, COLUMNS, title=f"ceiling on {args.dir} (median of {args.repeats})"))
    report.write_outputs(args.out, "ceiling", rows, {"dir": args.dir, "limit": args.limit,
                                                     "repeats": args.repeats})
    return 0
