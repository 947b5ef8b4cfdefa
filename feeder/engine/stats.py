"""Where the pipeline's time goes: per-stage and per-queue counters, cheap to keep.

Each stage thread times only its queue waits (two clock reads per wait); busy
time is what is left of its lifetime. ``Feeder.stats()`` folds them into a
:class:`Stats`, which prints as a table.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from ..errors import safe_text

log = logging.getLogger("feeder")


@dataclass(frozen=True)
class StageStats:
    """One stage, summed over its threads and over every pass so far.

    Attributes:
        name: Stage name.
        threads: Threads per pass; 0 for the augment stage when the decode
            threads run the transforms (``augment_threads=0``), and for the
            read stage once ``read_threads="auto"`` has measured a source's reads
            as fast (reads then run in the decode threads; its counters are
            the earlier passes').
        items: Items handled (samples; batches for the sampler and transfer).
        busy_s: Thread-seconds spent working.
        wait_input_s: Thread-seconds waiting for input (upstream too slow).
        wait_output_s: Thread-seconds blocked on a full output queue or a free
            buffer (downstream too slow).
        inline_s: Thread-seconds these threads spent running the next stage's
            work (decode threads running the transforms with ``augment_threads=0``);
            counted in that stage's ``busy_s``, not in this one's.
        cpu_s: CPU seconds its threads used (kept for the transfer stage, 0
            for the others): on CUDA, far below ``busy_s`` when the thread
            sleeps while the copies run, as it should.
    """

    name: str
    threads: int
    items: int
    busy_s: float
    wait_input_s: float
    wait_output_s: float
    inline_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def cpu_per_item_s(self) -> float:
        """CPU seconds per item (per batch for the transfer stage)."""
        return self.cpu_s / self.items if self.items else 0.0

    @property
    def utilization(self) -> float:
        """Fraction of thread time spent working, the next stage's inline work included
        (0 for a stage run inline by another's threads)."""
        if self.threads == 0:
            return 0.0
        work = self.busy_s + self.inline_s
        total = work + self.wait_input_s + self.wait_output_s
        return work / total if total > 0 else 0.0


@dataclass(frozen=True)
class QueueStats:
    """One queue (named after the stage it feeds).

    Attributes:
        name: Queue name.
        capacity: Maximum items.
        depth: Items in it now.
        mean_depth: Mean depth seen right after each put.
        max_depth: Deepest it has been.
    """

    name: str
    capacity: int
    depth: int
    mean_depth: float
    max_depth: int


@dataclass(frozen=True)
class MemoryStats:
    """What a feeder's own memory holds now, in bytes (see the memory page,
    ``docs/design/memory.md``, for the bounds and for what else a process adds).

    Attributes:
        batch_buffers: The batch buffers alive: images, labels, indices, numeric
            fields and mask planes (page-locked on CUDA; shared memory with
            ``isolation="process"``).
        scratch: One-sample arrays alive, for samples finished before their
            batch had a buffer.
        decode_buffers: Reused JPEG decode buffers alive, spare or holding an image.
        jpeg_table: The region decoder's tables of files read to their end and of
            where their indexes are (mapped; resident as their pages are written).
        jpeg_indexes: Bytes of the JPEG index ring written (resident), at most
            ``jpeg_index_bytes``.
    """

    batch_buffers: int = 0
    scratch: int = 0
    decode_buffers: int = 0
    jpeg_table: int = 0
    jpeg_indexes: int = 0

    @property
    def total(self) -> int:
        """The sum of the above."""
        return (self.batch_buffers + self.scratch + self.decode_buffers + self.jpeg_table
                + self.jpeg_indexes)

    def __str__(self) -> str:
        mib = 1 << 20
        return (f"memory: {self.total / mib:.1f} MiB: batch buffers {self.batch_buffers / mib:.1f}, "
                f"scratch {self.scratch / mib:.1f}, decode buffers {self.decode_buffers / mib:.1f}, "
                f"JPEG table {self.jpeg_table / mib:.1f}, JPEG indexes {self.jpeg_indexes / mib:.1f}")


@dataclass(frozen=True)
class Stats:
    """A snapshot of a feeder's counters since it was built.

    Attributes:
        stages: Per-stage counters, in pipeline order.
        queues: Per-queue counters, in pipeline order.
        samples: Samples delivered to the training loop.
        batches: Batches delivered.
        skipped: Samples skipped under ``on_error="skip"``.
        consumer_wait_s: Seconds the training loop waited inside ``next()``:
            the time the model was starved of data.
        elapsed_s: Seconds since the first pass started.
        buffers: Batch buffers allocated.
        waiting_in_next: Threads of the training loop waiting inside ``next()``
            right now (a loop stalled on its data shows 1).
        active_threads: With ``"tune"`` thread counts (``decode_threads``,
            ``augment_threads``, ``read_threads``): ``(seconds since the first
            pass started, stage, active threads)`` for each tuned stage at each
            pass's start and at each change, oldest first (the last
            ``ACTIVE_HISTORY``).
        memory: The bytes the feeder's buffers, tables and indexes hold now.
    """

    stages: tuple[StageStats, ...]
    queues: tuple[QueueStats, ...]
    samples: int
    batches: int
    skipped: int
    consumer_wait_s: float
    elapsed_s: float
    buffers: int
    skipped_paths: tuple[str, ...] = field(default=(), repr=False)
    waiting_in_next: int = 0
    active_threads: tuple[tuple[float, str, int], ...] = field(default=(), repr=False)
    memory: MemoryStats = field(default=MemoryStats(), repr=False)

    def active(self, stage: str = "decode") -> int | None:
        """Threads of ``stage`` active now under ``"tune"`` (None when it is not tuned)."""
        for _, name, n in reversed(self.active_threads):
            if name == stage:
                return n
        return None

    def stage(self, name: str) -> StageStats:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def starvation(self) -> float:
        """Fraction of the elapsed time the training loop waited for data."""
        return self.consumer_wait_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def bottleneck(self) -> str:
        """The stage with the highest utilization: where more threads (or less work) helps."""
        work = [s for s in self.stages if s.name in ("read", "decode", "augment", "transfer")]
        if not work:
            return "none"
        return max(work, key=lambda s: s.utilization).name

    def __str__(self) -> str:
        rate = self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0
        lines = [
            f"feeder: {self.samples} samples in {self.batches} batches, {self.elapsed_s:.2f} s "
            f"({rate:.0f} samples/s); skipped {self.skipped}; buffers {self.buffers}",
            f"training loop waited {self.consumer_wait_s:.2f} s for data "
            f"({100 * self.starvation:.1f}% of elapsed); busiest stage: {self.bottleneck}",
            "",
            f"{'stage':<10}{'threads':>8}{'items':>10}{'busy s':>10}{'wait in s':>11}"
            f"{'wait out s':>12}{'util':>7}",
        ]
        for s in self.stages:
            if s.threads == 0:  # run by the decode threads: their busy time is split out here
                lines.append(f"{s.name:<10}{'inline':>8}{s.items:>10}{s.busy_s:>10.2f}{'-':>11}{'-':>12}{'-':>7}")
                continue
            lines.append(f"{s.name:<10}{s.threads:>8}{s.items:>10}{s.busy_s:>10.2f}"
                         f"{s.wait_input_s:>11.2f}{s.wait_output_s:>12.2f}{100 * s.utilization:>6.0f}%")
        lines += ["", f"{'queue':<10}{'capacity':>9}{'depth':>7}{'mean':>8}{'max':>6}"]
        for q in self.queues:
            lines.append(f"{q.name:<10}{q.capacity:>9}{q.depth:>7}{q.mean_depth:>8.1f}{q.max_depth:>6}")
        if self.active_threads:
            lines.append("")
            for stage in dict.fromkeys(name for _, name, _ in self.active_threads):
                counts = [n for _, name, n in self.active_threads if name == stage]
                lines.append(f"{stage} threads tuned: {self.active(stage)} active now (of "
                             f"{int(self.stage(stage).threads)}); fewest {min(counts)}, most "
                             f"{max(counts)}, {len(counts) - 1} change(s) recorded")
        if self.memory.total:
            lines += ["", str(self.memory)]
        transfer = next((s for s in self.stages if s.name == "transfer"), None)
        if transfer is not None and transfer.items:
            lines += ["", f"transfer thread CPU: {1e3 * transfer.cpu_per_item_s:.2f} ms per batch "
                          f"({transfer.cpu_s:.2f} s in all)"]
        return "\n".join(lines)


# The stage whose work a thread may do inline (see Counters.inline_items).
_INLINE_INTO = {"decode": "augment"}


def _add(totals: dict[str, list], stage: str, c) -> None:
    busy, wait_in, wait_out, inline = c.totals()
    t = totals[stage]
    t[0] += c.items
    t[1] += busy
    t[2] += wait_in
    t[3] += wait_out
    t[5] += c.cpu_s
    if c.inline_items or inline:
        u = totals[_INLINE_INTO[stage]]
        u[0] += c.inline_items
        u[1] += inline
        t[4] += inline


def _add_channel(queues: dict[str, list], ch) -> None:
    q = queues.setdefault(ch.name, [ch.maxsize, 0, 0, 0])
    q[0] = ch.maxsize
    q[1] += ch.puts
    q[2] += ch.depth_sum
    q[3] = max(q[3], ch.max_depth)


# Most (time, stage, active threads) entries kept for Stats.active_threads.
ACTIVE_HISTORY = 1000


class StatsBook:
    """Feeder-wide accumulator of every pass's counters.

    Each thread's :class:`~feeder.engine.stage.Counters` and each channel is *live*
    (attached) until it is folded into the totals; a snapshot adds the totals
    and the live ones under one lock, so every counter is counted exactly once
    at any instant and the figures a user reads never go backwards, also while
    passes start and end.
    """

    def __init__(self, stage_threads: dict[str, int]) -> None:
        self._lock = threading.Lock()
        self._stage_threads = stage_threads
        # items, busy s, wait in s, wait out s, s spent on the next stage's work inline,
        # CPU s (transfer only)
        self._stages = {name: [0, 0.0, 0.0, 0.0, 0.0, 0.0] for name in stage_threads}
        self._queues: dict[str, list] = {}
        self._live_threads: dict[object, str] = {}  # Counters -> stage name
        self._live_channels: dict[object, None] = {}  # insertion-ordered set of channels
        self.samples = 0
        self.batches = 0
        self.consumer_wait_s = 0.0
        # thread ident -> when it began waiting in next(): a wait in progress counts too
        self._consumer_waits: dict[int, float] = {}
        self.started: float | None = None
        self._skipped: list[str] = []
        self._skipped_set: set[str] = set()
        self._active: list[tuple[float, str, int]] = []

    def restage(self, stage_threads: dict[str, int]) -> None:
        """The passes from now on run these stages: each one's thread count; a stage
        the earlier passes had and these do not keeps its totals, with 0 threads
        (its step runs in another stage's threads: ``read_threads`` decided 0)."""
        with self._lock:
            for name in stage_threads:
                self._stages.setdefault(name, [0, 0.0, 0.0, 0.0, 0.0, 0.0])
            self._stage_threads = {name: stage_threads.get(name, 0) for name in self._stages}

    def start(self) -> None:
        with self._lock:  # snapshot() reads it under the lock, after its own clock
            if self.started is None:
                self.started = time.perf_counter()

    def after_fork(self) -> None:
        """In a forked child: the lock may have been held by a thread that does not exist here."""
        self._lock = threading.Lock()
        self._live_threads.clear()
        self._live_channels.clear()
        self._consumer_waits.clear()

    def attach_thread(self, stage: str, c) -> None:
        with self._lock:
            self._live_threads[c] = stage

    def fold_thread(self, stage: str, c) -> None:
        with self._lock:
            if self._live_threads.pop(c, None) is not None:
                _add(self._stages, stage, c)

    def attach_channel(self, ch) -> None:
        with self._lock:
            self._live_channels[ch] = None

    def fold_channel(self, ch) -> None:
        """Add ``ch``'s counters to the totals; safe to repeat (only the first counts)."""
        with self._lock:
            if ch in self._live_channels:
                del self._live_channels[ch]
                _add_channel(self._queues, ch)

    def consumer_waiting(self, since: float | None) -> None:
        """The calling thread began (``since``) or ended (None) a wait inside ``next()``."""
        me = threading.get_ident()
        if since is not None:
            self._consumer_waits[me] = since
            return
        with self._lock:  # the move from ongoing to total must look atomic to snapshot()
            began = self._consumer_waits.pop(me, None)
            if began is not None:
                self.consumer_wait_s += time.perf_counter() - began

    def delivered(self, samples: int) -> None:
        with self._lock:
            self.batches += 1
            self.samples += samples

    def skipped(self, path: str, error: BaseException) -> int:
        """Count a skipped sample; log its path the first time. Returns the count so far."""
        with self._lock:
            self._skipped.append(path)
            first = path not in self._skipped_set
            self._skipped_set.add(path)
            n = len(self._skipped)
        if first:
            log.warning("skipped %s: %s", safe_text(path), error)
        return n

    def record_active(self, stage: str, active: int) -> None:
        """``stage`` runs ``active`` threads from now (a ``"tune"`` thread count)."""
        with self._lock:
            t = time.perf_counter() - self.started if self.started is not None else 0.0
            self._active.append((t, stage, active))
            del self._active[:-ACTIVE_HISTORY]

    def last_active(self, stage: str) -> int | None:
        """The last count :meth:`record_active` recorded for ``stage`` (None: none yet)."""
        with self._lock:
            for _, name, n in reversed(self._active):
                if name == stage:
                    return n
        return None

    def snapshot(self, buffers: int = 0, memory: MemoryStats = MemoryStats()) -> Stats:
        with self._lock:
            now = time.perf_counter()  # under the lock: no wait may begin or end after it
            totals = {k: list(v) for k, v in self._stages.items()}
            queues = {k: list(v) for k, v in self._queues.items()}
            skipped = tuple(self._skipped)
            for c, stage in list(self._live_threads.items()):
                _add(totals, stage, c)
            depths = {}
            for ch in list(self._live_channels):
                _add_channel(queues, ch)
                depths[ch.name] = ch.depth()
            waits = list(self._consumer_waits.values())
            wait = self.consumer_wait_s + sum(max(0.0, now - t) for t in waits)
            samples, batches = self.samples, self.batches
            active = tuple(self._active)
        stages = tuple(StageStats(name, self._stage_threads[name], int(t[0]), t[1], t[2], t[3], t[4],
                                  t[5])
                       for name, t in totals.items())
        qs = tuple(QueueStats(name, q[0], depths.get(name, 0), q[2] / q[1] if q[1] else 0.0, q[3])
                   for name, q in queues.items())
        elapsed = max(0.0, now - self.started) if self.started is not None else 0.0
        return Stats(stages, qs, samples, batches, len(skipped), wait, elapsed, buffers, skipped,
                     len(waits), active, memory)
