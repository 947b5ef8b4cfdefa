"""Batch buffers: a fixed pool of preallocated (pinned on CUDA) arrays, and the
batches being filled in them (``_collate`` turns them into deliverable batches).

Memory: the pool holds at most ``Config.num_buffers`` buffers of
``batch_size * H * W * 3`` bytes each (plus 8 bytes a label). On CUDA each
array is a page-locked block of its own, locked at its size rounded to the
page (:mod:`.pinned`), and unlocked when the engine is freed. Decoded samples are
written by the augment stage straight into their slot of a buffer, so there is
no per-batch allocation and no collate copy on the normal path.

Samples with more fields than an image and an int label (see ``_sample.py``)
give each buffer, on the first sample that has them, one preallocated array per
fixed-shape field: ``batch_size * H * W`` bytes for masks (twice that once a
16-bit mask appears in it), ``batch_size * value bytes`` for a numeric field;
boxes and passed-through values are kept per slot, as objects.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import torch

from . import reaper
from .pinned import PinnedHost
from .queue import Closed
from ..sample import LABEL, MASKS, NUMERIC, SIZE

log = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a waiter on the pool re-checks its stop condition
# How long the training loop must have been busy outside next() before the pool
# grows past two buffers: longer than the loop's own turnaround between batches.
_BUSY_S = 0.02
# How long the pool waits for the reaper to hand back a batch the loop has
# dropped, past _BUSY_S, before it counts that batch as held: on a loaded
# machine the reaper thread may not run for tens of milliseconds.
_REAPING_S = 0.5
_now = time.perf_counter


class BatchBuffer:
    """One preallocated batch: ``images`` [B,H,W,3] uint8, ``labels`` [B] int64 and
    ``indices`` [B] int64 (the source index of the sample in each slot).

    ``images_t``/``labels_t`` are torch views of the same memory (page-locked in
    ``pin`` when the target device is CUDA); ``images``/``labels`` are numpy
    views of it.

    Other fields get their storage on first use (:meth:`array`, :meth:`masks`,
    :meth:`objects`) and keep it while the buffer lives: every batch of one
    feeder has the same fields (``_sample.Schema``).
    """

    __slots__ = ("images_t", "labels_t", "images", "labels", "indices", "serial", "pin", "arrays",
                 "lists", "planes", "shared", "__weakref__")

    def __init__(self, batch_size: int, height: int, width: int, pin: PinnedHost | None,
                 serial: int, shared: bool = False) -> None:
        # ``shared``: every fixed-shape array in shared memory, for the isolated
        # engine's worker process to fill and the training process to read.
        self.shared = shared
        self.images_t = _host((batch_size, height, width, 3), torch.uint8, pin, shared)
        self.labels_t = _host((batch_size,), torch.int64, pin, shared)
        self.images = self.images_t.numpy()
        self.labels = self.labels_t.numpy()
        self.indices = np.full((batch_size,), -1, np.int64)
        self.serial = serial
        self.pin = pin
        self.arrays: dict[str, tuple[torch.Tensor, np.ndarray]] = {}  # numeric fields
        self.lists: dict[str, list] = {}  # boxes, per-box and passed-through fields
        self.planes: MaskPlanes | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer's fixed-shape arrays: images, labels, indices,
        numeric fields and mask planes (not the per-slot lists of boxes, which
        hold what the samples made)."""
        n = self.images.nbytes + self.labels.nbytes + self.indices.nbytes
        n += sum(entry[1].nbytes for entry in list(self.arrays.values()))
        planes = self.planes
        if planes is not None:
            n += planes.low.nbytes + (planes.high.nbytes if planes.high is not None else 0)
        return n

    def array(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The ``[B, *shape]`` array of numeric field ``name`` (pinned on CUDA)."""
        entry = self.arrays.get(name)
        if entry is None:
            with _ALLOCATING:
                entry = self.arrays.get(name)
                if entry is None:
                    t = _host((len(self.indices), *shape),
                              torch.from_numpy(np.empty(0, dtype)).dtype, self.pin, self.shared)
                    entry = self.arrays[name] = (t, t.numpy())
        return entry[1]

    def objects(self, name: str) -> list:
        """The per-slot list of a variable-size or passed-through field."""
        found = self.lists.get(name)
        if found is None:
            with _ALLOCATING:
                found = self.lists.setdefault(name, [None] * len(self.indices))
        return found

    def masks(self) -> "MaskPlanes":
        """The mask storage (allocated on the first mask written)."""
        planes = self.planes
        if planes is None:
            with _ALLOCATING:
                if self.planes is None:
                    b, h, w = self.images.shape[:3]
                    self.planes = MaskPlanes(b, h, w, self.pin, self.shared)
                planes = self.planes
        return planes

    # -- a buffer seen from two processes (the isolated engine) -----------------
    def shared_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every fixed-shape array of a shared buffer, by the key :meth:`attach` takes."""
        yield "images", self.images_t
        yield "labels", self.labels_t
        for name, (tensor, _) in list(self.arrays.items()):
            yield f"array:{name}", tensor
        planes = self.planes
        if planes is not None:
            yield "low", planes.low_t
            if planes.high_t is not None:
                yield "high", planes.high_t

    @classmethod
    def mirror(cls, serial: int) -> "BatchBuffer":
        """The training process's view of the worker's buffer ``serial``: no memory of
        its own; each shared array is :meth:`attach`-ed as it first arrives."""
        buf = cls.__new__(cls)
        buf.serial = serial
        buf.pin = None
        buf.shared = True
        buf.arrays = {}
        buf.lists = {}
        buf.planes = None
        return buf

    def attach(self, key: str, tensor: torch.Tensor) -> None:
        """Take the shared array ``key`` (see :meth:`shared_tensors`) as this view's."""
        if key == "images":
            self.images_t, self.images = tensor, tensor.numpy()
        elif key == "labels":
            self.labels_t, self.labels = tensor, tensor.numpy()
        elif key.startswith("array:"):
            self.arrays[key[6:]] = (tensor, tensor.numpy())
        else:
            if self.planes is None:
                self.planes = MaskPlanes.mirror(tensor.shape[0])
            self.planes.attach(key, tensor)

    def write(self, slot: int, record: list[tuple[str, str, object]]) -> None:
        """Store one sample's fields (as ``_work`` computed them) in ``slot``."""
        for name, kind, value in record:
            if kind == NUMERIC:
                if name == LABEL and value.dtype == np.int64 and value.ndim == 0:
                    self.labels[slot] = value
                else:
                    self.array(name, value.dtype, value.shape)[slot] = value
            elif kind == MASKS:
                self.masks().write(slot, value)
            else:
                self.objects(name)[slot] = value


def _host(shape: tuple[int, ...], dtype: torch.dtype, pin: PinnedHost | None,
          shared: bool) -> torch.Tensor:
    """An uninitialized host tensor: page-locked in ``pin``, in shared memory, or plain.

    ``pin`` locks it with the pass's device current: page-locked memory serves
    every device, but locking it needs a CUDA context, and the calling thread
    (the sampler, a worker) has GPU 0 current, so a torchrun rank would create a
    context there. (test_pinned_buffers_allocated_with_the_pass_device_current.)
    """
    if shared:
        return torch.empty(shape, dtype=dtype).share_memory_()
    if isinstance(pin, PinnedHost):
        return pin.empty(shape, dtype)
    return torch.empty(shape, dtype=dtype)


# Field storage is allocated by whichever thread first writes a field into a
# buffer; this lock makes that happen once. Held for an allocation only.
_ALLOCATING = threading.Lock()


class MaskPlanes:
    """A buffer's masks: a uint8 ``[B, H, W]`` plane of low bytes, and, from the first
    16-bit mask on, a plane of high bytes.

    A batch whose masks all came from 8-bit PNGs (or uint8 arrays) is delivered
    as uint8 and copies one byte a pixel; one with any 16-bit mask as int64,
    ``low | high << 8``. The choice depends on the batch's own samples only, so
    it is the same for any thread count. Two uint8 planes, rather than one wider
    array, let a 16-bit mask arrive after 8-bit ones were written without
    converting what is there (other threads may be writing it).
    """

    __slots__ = ("low_t", "low", "high_t", "high", "wide", "_pin", "_shared")

    def __init__(self, batch_size: int, height: int, width: int, pin: PinnedHost | None,
                 shared: bool = False) -> None:
        self._shared = shared
        self.low_t = _host((batch_size, height, width), torch.uint8, pin, shared)
        self.low = self.low_t.numpy()
        self.high_t: torch.Tensor | None = None
        self.high: np.ndarray | None = None
        self.wide = np.zeros(batch_size, np.bool_)  # slot holds a 16-bit mask
        self._pin = pin

    @classmethod
    def mirror(cls, batch_size: int) -> "MaskPlanes":
        """A view of shared planes, attached as they arrive (see :meth:`BatchBuffer.mirror`)."""
        planes = cls.__new__(cls)
        planes.high_t = planes.high = None
        planes._pin = None
        planes._shared = True
        planes.wide = np.zeros(batch_size, np.bool_)
        return planes

    def attach(self, key: str, tensor: torch.Tensor) -> None:
        """Take the shared plane ``key`` (``"low"`` or ``"high"``) as this view's."""
        if key == "low":
            self.low_t, self.low = tensor, tensor.numpy()
        else:
            self.high_t, self.high = tensor, tensor.numpy()

    def _high(self) -> np.ndarray:
        if self.high is None:
            with _ALLOCATING:
                if self.high is None:
                    # Zeros: every 8-bit mask already written has no high byte.
                    self.high_t = _host(tuple(self.low_t.shape), torch.uint8, self._pin, self._shared)
                    self.high_t.zero_()
                    self.high = self.high_t.numpy()
        return self.high

    def write(self, slot: int, mask: np.ndarray) -> None:
        # A mask smaller than the plane (variable-size batches) goes to its top left.
        h, w = mask.shape
        if mask.dtype == np.uint8:
            self.low[slot, :h, :w] = mask
            self.wide[slot] = False
            high = self.high
            if high is not None:
                high[slot] = 0  # left from an earlier batch in this buffer
        else:
            np.copyto(self.low[slot, :h, :w], mask, casting="unsafe")  # the low byte
            np.copyto(self._high()[slot, :h, :w], mask >> 8, casting="unsafe")
            self.wide[slot] = True

    def is_wide(self, n: int) -> bool:
        """Whether the first ``n`` slots hold a 16-bit mask (the batch is then int64)."""
        return bool(self.wide[:n].any())

    def host(self, n: int, height: int | None = None, width: int | None = None,
             copy: bool = True) -> np.ndarray:
        """The first ``n`` masks (their top left ``height x width``, default all) as one
        dense host array: uint8, or int64 when wide.

        Args:
            copy: False: a view of the low plane where that region of it is dense
                uint8 (the caller must then keep the buffer until the view is
                gone); True: always memory of its own.
        """
        region = np.s_[:n, :height, :width]
        if not self.is_wide(n):
            low = self.low[region]
            return np.array(low, order="C", copy=True) if copy else np.ascontiguousarray(low)
        return self.low[region].astype(np.int64) | (self.high[region].astype(np.int64) << 8)


def _move_masks(src: MaskPlanes, start: int, dst: MaskPlanes, to: int, n: int) -> None:
    dst.low[to:to + n] = src.low[start:start + n]
    wide = src.wide[start:start + n].copy()
    if wide.any():
        dst._high()[to:to + n] = src.high[start:start + n]
    elif dst.high is not None:
        dst.high[to:to + n] = 0
    dst.wide[to:to + n] = wide


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
        # takes the loop leaving next() as its batch boundary (see _tune.Gate).
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
        resolved CUDA device; see ``_host``). Buffers made before stay: pinned
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
        batch it holds is about to come back. It also grows when the wait has
        lasted 20 ms and ``starving()`` says the workers have run out of work
        while a batch is being filled (a slow sample holds up the batch the
        loop waits for). When every buffer is a batch the loop has taken, it
        grows once they have stayed so for 20 ms and the reaper has no release
        in hand (up to half a second): a loop that drops each batch as it gets
        the next keeps two buffers even on a loaded machine.

        Raises:
            Closed: ``stopped()`` became true while waiting, or the pool was closed.
        """
        since = _now()
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
                if may_starve and _now() - since >= _BUSY_S and starving():
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


class Scratch:
    """Spare one-sample arrays for samples finished before their batch has a buffer."""

    def __init__(self, height: int, width: int) -> None:
        self._shape = (height, width, 3)
        self._free: list = []
        self._made: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    def take(self):
        try:
            return self._free.pop()
        except IndexError:
            arr = np.empty(self._shape, np.uint8)
            self._made[id(arr)] = arr
            return arr

    def nbytes(self) -> int:
        """Bytes of the arrays alive now, spare or holding a sample."""
        return sum(a.nbytes for a in list(self._made.values()))

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

    __slots__ = ("index", "buffer", "size", "_steps", "_done", "_lock", "holes", "error", "error_slot",
                 "_stash")

    def __init__(self, index: int, buffer: BatchBuffer | None, size: int) -> None:
        self.index = index
        self.buffer = buffer
        self.size = size
        self._steps = size + (buffer is None)  # binding the buffer counts as one more step
        # Steps are counted without the lock: ``next()`` of an ``itertools.count``
        # runs in C without releasing the GIL, so concurrent calls each get a
        # distinct number and exactly one gets ``_steps``. (A free-threaded build
        # would need the lock back.)
        self._done = itertools.count(1)
        self._lock = threading.Lock()
        self.holes: list[int] = []  # slots whose sample was skipped
        self.error: BaseException | None = None  # failure of the lowest slot under on_error="raise"
        self.error_slot = -1
        self._stash: list[tuple[int, np.ndarray, int, int, list | None]] = []

    def store(self, slot: int, image: np.ndarray, label: int, give: Callable[[np.ndarray], None],
              index: int = -1, record: list | None = None) -> None:
        """Put a sample computed into a scratch array in its slot (with its label,
        source index and other fields: ``record``, see :meth:`BatchBuffer.write`),
        now or once the buffer is bound. ``image`` is the scratch array, or for a
        variable-size image its top-left view holding the image (only that is copied)."""
        with self._lock:
            if self.buffer is None:
                self._stash.append((slot, image, label, index, record))
                return
            buf = self.buffer
        _place(buf, slot, image, label, index, record, give)

    def bind(self, buffer: BatchBuffer, give: Callable[[np.ndarray], None]) -> bool:
        """Give the batch its buffer and copy in the samples that waited for it;
        true when that completes the batch."""
        with self._lock:
            self.buffer = buffer
            stash, self._stash = self._stash, []
            for slot, image, label, index, record in stash:
                _place(buffer, slot, image, label, index, record, give)
            return next(self._done) == self._steps

    def fail(self, slot: int, error: BaseException) -> None:
        """Record ``error`` for ``slot``; the lowest failing slot's error is kept, so the
        error raised does not depend on which thread failed first."""
        with self._lock:
            if self.error is None or slot < self.error_slot:
                self.error, self.error_slot = error, slot

    def finish_slot(self) -> bool:
        """Count one slot as done (filled or failed); true for the call that completes the batch."""
        return next(self._done) == self._steps

    def compact(self) -> int:
        """Move the good samples to the front of the buffer, in slot order; return their count."""
        if not self.holes:
            return self.size
        holes = set(self.holes)
        buf = self.buffer
        n = 0
        for slot in range(self.size):
            if slot in holes:
                continue
            if slot != n:
                move_slots(buf, slot, buf, n, 1)
            n += 1
        return n


def _place(buf: BatchBuffer, slot: int, image: np.ndarray, label: int, index: int,
           record: list | None, give: Callable[[np.ndarray], None]) -> None:
    """Copy a sample computed into a scratch array into ``slot`` of ``buf`` (see
    :meth:`Batch.store`) and give the scratch array back."""
    # The whole slot, or, for a variable-size image (a top-left view of its
    # scratch array), only the image.
    h, w = image.shape[:2]
    buf.images[slot, :h, :w] = image
    if record is None:
        buf.labels[slot] = label
    else:
        buf.write(slot, record)
    buf.indices[slot] = index
    # A variable-size image is a view of its scratch array: give back the array.
    give(image if image.base is None else image.base)


def move_slots(src: BatchBuffer, start: int, dst: BatchBuffer, to: int, n: int) -> None:
    """Copy ``n`` samples (image, label, source index, every other field) from
    ``src[start:]`` to ``dst[to:]`` (the ranges may overlap within one buffer)."""
    dst.images[to:to + n] = src.images[start:start + n]
    dst.labels[to:to + n] = src.labels[start:start + n]
    dst.indices[to:to + n] = src.indices[start:start + n]
    for name, (_, arr) in list(src.arrays.items()):
        dst.array(name, arr.dtype, arr.shape[1:])[to:to + n] = arr[start:start + n]
    for name, values in list(src.lists.items()):
        dst.objects(name)[to:to + n] = values[start:start + n]
    if src.planes is not None:
        _move_masks(src.planes, start, dst.masks(), to, n)

