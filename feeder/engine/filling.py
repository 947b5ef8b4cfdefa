"""The batch being filled (:class:`FillingBatch`): its buffer, how many of its
slots are done, what failed; and :class:`Scratch`, the one-sample arrays a
sample waits in until its batch has a buffer.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable

import numpy as np

from .buffers import BatchBuffer, move_slots

__all__ = ["FillingBatch", "Scratch"]


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


class FillingBatch:
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
    :meth:`FillingBatch.store`) and give the scratch array back."""
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
