"""``ceiling``: the machine's limit for this work, measured.

One thread does the feeder's per-sample work with nothing around it (no
queues, no other threads): read the file, decode it (simplejpeg, with the same
reduced-scale hint the feeder uses), RandomResizedCrop(224) + flip into a
preallocated slot. Its cost per image times the number of cores is the most
images per second any loader could reach on this machine with this decoder,
if the work spread perfectly and nothing else ran.

Cores are rarely that independent: they share caches, memory bandwidth and a
power budget, so two cores busy at once each run slower than one alone. The
*parallel* measurement times that directly: one process per core, each doing
the same loop over its own share of the images, all started together. No
loader can beat it on this machine, since it has no coordination cost at all.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import queue
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import cv2
import numpy as np

from .. import ImageFolder
from ..errors import error_line
from ..sample.rng import sample_key
from ..engine.threads import available_cores
from . import report
from .report import median
from .loaders import sample_work, full_decode_transforms, transforms

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


def timed_indices(size: int, limit: int, shard: int = 0, shards: int = 1) -> list[int]:
    """The dataset indices share ``shard`` of ``shards`` times: up to ``limit`` each.

    The shares are disjoint, and together they are ``min(limit * shards, size)``
    indices spread evenly over the dataset (every class, as the loaders see).
    """
    n = min(limit * shards, size)
    return np.linspace(0, size - 1, n).astype(int).tolist()[shard::shards]


def measure(root: str, limit: int = 500, full_decode: bool = False, seed: int = 0,
            shard: int = 0, shards: int = 1, ready: Callable[[], None] | None = None) -> Ceiling:
    """Time the per-sample work on one thread over up to ``limit`` images of ``root``.

    The images are spread evenly over the dataset (every class), read and
    worked on once untimed first, so that the figure is of a warm page cache,
    as in the loaders' runs, and of an epoch after the first. OpenCV is held
    to one thread meanwhile (the feeder does the same).

    Args:
        root: ImageFolder root.
        limit: Most images timed.
        full_decode: Switch reduced-scale decode off (as ``scaled-decode`` does).
        seed: Seed of the per-sample crop parameters.
        shard, shards: Time share ``shard`` of ``shards`` disjoint shares of up
            to ``limit * shards`` images (for :func:`measure_parallel`).
        ready: Called after the warm-up, just before the timed loop.

    Returns:
        The measured costs.
    """
    source = ImageFolder(root)
    indices = timed_indices(len(source), limit, shard, shards)
    n = len(indices)
    work = sample_work(full_decode_transforms() if full_decode else transforms(), files=len(source))
    h, w = work.image_size
    out = np.empty((h, w, 3), np.uint8)
    saved = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        for i in indices:  # warm the page cache and the code paths
            source.read(i)
        # One untimed pass of the work too: the timed one is an epoch after the
        # first, as most of a training run's are (jpeg_verify reads each file
        # to its end the first time only; see feeder.decode.verified).
        for i in indices:
            try:
                work(source.read(i)[0], sample_key(seed, 0, i), out)
            except Exception as exc:  # a file the work cannot take: named, as a feeder names it
                raise ValueError(f"{source.paths[i]}: {error_line(exc)}") from exc
        if ready is not None:
            ready()
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


@dataclass
class ParallelCeiling:
    """The per-sample work run by ``processes`` processes at once, one per core.

    Attributes:
        processes: Processes run together.
        images: Images timed, over all processes.
        span_s: Wall seconds from the first process's start to the last one's end.
        cpu_s: CPU seconds of the timing threads, summed.
        read_s, decode_s, transform_s: Wall seconds in each part, summed over images.
        process_images_per_s: Each process's own rate.
    """

    processes: int
    images: int
    span_s: float
    cpu_s: float
    read_s: float
    decode_s: float
    transform_s: float
    process_images_per_s: list[float] = field(default_factory=list)

    @property
    def images_per_s(self) -> float:
        return self.images / self.span_s if self.span_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        n = max(1, self.images)
        d.update(per_image_ms=1e3 * self.span_s * self.processes / n,  # core time per image
                 read_ms=1e3 * self.read_s / n, decode_ms=1e3 * self.decode_s / n,
                 transform_ms=1e3 * self.transform_s / n, cores=self.processes,
                 single_thread_images_per_s=(sum(self.process_images_per_s) / len(self.process_images_per_s)
                                             if self.process_images_per_s else 0.0),
                 ceiling_images_per_s=self.images_per_s)
        return d


_START_TIMEOUT_S = 300.0  # slowest process's start-up and warm-up, on a loaded machine


def _parallel_worker(root: str, shard: int, shards: int, limit: int, full_decode: bool, seed: int,
                     barrier: Any, results: Any) -> None:
    start: list[float] = []

    def ready() -> None:
        barrier.wait(_START_TIMEOUT_S)
        start.append(time.monotonic())  # system-wide clock: comparable across processes

    try:
        c = measure(root, limit, full_decode, seed, shard, shards, ready)
        results.put((shard, None, c, start[0], time.monotonic()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        barrier.abort()  # release the others from the start line
        results.put((shard, f"{type(exc).__name__}: {exc}", None, 0.0, 0.0))


def next_result(results: Any, procs: list[Any], deadline: float, what: str, timeout_s: float) -> Any:
    """The next item of the queue ``results``, which ``procs`` fill, polled: a
    ``RuntimeError`` naming one of ``procs`` that died (a nonzero exit code),
    a ``TimeoutError`` once ``time.monotonic()`` passes ``deadline`` (set
    ``timeout_s`` after the wait began); ``what`` begins the messages."""
    while True:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{what}: process {dead[0].name} died "
                                   f"(exit code {dead[0].exitcode})") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: no result in {timeout_s:.0f} s") from None


def measure_parallel(root: str, processes: int | None = None, limit: int = 500, full_decode: bool = False,
                     seed: int = 0, timeout_s: float = 900.0) -> ParallelCeiling:
    """Run :func:`measure` in ``processes`` processes at once, on disjoint shares of the images.

    Each process warms up, waits at a common start line, then times up to
    ``limit`` images of its own. The rate is all images over the span from the
    first start to the last end.

    Args:
        root: ImageFolder root.
        processes: Processes (default: the cores this process may run on).
        limit: Most images timed per process.
        full_decode, seed: As :func:`measure`.
        timeout_s: Give up (``TimeoutError``) when results have not all come by then.

    Raises:
        RuntimeError: a process failed (its error is in the message) or died.
        TimeoutError: no result within ``timeout_s``.
    """
    n = processes or available_cores()
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [ctx.Process(target=_parallel_worker, daemon=True, name=f"ceiling-{k}",
                         args=(root, k, n, limit, full_decode, seed, barrier, results)) for k in range(n)]
    for p in procs:
        p.start()
    got: dict[int, tuple[Ceiling, float, float]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < n:
            waiting = [p for k, p in enumerate(procs) if k not in got]
            shard, error, c, t0, t1 = next_result(results, waiting, deadline, "parallel ceiling", timeout_s)
            if error is not None:
                raise RuntimeError(f"parallel ceiling: process ceiling-{shard} failed: {error}")
            got[shard] = (c, t0, t1)
    finally:
        barrier.abort()
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    parts = [c for c, _, _ in got.values()]
    return ParallelCeiling(
        processes=n, images=sum(c.images for c in parts),
        span_s=max(t1 for _, _, t1 in got.values()) - min(t0 for _, t0, _ in got.values()),
        cpu_s=sum(c.cpu_s for c in parts), read_s=sum(c.read_s for c in parts),
        decode_s=sum(c.decode_s for c in parts), transform_s=sum(c.transform_s for c in parts),
        process_images_per_s=[got[k][0].single_thread_images_per_s for k in sorted(got)])


COLUMNS = [
    ("work", "work", "{}"),
    ("how", "how", "{}"),
    ("images", "images", "{:d}"),
    ("read_ms", "read ms", "{:.3f}"),
    ("decode_ms", "decode ms", "{:.3f}"),
    ("transform_ms", "crop+flip ms", "{:.3f}"),
    ("per_image_ms", "total ms/img", "{:.3f}"),
    ("single_thread_images_per_s", "1-thread img/s", "{:.0f}"),
    ("cores", "cores", "{:d}"),
    ("ceiling_images_per_s", "ceiling img/s", "{:.0f}"),
    ("of_single_x_cores", "of 1-thread x cores", "{:.0%}"),
]


def run(args: argparse.Namespace) -> int:
    """The ``ceiling`` subcommand: measure ``--repeats`` times, keep the median.

    Each repeat times the single thread, then the same work in one process per
    core at once, so the two rows of a repeat saw the same machine.
    """
    rows = []
    processes = args.processes or available_cores()
    for full in ([False, True] if args.full_decode_too else [False]):
        what = "full decode" if full else "feeder work"
        work = "read+decode+RRC224+flip" + (" (full decode)" if full else "")
        single, parallel = [], []
        for r in range(args.repeats):
            report.progress(f"ceiling: {what} repeat {r + 1}/{args.repeats}: 1 thread")
            single.append(measure(args.dir, limit=args.limit, full_decode=full))
            report.progress(f"ceiling: {what} repeat {r + 1}/{args.repeats}: {processes} processes at once")
            parallel.append(measure_parallel(args.dir, processes, limit=args.limit, full_decode=full))
        med = sorted(single, key=lambda c: c.total_s)[len(single) // 2]
        row = {"work": work, "how": "1 thread x cores"}
        row.update(med.as_dict())
        row["repeats_ceiling_images_per_s"] = [c.images_per_s for c in single]
        rows.append(row)
        pmed = sorted(parallel, key=lambda c: c.images_per_s)[len(parallel) // 2]
        prow = {"work": work, "how": f"{processes} processes at once"}
        prow.update(pmed.as_dict())
        prow["repeats_ceiling_images_per_s"] = [c.images_per_s for c in parallel]
        prow["of_single_x_cores"] = median([p.images_per_s / s.images_per_s
                                            for s, p in zip(single, parallel) if s.images_per_s > 0])
        rows.append(prow)
    print(report.format_table(rows, COLUMNS, title=f"ceiling on {args.dir} (median of {args.repeats})"))
    report.write_outputs(args.out, "ceiling", rows, {"dir": args.dir, "limit": args.limit,
                                                     "repeats": args.repeats, "processes": processes})
    return 0
