"""Batch buffers: a fixed pool of preallocated (pinned on CUDA) arrays, and the
collator that turns filled buffers into deliverable batches.

Memory: the pool holds at most ``Config.num_buffers`` buffers of
``batch_size * H * W * 3`` bytes each (plus 8 bytes a label). Decoded samples are
written by the augment stage straight into their slot of a buffer, so there is
no per-batch allocation and no collate copy on the normal path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from ._queue import Closed

log = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a waiter on the pool re-checks its stop condition
# How long the training loop must have been busy outside next() before the pool
# grows past two buffers: longer than the loop's own turnaround between batches.
_BUSY_S = 0.02
_now = time.perf_counter


class BatchBuffer:
    """One preallocated batch: ``images`` [B,H,W,3] uint8 and ``labels`` [B] int64.

    ``images_t``/``labels_t`` are torch views of the same memory (pinned when
    the target device is CUDA); ``images``/``labels`` are numpy views of it.
    """

    __slots__ = ("images_t", "labels_t", "images", "labels", "serial", "__weakref__")

    def __init__(self, batch_size: int, height: int, width: int, pin: bool, serial: int) -> None:
        self.images_t = torch.empty((batch_size, height, width, 3), dtype=torch.uint8, pin_memory=pin)
        self.labels_t = torch.empty((batch_size,), dtype=torch.int64, pin_memory=pin)
        self.images = self.images_t.numpy()
        self.labels = self.labels_t.numpy()
        self.serial = serial


class BufferPool:
    """A bounded pool of :class:`BatchBuffer`, allocated on first use.

    A buffer is *free* (in the pool), *owned* by a pass while it is filled and
    collated, or *lent* to the training loop (a CPU uint8 batch is a view of its
    buffer, returned when the last view is garbage-collected).

    Args:
        capacity: Most buffers allocated in normal operation.
        batch_size, height, width: Buffer geometry.
        pin: Allocate page-locked memory (for asynchronous copies to CUDA).
    """

    # Buffers always allowed: the batch the training loop holds and the one being filled.
    MINIMUM = 2

    def __init__(self, capacity: int, batch_size: int, height: int, width: int, pin: bool) -> None:
        self.capacity = capacity
        self._geometry = (batch_size, height, width, pin)
        # Whether the training loop waits inside next(), and since when it has been
        # busy outside it. While it waits, the batch it holds comes back as soon as
        # the batch being filled is delivered: a new buffer would not bring data
        # sooner, it would only cost memory. While it computes, finished batches
        # may queue up ahead of it, so the pool grows.
        self.consumer_waiting = False
        self._busy_since: float | None = _now()  # no next() yet: the loop is elsewhere
        self._free: list[BatchBuffer] = []
        self._allocated = 0  # buffers alive: free, owned by a pass, or lent
        self._serials = 0
        self._waiters = 0  # threads inside next() (one iterator may serve several)
        self._closed = False
        self._lent: set[int] = set()  # views handed out (in the output queue or held by the loop)
        self._queued: set[int] = set()  # lent, but still in the output queue
        self._parked: set[int] = set()
        # Owned by a stopped pass whose threads have not all exited (one may be
        # stuck in user code): they come back, but maybe not soon.
        self._retired: set[int] = set()
        self._free_ids: set[int] = set()
        # Re-entrant for the same reason as the channels' lock: a lent buffer
        # comes back from a finalizer that may run inside this lock.
        self._cond = threading.Condition(threading.RLock())
        self._warned = False

    @property
    def allocated(self) -> int:
        """Buffers alive now (after :meth:`close`, only those still lent or owned)."""
        return self._allocated

    def _new(self) -> BatchBuffer:
        self._allocated += 1
        self._serials += 1
        return BatchBuffer(*self._geometry, serial=self._serials)

    def close(self) -> None:
        """Free every buffer in the pool now, and each other one as it comes back
        (a batch the loop still holds stays valid until it drops it). Safe to repeat."""
        with self._cond:
            self._closed = True
            self._allocated -= len(self._free)
            self._free.clear()
            self._free_ids.clear()
            self._cond.notify_all()

    def after_fork(self) -> None:
        """In a forked child: no thread of the parent exists here, and the lock may be
        held by one of them. Every buffer a pass owned comes back (nothing writes it)."""
        self._cond = threading.Condition(threading.RLock())
        self._waiters = 0
        self.consumer_waiting = False
        self._busy_since = _now()
        self._parked.clear()
        self._retired.clear()

    def try_acquire(self) -> BatchBuffer | None:
        """A buffer now (free, or newly allocated where the policy allows), else None."""
        with self._cond:
            return self._take()

    def _take(self) -> BatchBuffer | None:
        if self._closed:
            return None
        if self._free:
            buf = self._free.pop()
            self._free_ids.discard(buf.serial)
            return buf
        if self._allocated < min(self.MINIMUM, self.capacity):
            return self._new()
        busy = self._busy_since
        if self._allocated < self.capacity and busy is not None and _now() - busy >= _BUSY_S:
            return self._new()
        return None

    def acquire(self, stopped: Callable[[], bool], starving: Callable[[], bool] | None = None) -> BatchBuffer:
        """Take a buffer, blocking until one is released.

        Past two buffers, the pool grows up to ``capacity`` once the training
        loop has been busy outside ``next()`` for a moment (so finished batches
        queue up ahead of it), but not while it waits in ``next()``: then the
        batch it holds is about to come back. It also grows when the wait has
        lasted 20 ms and ``starving()`` says the workers have run out of work
        (a slow sample holds up the batch the loop waits for).

        Raises:
            Closed: ``stopped()`` became true while waiting.
        """
        since = _now()
        stuck_since: float | None = None
        with self._cond:
            while True:
                if stopped() or self._closed:
                    raise Closed("buffer pool")
                buf = self._take()
                if buf is not None:
                    return buf
                if (starving is not None and self._allocated < self.capacity
                        and _now() - since >= _BUSY_S and starving()):
                    return self._new()
                held = len(self._lent) - len(self._queued)
                stuck = held + len(self._parked | self._retired)
                if not (self.consumer_waiting and stuck >= self._allocated):
                    stuck_since = None
                elif stuck_since is None:
                    # A batch the loop has just dropped comes back through the reaper
                    # thread a moment later (see _reaper): give it that moment before
                    # counting it as held.
                    stuck_since = _now()
                elif _now() - stuck_since >= _BUSY_S:
                    # Every buffer is a batch the training loop has taken and still
                    # holds, or the partial batch that waits for more samples. Waiting
                    # would deadlock (the loop is waiting on us), so grow. Holding one
                    # batch while asking for the next is normal; more is worth a word.
                    if held > 1 and not self._warned:
                        self._warned = True
                        log.warning(
                            "the training loop holds %d uint8 batches that are views of feeder "
                            "buffers; allocating more. Clone batches you keep past the next step.",
                            held)
                    return self._new()
                self._cond.wait(_BUSY_S if self._busy_since is not None or starving
                                or stuck_since is not None else _POLL_S)

    def retire(self, bufs: list[BatchBuffer]) -> None:
        """``bufs`` belong to a stopped pass: do not count on them coming back soon."""
        with self._cond:
            self._retired.update(b.serial for b in bufs)
            self._cond.notify_all()

    def park(self, buf: BatchBuffer, parked: bool = True) -> None:
        """Mark ``buf`` as a partial batch that can only complete with more samples."""
        with self._cond:
            (self._parked.add if parked else self._parked.discard)(buf.serial)

    def lend(self, buf: BatchBuffer) -> None:
        """A view of ``buf`` is on its way to the training loop (see :meth:`claim`)."""
        with self._cond:
            self._lent.add(buf.serial)
            self._queued.add(buf.serial)

    def claim(self, buf: BatchBuffer) -> None:
        """The training loop has taken the lent batch of ``buf`` out of the queue."""
        with self._cond:
            self._queued.discard(buf.serial)

    def set_consumer_waiting(self, waiting: bool) -> None:
        """A thread of the training loop entered (True) or left (False) ``next()``.
        False with no thread inside (a new pass) marks the loop as busy from now."""
        with self._cond:
            self._waiters = self._waiters + 1 if waiting else max(0, self._waiters - 1)
            self.consumer_waiting = self._waiters > 0
            self._busy_since = None if self.consumer_waiting else _now()
            self._cond.notify_all()  # a waiter re-checks whether to grow

    def release(self, buf: BatchBuffer) -> None:
        """Return ``buf`` to the pool. Called from any thread, finalizers included."""
        with self._cond:
            self._lent.discard(buf.serial)
            self._queued.discard(buf.serial)
            self._parked.discard(buf.serial)
            self._retired.discard(buf.serial)
            if self._closed:
                self._allocated -= 1  # dropped: its memory goes when the last view goes
                return
            if buf.serial in self._free_ids:
                # A second release would hand one buffer to two batches at once.
                log.error("batch buffer %d released twice; ignored", buf.serial)
                return
            self._free_ids.add(buf.serial)
            self._free.append(buf)
            self._cond.notify_all()  # the waiter may be a stopped pass's sampler


class Scratch:
    """Spare one-sample arrays for samples finished before their batch has a buffer."""

    def __init__(self, height: int, width: int) -> None:
        self._shape = (height, width, 3)
        self._free: list = []

    def take(self):
        try:
            return self._free.pop()
        except IndexError:
            return np.empty(self._shape, np.uint8)

    def give(self, arr) -> None:
        if not self.closed:
            self._free.append(arr)

    closed = False

    def close(self) -> None:
        """Free the spare arrays; later ones are dropped as they come back."""
        self.closed = True
        self._free.clear()


class Batch:
    """A batch being filled: the buffer, how many slots were dispatched, what failed.

    The buffer may be bound after the first samples were dispatched (``buffer``
    None until :meth:`bind`): a sample finished before then waits in a scratch
    array (:meth:`store`) and is copied in when the buffer arrives. The batch is
    complete when every slot is done and it has its buffer.
    """

    __slots__ = ("index", "buffer", "size", "_remaining", "_lock", "holes", "error", "error_slot",
                 "_stash")

    def __init__(self, index: int, buffer: BatchBuffer | None, size: int) -> None:
        self.index = index
        self.buffer = buffer
        self.size = size
        self._remaining = size + (buffer is None)  # binding the buffer counts as one more step
        self._lock = threading.Lock()
        self.holes: list[int] = []  # slots whose sample was skipped
        self.error: BaseException | None = None  # failure of the lowest slot under on_error="raise"
        self.error_slot = -1
        self._stash: list[tuple[int, np.ndarray, int]] = []

    def store(self, slot: int, image: np.ndarray, label: int, give: Callable[[np.ndarray], None]) -> None:
        """Put a sample computed into a scratch array in its slot, now or once the buffer is bound."""
        with self._lock:
            if self.buffer is None:
                self._stash.append((slot, image, label))
                return
            buf = self.buffer
        buf.images[slot] = image
        buf.labels[slot] = label
        give(image)

    def bind(self, buffer: BatchBuffer, give: Callable[[np.ndarray], None]) -> bool:
        """Give the batch its buffer and copy in the samples that waited for it;
        true when that completes the batch."""
        with self._lock:
            self.buffer = buffer
            stash, self._stash = self._stash, []
            for slot, image, label in stash:
                buffer.images[slot] = image
                buffer.labels[slot] = label
                give(image)
            self._remaining -= 1
            return self._remaining == 0

    def fail(self, slot: int, error: BaseException) -> None:
        """Record ``error`` for ``slot``; the lowest failing slot's error is kept, so the
        error raised does not depend on which thread failed first."""
        with self._lock:
            if self.error is None or slot < self.error_slot:
                self.error, self.error_slot = error, slot

    def finish_slot(self) -> bool:
        """Count one slot as done (filled or failed); true for the call that completes the batch."""
        with self._lock:
            self._remaining -= 1
            return self._remaining == 0

    def compact(self) -> int:
        """Move the good samples to the front of the buffer, in slot order; return their count."""
        if not self.holes:
            return self.size
        holes = set(self.holes)
        images, labels = self.buffer.images, self.buffer.labels
        n = 0
        for slot in range(self.size):
            if slot in holes:
                continue
            if slot != n:
                images[n] = images[slot]
                labels[n] = labels[slot]
            n += 1
        return n


Output = tuple[BatchBuffer, int]  # a buffer and how many leading samples it delivers


class Collator:
    """Turns completed batches into full output batches, in order when asked.

    Full batches pass straight through (no copy). A batch with skipped samples
    (or the short last batch) is held as the *open* batch and topped up from
    the next such batch, so output batches keep ``batch_size`` and every
    surviving sample is delivered exactly once. With ``ordered`` the input is
    re-sequenced by batch index first, which makes the result independent of
    thread timing.
    """

    def __init__(self, batch_size: int, ordered: bool, drop_last: bool,
                 release: Callable[[BatchBuffer], None],
                 park: Callable[[BatchBuffer, bool], None] = lambda buf, parked: None) -> None:
        self.batch_size = batch_size
        self.ordered = ordered
        self.drop_last = drop_last
        self._release = release
        self._park = park
        self._pending: dict[int, Batch] = {}
        self._next = 0
        self._open: Batch | None = None
        self._fill = 0

    def add(self, batch: Batch) -> Iterator[Output]:
        """Feed a completed batch; yield what can be delivered now.

        Raises:
            BaseException: the batch's recorded error, when it is next in line.
        """
        if not self.ordered:
            yield from self._take(batch)
            return
        self._pending[batch.index] = batch
        while self._next in self._pending:
            yield from self._take(self._pending.pop(self._next))
            self._next += 1

    def finish(self) -> Iterator[Output]:
        """End of pass: deliver (or drop, with ``drop_last``) the open partial batch."""
        if self._pending:
            raise RuntimeError(f"batches {sorted(self._pending)} completed but never sequenced")
        if self._open is not None:
            batch, fill = self._open, self._fill
            self._open = None
            self._park(batch.buffer, False)
            if self.drop_last or fill == 0:
                self._release(batch.buffer)
            else:
                yield batch.buffer, fill

    def _take(self, batch: Batch) -> Iterator[Output]:
        if batch.error is not None:
            self._release(batch.buffer)
            raise batch.error
        good = batch.compact()
        B = self.batch_size
        if good == B:
            yield batch.buffer, B
            return
        if good == 0:
            self._release(batch.buffer)
            return
        if self._open is None:
            self._open, self._fill = batch, good
            self._park(batch.buffer, True)
            return
        # Top the open batch up from this one; what is left becomes the open batch.
        dst, src = self._open.buffer, batch.buffer
        k = min(B - self._fill, good)
        dst.images[self._fill:self._fill + k] = src.images[:k]
        dst.labels[self._fill:self._fill + k] = src.labels[:k]
        self._fill += k
        rest = good - k
        if self._fill == B:
            self._park(dst, False)
            self._open = None
            yield dst, B
        if rest:
            src.images[:rest] = src.images[k:good]
            src.labels[:rest] = src.labels[k:good]
            # The open batch was just delivered (it was full), so this one takes its place.
            self._open, self._fill = batch, rest
            self._park(batch.buffer, True)
        else:
            self._release(src)
