"""The per-sample work, as plain functions with explicit inputs and outputs.

::

    read       source, index             -> (encoded bytes, label)     Source.read
    decode     bytes, key                -> (image, SampleContext)     SampleWork.decode
    transform  image, key, context, out  -> None (result in ``out``)   SampleWork.transform

:class:`SampleWork` binds decode and transform to one feeder's settings (the
compiled chain, ``max_pixels``, EXIF handling, reused decode memory). The
engine's steps (:func:`steps`) and the benchmarks' "same per-sample work" rows
both call it, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._augment import Chain
from ._decode import DecodeBuffers, buffer_of, decode_planned
from ._rng import sample_key
from ._sample import DEFAULT_MAX_PIXELS, Task
from ._stage import Step
from .ops import SampleContext


class SampleWork:
    """Decode and transform one sample, with one feeder's settings.

    Thread-safe: every method may be called from several threads at once (the
    decode memory pool is a list whose ``pop``/``append`` are atomic).

    Args:
        chain: The compiled transforms.
        max_pixels: Largest decoded image accepted (from its header).
        exif_orientation: Apply EXIF orientation while decoding.
    """

    def __init__(self, chain: Chain, max_pixels: int = DEFAULT_MAX_PIXELS,
                 exif_orientation: bool = False) -> None:
        self.chain = chain
        self.plan = chain.plan
        self.image_size = chain.image_size
        self.max_pixels = max_pixels
        self.exif_orientation = exif_orientation
        self.buffers = DecodeBuffers()

    def decode(self, data: bytes, key: int) -> tuple[np.ndarray, SampleContext]:
        """Decode ``data`` (at a reduced JPEG scale when the transforms allow) and
        return the image and the context :meth:`transform` needs."""
        img, size, ctx = decode_planned(data, self.max_pixels, self.plan, key, self.buffers,
                                        self.exif_orientation)
        return img, ctx if ctx is not None else SampleContext(size)

    def transform(self, img: np.ndarray, key: int, ctx: SampleContext, out: np.ndarray) -> None:
        """Run the chain on a decoded image into ``out``, then recycle its decode memory."""
        self.chain.run(img, key, ctx, out)
        self.buffers.give(buffer_of(img))

    def discard(self, img: np.ndarray | None) -> None:
        """A decoded image that will not be transformed (its sample failed): recycle it."""
        self.buffers.give(buffer_of(img))

    def __call__(self, data: bytes, key: int, out: np.ndarray) -> None:
        img, ctx = self.decode(data, key)
        self.transform(img, key, ctx, out)


def as_label(label: Any) -> int:
    """``label`` as the int64 the batch buffer stores, converted the same way.

    Raises:
        TypeError, ValueError, OverflowError: not representable as int64.
    """
    box = np.empty((), np.int64)
    box[()] = label
    return int(box)


def steps(source: Any, work: SampleWork, scratch: Any, seed: int,
          epoch: int) -> tuple[Step, Step, Step]:
    """The engine's three steps on a :class:`~feeder._sample.Task`, for one pass.

    ``read`` and ``decode`` return the task; ``augment`` writes the result into
    the task's slot of its batch (or a scratch array, when the batch has no buffer
    yet) and returns the batch when that completes it, else None.
    """
    read_source = source.read

    def read(task: Task) -> Task:
        task.data, task.label = read_source(task.index)
        return task

    def decode(task: Task) -> Task:
        task.key = key = sample_key(seed, epoch, task.index)
        data, task.data = task.data, None
        task.image, task.ctx = work.decode(data, key)
        return task

    def augment(task: Task) -> Any:
        batch = task.batch
        slot = task.slot
        buf = batch.buffer
        if buf is not None:
            work.transform(task.image, task.key, task.ctx, buf.images[slot])
            task.image = None  # its memory is back in the pool (see below)
            buf.labels[slot] = task.label
            buf.indices[slot] = task.index
        else:
            # The batch has no buffer yet (the training loop still holds the last
            # free one): compute into a scratch array, copied in on binding.
            out = scratch.take()
            try:
                work.transform(task.image, task.key, task.ctx, out)
                # transform() has given the decode memory back: forget the image
                # before anything else can fail, or the failure path gives it twice.
                task.image = None
                label = as_label(task.label)  # fails here, as a write into the buffer would
            except BaseException:
                scratch.give(out)
                raise
            batch.store(slot, out, label, scratch.give, task.index)
        return batch if batch.finish_slot() else None

    return Step("read", read), Step("decode", decode), Step("augment", augment)
