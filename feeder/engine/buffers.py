"""Batch buffers: the preallocated (pinned on CUDA) arrays a batch is written
into, and the copies between their slots.

A buffer holds ``batch_size * H * W * 3`` bytes of images, 8 bytes a label and
a source index per slot. On CUDA each array is a page-locked block of its own,
locked at its size rounded to the page (:mod:`.pinned`). Samples with more
fields than an image and an int label (see :mod:`feeder.sample`) give each buffer,
on the first sample that has them, one preallocated array per fixed-shape field:
``batch_size * H * W`` bytes for masks (twice that once a 16-bit mask appears in
it), ``batch_size * value bytes`` for a numeric field; boxes and passed-through
values are kept per slot, as objects. The pool that owns the buffers is in
:mod:`.pool`; see docs/design/memory.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import torch

from .pinned import PinnedHost
from ..sample import LABEL, MASKS, NUMERIC, SIZE

__all__ = ["SIZE", "BatchBuffer", "MaskPlanes", "move_slots"]

#: The field of variable-size batches holding each image's valid (height, width).


class BatchBuffer:
    """One preallocated batch: ``images`` [B,H,W,3] uint8, ``labels`` [B] int64 and
    ``indices`` [B] int64 (the source index of the sample in each slot).

    ``images_t``/``labels_t`` are torch views of the same memory (page-locked in
    ``pin`` when the target device is CUDA); ``images``/``labels`` are numpy
    views of it.

    Other fields get their storage on first use (:meth:`array`, :meth:`masks`,
    :meth:`objects`) and keep it while the buffer lives: every batch of one
    feeder has the same fields (``feeder.sample.schema.Schema``).
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
        """Store one sample's fields (as the decode step's ``SampleWork`` computed them) in ``slot``."""
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

