"""Thread counts (the stages' options: :class:`ThreadOptions`), and keeping
library thread pools from oversubscribing the cores."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import os
import threading
from collections.abc import Iterator

import cv2
import torch

from .tune import TunedThreads


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cores_for_this_rank(affinity: int | None = None, machine: int | None = None,
                        local_ranks: int | None = None) -> int:
    """The cores ``"auto"`` thread counts may use in this process.

    Several ranks of one job on a node (``torchrun --nproc_per_node=N`` sets
    ``LOCAL_WORLD_SIZE``) each build a feeder. When the ranks are bound to their
    own cores, the affinity mask already says how many this one has; when each
    may run on the whole machine, the machine's cores are divided among them,
    so that N ranks do not start N times too many threads.
    """
    affinity = available_cores() if affinity is None else affinity
    machine = (os.cpu_count() or affinity) if machine is None else machine
    if local_ranks is None:
        try:
            local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            local_ranks = 1
    if local_ranks > 1 and affinity >= machine:
        return max(1, affinity // local_ranks)
    return affinity


def auto_threads(cores: int) -> tuple[int, int]:
    """Default (decode, augment) thread counts for ``cores`` cores.

    A decode thread per core (at least two, so one thread's file read overlaps
    another's decode), each running the transforms on what it decoded
    (``augment=0``). Decoding, cropping and resizing all release the GIL, so
    these threads keep every core busy, and skipping the hand-off to a separate
    augment pool saves a queue round trip, a thread wake-up and a decoded image
    crossing cores per sample (measured: the docs' results page, "Threads and
    cores", from ``bench/results/sweep.txt``). Run ``feeder-bench sweep`` to
    check the choice on other machines.
    """
    return max(2, cores), 0


# Read threads per decode thread, and the bounds, for read_threads="auto".
READS_PER_DECODE_THREAD = 16
MIN_READ_THREADS = 16
MAX_READ_THREADS = 128


def auto_read_threads(decode_threads: int) -> int:
    """Default read threads: 16 per decode thread, within [16, 128].

    A read thread waiting on storage costs no CPU, so the count is set by the
    latency to hide: to keep ``d`` decode threads that each take ``t`` seconds
    of CPU per sample fed from storage answering in ``L`` seconds, about
    ``d * L / t`` reads must be in flight. 16 per decode thread covers reads 16
    times as long as a sample's decoding (a network file system or an object
    store's first byte, against a small JPEG: ``bench/results/read_latency.txt``
    measures both).
    """
    return max(MIN_READ_THREADS, min(MAX_READ_THREADS, READS_PER_DECODE_THREAD * decode_threads))


# read_threads="auto" for a source that does not say whether its reads wait: the
# reads timed before the read stage is decided, and the median wait off the CPU
# below which a read is from memory or the page cache (a network read or a disk
# seek waits a millisecond or more).
MEASURED_READS = 64
FAST_READ_WAIT_S = 1e-4


class MeasuredReadThreads(int):
    """What ``read_threads="auto"`` resolves to for a source that does not say
    whether its reads wait (no ``reads_may_block``): the :func:`auto_read_threads`
    count, an ``int`` in every use, whose type tells the engine to time the read
    stage's reads and decide the later passes' read stage from them
    (:func:`measured_read_threads`). A marker on the value, as ``TunedThreads``:
    the configuration's fields are the options."""

    def __repr__(self) -> str:
        return f"'auto' ({int(self)} until reads are measured)"


def measured_read_threads(threads: int, waits: list[float]) -> tuple[int, str] | None:
    """The read threads of the passes after ``waits`` were measured, and why; None
    while fewer than :data:`MEASURED_READS` reads were timed.

    ``waits``: seconds each read of the read stage spent off the CPU (wall time
    less its thread's CPU time). A median under :data:`FAST_READ_WAIT_S` means
    the reads come from memory or the page cache: the decode threads read
    (``0``), which saves a queue hand-over per sample. Otherwise ``threads``, the
    read stage as it was.
    """
    if len(waits) < MEASURED_READS:
        return None
    median = sorted(waits)[len(waits) // 2]
    figure = f"median wait off the CPU {1e3 * median:.3f} ms over {len(waits)} reads"
    if median < FAST_READ_WAIT_S:
        return 0, (f"{figure}, under {1e3 * FAST_READ_WAIT_S:g} ms: reads in the decode "
                   f"threads (read_threads=0)")
    return int(threads), (f"{figure}, {1e3 * FAST_READ_WAIT_S:g} ms or more: reads keep "
                          f"their stage (read_threads={int(threads)})")


@dataclasses.dataclass(frozen=True)
class ThreadOptions:
    """The feeder options that size the pipeline's stages (see ``Feeder``'s
    arguments of the same names). As given, a count may be ``"auto"`` or
    ``"tune"``; :func:`resolve_threads` makes each an ``int``, maybe a
    :class:`~feeder.engine.tune.TunedThreads` or a :class:`MeasuredReadThreads`
    (an ``int`` whose type marks it). The queue sizes need the counts resolved."""

    decode_threads: int | str
    augment_threads: int | str
    read_threads: int | str
    read_ahead_bytes: int = 64 << 20
    queue_size: int = 4

    @property
    def is_resolved(self) -> bool:
        """Every count is a number (no ``"auto"`` or ``"tune"`` left)."""
        return all(isinstance(n, int)
                   for n in (self.decode_threads, self.augment_threads, self.read_threads))

    @property
    def tune(self) -> bool:
        """Some pool is ``"tune"``: its threads are parked and woken while a pass runs."""
        return any(isinstance(n, TunedThreads)
                   for n in (self.decode_threads, self.augment_threads, self.read_threads))

    def tuned(self) -> tuple[str, ...]:
        """The stages whose thread count is tuned (``"tune"`` on a pool that exists)."""
        return tuple(stage for stage, n in (("read", self.read_threads),
                                            ("decode", self.decode_threads),
                                            ("augment", self.augment_threads))
                     if isinstance(n, TunedThreads))

    # Queue capacities. Each pool needs a few items queued per thread so a
    # thread never idles between items; more only adds latency and memory.
    @property
    def read_queue(self) -> int:
        # Every read thread finds its next sample waiting; more would only hold
        # batch buffers (each sample in flight needs its batch's buffer).
        return self.read_threads

    @property
    def decode_queue(self) -> int:
        return 4 * self.decode_threads

    @property
    def augment_queue(self) -> int:
        return 4 * self.augment_threads

    def in_flight(self) -> int:
        """Most samples between the sampler and the collating stage: queued before
        a stage or in a thread's hands, every stage."""
        if not self.is_resolved:
            raise ValueError(f"thread counts not resolved yet ({self}): see resolve_threads")
        return (self.read_queue + self.read_threads + self.decode_queue + self.augment_queue
                + self.decode_threads + self.augment_threads)


def resolve_threads(given: ThreadOptions, reads_may_block: bool | None,
                    cores: int | None = None) -> ThreadOptions:
    """``given`` with its ``"auto"`` and ``"tune"`` counts resolved, for ``cores``
    cores (default: :func:`cores_for_this_rank`) and a source whose reads may
    wait on storage (``reads_may_block``: True, False, or None when it does not
    say). Counts given as numbers stay as they are."""
    decode, augment, read = given.decode_threads, given.augment_threads, given.read_threads
    if all(isinstance(n, int) for n in (decode, augment, read)):
        return given
    auto_decode, auto_augment = auto_threads(cores_for_this_rank() if cores is None else cores)
    if decode in ("auto", "tune"):
        # "tune": the "auto" count, marked: the pass parks and wakes these threads.
        decode = TunedThreads(auto_decode) if decode == "tune" else auto_decode
    if augment == "tune":
        # "auto" runs the transforms in the decode threads (no pool to tune):
        # asking to tune them asks for a pool of their own, at decode's count.
        augment = TunedThreads(auto_decode)
    elif augment == "auto":
        augment = auto_augment
    if read in ("auto", "tune"):
        # Local, fast reads cost less in the decode threads than handed over
        # from a read stage (a queue hop per sample); reads that may wait on
        # storage get their own threads. "tune": that count, tuned, where there
        # is a read stage. A source that does not say: the read stage, until its
        # reads are measured (MeasuredReadThreads; "tune" tunes it instead).
        count = auto_read_threads(decode) if reads_may_block is not False else 0
        if read == "tune" and count:
            read = TunedThreads(count)
        elif read == "auto" and reads_may_block is None:
            read = MeasuredReadThreads(count)
        else:
            read = count
    return dataclasses.replace(given, decode_threads=decode, augment_threads=augment,
                               read_threads=read)


def reads_may_block(source: object, windowed: bool = False) -> bool | None:
    """Whether ``source``'s reads may wait on storage: its ``reads_may_block``
    attribute; None when it has none (the source does not say: it gets a read
    stage until its reads are measured, see ``MeasuredReadThreads``); True when
    the attribute fails or is not a bool. ``windowed``: under the block shuffle,
    where a source that copies each window ahead into a cache says so by its
    ``window_reads_may_block`` attribute."""
    try:
        value = getattr(source, "reads_may_block", None)
        if value is None:
            return None
        if windowed and value is True:
            value = getattr(source, "window_reads_may_block", True)
    except Exception:  # noqa: BLE001 - a failing hint must not fail the feeder
        return True
    return value if isinstance(value, bool) else True


@functools.lru_cache(maxsize=1)
def _omp_set_num_threads():
    """OpenMP's own ``omp_set_num_threads`` from the runtime torch loaded, or None.

    ``torch.set_num_threads`` also stores a process-wide count that every thread
    adopts on its first parallel op, so calling it in a worker would throttle the
    training loop too. OpenMP's setting is per thread.
    """
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates = sorted(glob.glob(os.path.join(libdir, "libgomp*.so*"))) + ["libgomp.so.1", "libiomp5.so"]
    for name in candidates:
        try:
            return ctypes.CDLL(name).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def limit_torch_threads() -> None:
    """Make torch CPU ops called from this worker thread single-threaded.

    Only the calling thread's OpenMP limit changes; where it cannot be set per
    thread, nothing is changed.
    """
    fn = _omp_set_num_threads()
    if fn is not None:
        # torch applies its process-wide count (a torch.set_num_threads of the
        # training code's) to a thread on the thread's first torch call: make
        # that call now, so that it cannot undo the limit later.
        torch.get_num_threads()
        fn(1)


class LibraryThreads:
    """While any feeder runs, OpenCV's own thread pool is limited to one thread.

    Every worker thread calls into OpenCV; letting each call fan out over all
    cores again would oversubscribe them N-fold. OpenCV's setting is process
    wide, so it is restored when the last running feeder closes.
    """

    _lock = threading.Lock()
    _users = 0
    _saved: int | None = None

    @classmethod
    def acquire(cls) -> None:
        with cls._lock:
            if cls._users == 0:
                if cls._saved is None:  # not already limited (a forked child keeps the parent's)
                    cls._saved = cv2.getNumThreads()
                cv2.setNumThreads(1)
            cls._users += 1

    @classmethod
    def after_fork(cls) -> None:
        """In a forked child: the lock may be held by a parent thread that is gone, and no
        feeder runs yet (the child's engines re-acquire when they start a pass). The
        count the parent saved stays, so the child's last close restores the real one."""
        cls._lock = threading.Lock()
        cls._users = 0

    @classmethod
    @contextlib.contextmanager
    def parked(cls) -> Iterator[None]:
        """OpenCV's pool without threads for the duration (for a ``fork``).

        OpenCV's pthreads pool is not fork-safe: in a child forked after the
        pool started its threads, ``cv2.setNumThreads`` waits forever for
        threads that exist only in the parent. With one thread the pool stops
        its threads; the count is restored afterwards (the pool restarts them
        on its next parallel call)."""
        with cls._lock:
            count = cv2.getNumThreads()
            if count != 1:
                cv2.setNumThreads(1)
            try:
                yield
            finally:
                if count != 1:
                    cv2.setNumThreads(count)

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            if cls._users == 0:
                return
            cls._users -= 1
            if cls._users == 0 and cls._saved is not None:
                cv2.setNumThreads(cls._saved)
                cls._saved = None
