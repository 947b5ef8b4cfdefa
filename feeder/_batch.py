"""Batch buffers: a fixed pool of preallocated (pinned on CUDA) arrays, and the
collator that turns filled buffers into deliverable batches.

Memory: the pool holds at most ``Config.num_buffers`` buffers of
``batch_size * H * W * 3`` bytes each (plus 8 bytes a label). Decoded samples are
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
from collections.abc import Callable, Iterator

import numpy as np
import torch

from ._queue import Closed
from ._sample import LABEL, MASKS, NUMERIC

log = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a waiter on the pool re-checks its stop condition
# How long the training loop must have been busy outside next() before the pool
# grows past two buffers: longer than the loop's own turnaround between batches.
_BUSY_S = 0.02
_now = time.perf_counter


class BatchBuffer:
    """One preallocated batch: ``images`` [B,H,W,3] uint8, ``labels`` [B] int64 and
    ``indices`` [B] int64 (the source index of the sample in each slot).

    ``images_t``/``labels_t`` are torch views of the same memory (pinned when
    the target device is CUDA); ``images``/``labels`` are numpy views of it.

    Other fields get their storage on first use (:meth:`array`, :meth:`masks`,
    :meth:`objects`) and keep it while the buffer lives: every batch of one
    feeder has the same fields (``_sample.Schema``).
    """

    __slots__ = ("images_t", "labels_t", "images", "labels", "indices", "serial", "pin", "arrays",
                 "lists", "planes", "shared", "__weakref__")

    def __init__(self, batch_size: int, height: int, width: int, pin: bool, serial: int,
                 shared: bool = False) -> None:
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


def _host(shape: tuple[int, ...], dtype: torch.dtype, pin: "bool | torch.device",
          shared: bool) -> torch.Tensor:
    """An uninitialized host tensor: pinned, in shared memory, or plain.

    ``pin`` a CUDA device: pinned with that device current. Page-locked memory
    serves every device, but allocating it needs a CUDA context, and torch's
    host allocator takes the calling thread's current device when no context
    exists yet: the sampler thread's is GPU 0, so a torchrun rank would create
    a context there. (test_pinned_buffers_allocated_with_the_pass_device_current.)
    """
    if shared:
        return torch.empty(shape, dtype=dtype).share_memory_()
    if isinstance(pin, torch.device):
        with torch.cuda.device(pin):
            return torch.empty(shape, dtype=dtype, pin_memory=True)
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


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

    def __init__(self, batch_size: int, height: int, width: int, pin: bool,
                 shared: bool = False) -> None:
        self._shared = shared
        self.low_t = _host((batch_size, height, width), torch.uint8, pin, shared)
        self.low = self.low_t.numpy()
        self.high_t: torch.Tensor | None = None
        self.high: np.ndarray | None = None
        self.wide = np.zeros(batch_size, np.bool_)  # slot holds a 16-bit mask
        self._pin = pin

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

    def host(self, n: int, height: int | None = None, width: int | None = None) -> np.ndarray:
        """The first ``n`` masks (their top left ``height x width``, default all) as one
        host array: uint8, or int64 when wide."""
        region = np.s_[:n, :height, :width]
        if not self.is_wide(n):
            return np.ascontiguousarray(self.low[region])
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
        pin: Allocate page-locked memory (for asynchronous copies to CUDA);
            with which device current is set per pass by :meth:`pin_with`.
    """

    # Buffers always allowed: the batch the training loop holds and the one being filled.
    MINIMUM = 2

    def __init__(self, capacity: int, batch_size: int, height: int, width: int, pin: bool,
                 shared: bool = False) -> None:
        self.capacity = capacity
        self._geometry = (batch_size, height, width, pin)
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
        """Allocate the pinned buffers from now on with ``device`` current (the
        pass's resolved CUDA device; see ``_host``). Buffers made before stay:
        pinned memory serves every device."""
        with self._cond:
            b, h, w, pin = self._geometry
            if pin:
                self._geometry = (b, h, w, device)

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
        (a slow sample holds up the batch the loop waits for).

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
                may_starve = starving is not None and n < self.capacity
                if may_starve and _now() - since >= _BUSY_S and starving():
                    return self._new(owner)
                held = self.count(LENT)
                stuck = held + self.count(PARKED, RETIRED)
                if not (self._waiters and stuck >= n):
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
        _put_image(buf, slot, image)
        if record is None:
            buf.labels[slot] = label
        else:
            buf.write(slot, record)
        buf.indices[slot] = index
        give(_scratch_of(image))

    def bind(self, buffer: BatchBuffer, give: Callable[[np.ndarray], None]) -> bool:
        """Give the batch its buffer and copy in the samples that waited for it;
        true when that completes the batch."""
        with self._lock:
            self.buffer = buffer
            stash, self._stash = self._stash, []
            for slot, image, label, index, record in stash:
                _put_image(buffer, slot, image)
                if record is None:
                    buffer.labels[slot] = label
                else:
                    buffer.write(slot, record)
                buffer.indices[slot] = index
                give(_scratch_of(image))
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
                _move_slots(buf, slot, buf, n, 1)
            n += 1
        return n


def _put_image(buf: BatchBuffer, slot: int, image: np.ndarray) -> None:
    """Copy a sample's image from a scratch array into ``slot``: the whole slot, or,
    for a variable-size image (a top-left view of its scratch array), only it."""
    h, w = image.shape[:2]
    buf.images[slot, :h, :w] = image


def _scratch_of(image: np.ndarray) -> np.ndarray:
    # A variable-size image is a view of its scratch array: give back the array.
    return image if image.base is None else image.base


def _move_slots(src: BatchBuffer, start: int, dst: BatchBuffer, to: int, n: int) -> None:
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


Output = tuple[BatchBuffer, int]  # a buffer and how many leading samples it delivers

#: The field of variable-size batches holding each image's valid (height, width).
SIZE = "size"


def batch_extent(sizes: np.ndarray, divisibility: int) -> tuple[int, int]:
    """The (height, width) a variable-size batch is padded to: its largest image's
    sides, each rounded up to a multiple of ``divisibility``."""
    h, w = (int(v) for v in sizes.max(axis=0))
    d = divisibility
    return -(-h // d) * d, -(-w // d) * d


class Padding:
    """Pads variable-size batches (``Feeder(max_image_size=...)``).

    Every image sits at the top left of its slot with its (height, width) in the
    buffer's ``"size"`` array. Before a batch is delivered, the pixels of the
    batch's extent (:func:`batch_extent`) outside each image are set to 0, and
    those outside each mask to ``mask_fill``: the slots hold whatever an earlier
    batch of the buffer left there. Only the padding is written, nothing else:
    the cost is that of the padding itself.
    """

    def __init__(self, divisibility: int, mask_fill: int) -> None:
        self.divisibility = divisibility
        self.mask_fill = mask_fill

    def __call__(self, buf: BatchBuffer, n: int) -> None:
        sizes = buf.arrays[SIZE][1][:n]
        Hb, Wb = batch_extent(sizes, self.divisibility)
        planes = buf.planes
        fill = self.mask_fill
        for slot in range(n):
            h, w = (int(v) for v in sizes[slot])
            for plane, value in ((buf.images, 0), (None if planes is None else planes.low, fill),
                                 (None if planes is None else planes.high, 0)):
                if plane is None:
                    continue
                plane[slot, h:Hb, :Wb] = value
                plane[slot, :h, w:Wb] = value


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
                 park: Callable[[BatchBuffer, bool], None] = lambda buf, parked: None,
                 pad: Callable[[BatchBuffer, int], None] | None = None) -> None:
        self.batch_size = batch_size
        # Run on each output batch as it leaves (variable sizes: Padding); in the
        # isolated engine that is the worker process, off the training process.
        self._pad = pad
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
        if self._pad is None:
            yield from self._add(batch)
            return
        for buf, n in self._add(batch):
            self._padded(buf, n)
            yield buf, n

    def _padded(self, buf: BatchBuffer, n: int) -> None:
        try:
            self._pad(buf, n)
        except BaseException:
            self._release(buf)
            raise

    def _add(self, batch: Batch) -> Iterator[Output]:
        if not self.ordered:
            yield from self._take(batch)
            return
        self._pending[batch.index] = batch
        while self._next in self._pending:
            yield from self._take(self._pending.pop(self._next))
            self._next += 1

    def finish(self) -> Iterator[Output]:
        """End of pass: deliver (or drop, with ``drop_last``) the open partial batch."""
        for buf, n in self._finish():
            if self._pad is not None:
                self._padded(buf, n)
            yield buf, n

    def _finish(self) -> Iterator[Output]:
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
        _move_slots(src, 0, dst, self._fill, k)
        self._fill += k
        rest = good - k
        if self._fill == B:
            self._park(dst, False)
            self._open = None
            yield dst, B
        if rest:
            _move_slots(src, k, src, 0, rest)
            # The open batch was just delivered (it was full), so this one takes its place.
            self._open, self._fill = batch, rest
            self._park(batch.buffer, True)
        else:
            self._release(src)
