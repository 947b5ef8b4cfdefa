"""The buffer pool: a bounded set of :class:`~.buffers.BatchBuffer`, allocated
on first use, and its one ledger of each buffer's state (free, filling, parked,
queued, lent, retired) and owner.

Memory: the pool holds at most ``Config.num_buffers`` buffers; the policy for
growing past two is :meth:`BufferPool.acquire`'s. Decoded samples are written by
the augment stage straight into their slot of a buffer, so there is no
per-batch allocation and no collate copy on the normal path. See
docs/design/memory.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from . import reaper
from .buffers import BatchBuffer
from .pinned import PinnedHost
from .queue import Closed

__all__ = ["BufferPool", "FREE", "FILLING", "PARKED", "QUEUED", "LENT", "RETIRED"]

# The logger of the module the pool was defined in before, so that filters on it
# keep working.
log = logging.getLogger("feeder.engine.batch")

_POLL_S = 0.1  # how often a waiter on the pool re-checks its stop condition
# How long the training loop must have been busy outside next() before the pool
# grows past two buffers: longer than the loop's own turnaround between batches.
_BUSY_S = 0.02
# How long the pool waits for the reaper to hand back a batch the loop has
# dropped, past _BUSY_S, before it counts that batch as held: on a loaded
# machine the reaper thread may not run for tens of milliseconds.
_REAPING_S = 0.5
_now = time.perf_counter


# The states of a buffer in the pool's ledger, and who may move it on:
FREE = "free"          # in the pool                                   -> FILLING (take)
FILLING = "filling"    # a pass's batch being filled or collated       -> PARKED, QUEUED, RETIRED, FREE
PARKED = "parked"      # a partial batch that needs more samples       -> FILLING, QUEUED, RETIRED, FREE
QUEUED = "queued"      # a view of it waits in the output queue        -> LENT, FREE
LENT = "lent"          # the training loop has taken the view          -> FREE (view garbage-collected)
RETIRED = "retired"    # owned by a stopped pass whose threads may      -> FREE (last thread exited)
#                        still run (one may be stuck in user code)


class BufferPool:
    """A bounded pool of :class:`BatchBuffer`, allocated on first use, with one ledger.

    Every buffer alive has exactly one entry in the ledger: its state (above) and,
    while a pass holds it, that pass (its *owner*). Every transition is a named
    method below; the counts the growth policy needs are read off the ledger.

    Args:
        capacity: Most buffers allocated in normal operation.
        batch_size, height, width: Buffer geometry.
        pin: Allocate page-locked memory (for asynchronous copies to CUDA), in
            :attr:`pinned`; with which device current is set per pass by
            :meth:`pin_with`. The engine unlocks it (:meth:`unpin`) after close,
            once the side stream has drained.
    """

    # Buffers always allowed: the batch the training loop holds and the one being filled.
    MINIMUM = 2

    def __init__(self, capacity: int, batch_size: int, height: int, width: int, pin: bool,
                 shared: bool = False) -> None:
        self.capacity = capacity
        #: The page-locked memory of the buffers (None: pageable buffers).
        self.pinned = PinnedHost() if pin else None
        self._geometry = (batch_size, height, width, self.pinned)
        self._shared = shared
        # How many threads of the training loop wait inside next(), and since when
        # it has been busy outside it (None while one waits). While it waits, the
        # batch it holds comes back as soon as the batch being filled is delivered:
        # a new buffer would not bring data sooner, it would only cost memory. While
        # it computes, finished batches may queue up ahead of it, so the pool grows.
        self._waiters = 0
        self._busy_since: float | None = _now()  # no next() yet: the loop is elsewhere
        self._ledger: dict[int, list] = {}  # serial -> [state, owner, buffer]
        self._free: list[BatchBuffer] = []  # the FREE buffers, most recently freed last
        self._serials = 0
        self._closed = False
        # Re-entrant: a Condition's wait needs the lock it was made with, and the
        # pool is used from the pass threads, the loop and the reaper thread.
        self._cond = threading.Condition(threading.RLock())
        self._warned = False
        # Told of every set_consumer_waiting, outside the lock: decode_threads="tune"
        # takes the loop leaving next() as its batch boundary (see tune.Gate).
        self.on_consumer: Callable[[bool], None] | None = None

    # -- reading the ledger ---------------------------------------------------
    @property
    def allocated(self) -> int:
        """Buffers alive now (after :meth:`close`, only those still lent or owned)."""
        return len(self._ledger)

    def nbytes(self) -> int:
        """Bytes of the buffers alive now (see :attr:`BatchBuffer.nbytes`)."""
        return sum(entry[2].nbytes for entry in list(self._ledger.values()))

    def count(self, *states: str) -> int:
        return sum(1 for entry in list(self._ledger.values()) if entry[0] in states)

    def buffer(self, serial: int) -> BatchBuffer | None:
        """The live buffer numbered ``serial``, if any."""
        entry = self._ledger.get(serial)
        return None if entry is None else entry[2]

    def owned_by(self, owner: object) -> list[BatchBuffer]:
        return [e[2] for e in list(self._ledger.values()) if e[1] is owner]

    # -- transitions -----------------------------------------------------------
    def _move(self, buf: BatchBuffer, state: str, owner: object = None) -> None:
        entry = self._ledger.get(buf.serial)
        if entry is not None:
            entry[0], entry[1] = state, owner

    def _new(self, owner: object) -> BatchBuffer:
        self._serials += 1
        buf = BatchBuffer(*self._geometry, serial=self._serials, shared=self._shared)
        self._ledger[buf.serial] = [FILLING, owner, buf]
        return buf

    def _take(self, owner: object) -> BatchBuffer | None:
        if self._closed:
            return None
        if self._free:
            buf = self._free.pop()
            self._move(buf, FILLING, owner)
            return buf
        n = len(self._ledger)
        if n < min(self.MINIMUM, self.capacity):
            return self._new(owner)
        busy = self._busy_since
        if n < self.capacity and busy is not None and _now() - busy >= _BUSY_S:
            return self._new(owner)
        return None

    def pin_with(self, device: torch.device) -> None:
        """Lock the buffers' memory from now on with ``device`` current (the pass's
        resolved CUDA device; see ``buffers._host``). Buffers made before stay: pinned
        memory serves every device."""
        if self.pinned is not None:
            self.pinned.device = device

    def unpin(self) -> None:
        """Unlock every buffer's memory (they stay valid, pageable, while in use).
        Only once no copy can read them: after close and the side stream's drain."""
        if self.pinned is not None:
            self.pinned.unregister_all()

    def try_acquire(self, owner: object = None) -> BatchBuffer | None:
        """A buffer for ``owner`` now (free, or newly allocated where the policy allows), else None."""
        with self._cond:
            return self._take(owner)

    def acquire(self, stopped: Callable[[], bool], starving: Callable[[], bool] | None = None,
                owner: object = None) -> BatchBuffer:
        """Take a buffer for ``owner``, blocking until one is released.

        Past two buffers, the pool grows up to ``capacity`` once the training
        loop has been busy outside ``next()`` for a moment (so finished batches
        queue up ahead of it), but not while it waits in ``next()``: then the
        batch it holds is about to come back. It also grows when ``starving()``
        has said for 20 ms that the workers have run out of work while a batch
        is being filled (a slow sample holds up the batch the loop waits for);
        not when they run out for a moment at the end of each batch, where the
        last samples of the batch the loop waits for are being finished and
        its batch comes back next. When every buffer is a batch the loop has taken, it
        grows once they have stayed so for 20 ms and the reaper has no release
        in hand (up to half a second): a loop that drops each batch as it gets
        the next keeps two buffers even on a loaded machine.

        Raises:
            Closed: ``stopped()`` became true while waiting, or the pool was closed.
        """
        starved_since: float | None = None
        stuck_since: float | None = None
        with self._cond:
            while True:
                if stopped() or self._closed:
                    raise Closed("buffer pool")
                buf = self._take(owner)
                if buf is not None:
                    return buf
                n = len(self._ledger)
                # Starving counts only while a batch is being filled (a slow sample
                # holds it up): with every buffer lent, the loop is about to give
                # one back, which the rule below waits for.
                may_starve = starving is not None and n < self.capacity and self.count(FILLING) > 0
                if not (may_starve and starving()):
                    starved_since = None
                elif starved_since is None:
                    starved_since = _now()
                elif _now() - starved_since >= _BUSY_S:
                    return self._new(owner)
                held = self.count(LENT)
                stuck = held + self.count(PARKED, RETIRED)
                if not (self._waiters and stuck >= n):
                    stuck_since = None
                elif stuck_since is None:
                    # A batch the loop has just dropped comes back through the reaper
                    # thread a moment later (see reaper.py): give it that moment, and
                    # more while the reaper has work queued or running, before
                    # counting it as held.
                    stuck_since = _now()
                elif _now() - stuck_since >= _BUSY_S and not (
                        reaper.pending() and _now() - stuck_since < _REAPING_S):
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
                    return self._new(owner)
                # Poll only while a rule that no release will announce may fire:
                # the loop's busy time or the workers' starvation.
                timed = self._busy_since is not None or may_starve or stuck_since is not None
                self._cond.wait(_BUSY_S if timed else _POLL_S)

    def park(self, buf: BatchBuffer, parked: bool = True) -> None:
        """Mark ``buf`` as a partial batch that can only complete with more samples (or not)."""
        with self._cond:
            entry = self._ledger.get(buf.serial)
            if entry is not None and entry[0] in (FILLING, PARKED):
                entry[0] = PARKED if parked else FILLING

    def lend(self, buf: BatchBuffer) -> None:
        """A view of ``buf`` is on its way to the training loop (see :meth:`claim`)."""
        with self._cond:
            self._move(buf, QUEUED)

    def claim(self, buf: BatchBuffer) -> None:
        """The training loop has taken the lent batch of ``buf`` out of the queue."""
        with self._cond:
            entry = self._ledger.get(buf.serial)
            if entry is not None and entry[0] == QUEUED:
                entry[0] = LENT

    def retire(self, owner: object) -> None:
        """``owner`` (a pass) was stopped: do not count on its buffers coming back soon."""
        with self._cond:
            for entry in self._ledger.values():
                if entry[1] is owner and entry[0] in (FILLING, PARKED):
                    entry[0] = RETIRED
            self._cond.notify_all()

    def reclaim(self, owner: object) -> None:
        """``owner``'s last thread has exited: whatever it still holds is free."""
        for buf in self.owned_by(owner):
            self.release(buf)

    def set_consumer_waiting(self, waiting: bool) -> None:
        """A thread of the training loop entered (True) or left (False) ``next()``.
        False with no thread inside (a new pass) marks the loop as busy from now."""
        with self._cond:
            self._waiters = self._waiters + 1 if waiting else max(0, self._waiters - 1)
            self._busy_since = None if self._waiters else _now()
            self._cond.notify_all()  # a waiter re-checks whether to grow
        hook = self.on_consumer
        if hook is not None:
            hook(waiting)

    def release(self, buf: BatchBuffer) -> None:
        """Return ``buf`` to the pool (or free it, once the pool is closed)."""
        with self._cond:
            entry = self._ledger.get(buf.serial)
            if entry is None or entry[0] == FREE:
                # A second release would hand one buffer to two batches at once.
                log.error("batch buffer %d released twice; ignored", buf.serial)
                return
            if self._closed:
                del self._ledger[buf.serial]  # its memory goes when the last view goes
                return
            entry[0], entry[1] = FREE, None
            self._free.append(buf)
            self._cond.notify_all()  # the waiter may be a stopped pass's sampler

    def close(self) -> None:
        """Free every buffer in the pool now, and each other one as it comes back
        (a batch the loop still holds stays valid until it drops it). Safe to repeat."""
        with self._cond:
            self._closed = True
            for buf in self._free:
                del self._ledger[buf.serial]
            self._free.clear()
            self._cond.notify_all()

    def after_fork(self) -> None:
        """In a forked child: no thread of the parent exists here, and the lock may be
        held by one of them. Every buffer a pass owned comes back (nothing writes it)."""
        self._cond = threading.Condition(threading.RLock())
        self._waiters = 0
        self._busy_since = _now()
        self.on_consumer = None  # a parent's pass: its gate does not run here
        if self.pinned is not None:
            self.pinned.forget()  # page locks are the parent's, not inherited
        for entry in list(self._ledger.values()):
            if entry[0] in (FILLING, PARKED, RETIRED):
                entry[0], entry[1] = FREE, None
                self._free.append(entry[2])
            elif entry[0] == QUEUED:
                # On its way to the loop through a pass that is gone here: it comes back
                # when its view is dropped, but maybe never; do not count on it.
                entry[0], entry[1] = RETIRED, None
