"""The engine's per-sample steps, as plain functions with explicit inputs and
outputs::

    read       source, index             -> (image, label)             Source.read
                                          or a dict of fields           (sample.parse_sample)
    decode     bytes or pixels, key      -> (image, SampleContext)     SampleWork.decode
    transform  image, key, context, out  -> None (result in ``out``)   SampleWork.transform

:class:`SampleWork` binds decode and
transform to one feeder's settings; :func:`steps` makes the engine's three
steps of it. A pair with an int label, the classic sample, takes no per-field
work: the label goes straight into the batch's int64 labels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..decode.image import DecodeBuffers, buffer_of, decode_planned, decode_scale, rgb_of_pixels
from ..decode.jpeg import JpegDecoder
from ..decode.masks import decode_mask
from ..decode.verified import VerifiedJpegs
from ..errors import ConfigError, FieldError, with_field
from ..ops.chain import Chain
from ..sample import (BOXES, DEFAULT_MAX_PIXELS, IMAGE, INSTANCE_MASKS, INT_SCALAR, LABEL, MASK,
                      NUMERIC, SIZE, Geometry, SampleContext, Schema, Task, instances_fit,
                      parse_sample)
from ..sample.rng import epoch_key, index_key
from .stage import Step

_INT64 = (-(1 << 63), 1 << 63)
_SIZE_DTYPE = np.dtype(np.int64)


def source_files(source: Any) -> int | None:
    """How many samples ``source`` holds (an upper bound on its distinct files),
    or None when it cannot say."""
    try:
        n = len(source)
    except Exception:  # noqa: BLE001 - any source that cannot say is "not known"
        return None
    return n if isinstance(n, int) and n >= 0 else None


class SampleWork:
    """Decode and transform one sample, with one feeder's settings.

    Thread-safe: every method may be called from several threads at once (the
    decode memory pool is a list whose ``pop``/``append`` are atomic).

    Args:
        chain: The compiled transforms.
        max_pixels: Largest decoded image accepted (from its header).
        exif_orientation: Apply EXIF orientation while decoding.
        jpeg_verify: Entropy-decode region-decoded JPEGs to their end (see
            ``Feeder``), once per distinct byte string (:attr:`verified`).
        jpeg_index_bytes: Memory for those files' indexes (see ``Feeder``).
        files: How many distinct files the source holds (None: not known): each
            file's share of that memory (see ``VerifiedJpegs``).
        verified: Share this memory of files read to their end (another
            ``SampleWork``'s of the same settings: a feeder's dataset view and
            its engine) instead of keeping one of its own.
    """

    def __init__(self, chain: Chain, max_pixels: int = DEFAULT_MAX_PIXELS,
                 exif_orientation: bool = False, jpeg_verify: bool = True,
                 jpeg_index_bytes: int = VerifiedJpegs.INDEX_BYTES, files: int | None = None,
                 verified: VerifiedJpegs | None = None) -> None:
        self.chain = chain
        self.plan = chain.plan
        self.image_size = chain.image_size
        #: Variable-size output (``max_image_size``): each sample's size is recorded.
        self.variable = chain.max_image_size is not None
        self.max_pixels = max_pixels
        self.exif_orientation = exif_orientation
        self.jpeg_verify = jpeg_verify
        #: The JPEG byte strings this work has read to their end without an error.
        #: With neither (jpeg_verify=False, jpeg_index_bytes=0), None.
        self.verified = (None if not (jpeg_verify or jpeg_index_bytes)
                         else verified if verified is not None
                         else VerifiedJpegs(index_bytes=jpeg_index_bytes, files=files,
                                            rewritten=not jpeg_verify))
        #: How this work decodes JPEGs, with its decode memory (:attr:`buffers`).
        self.jpeg = JpegDecoder(max_pixels, DecodeBuffers(), exif_orientation, jpeg_verify,
                                self.verified)
        self.schema = Schema()

    @property
    def buffers(self) -> DecodeBuffers:
        """The reused decode memory (settable: the JPEG decoder's own)."""
        return self.jpeg.buffers

    @buffers.setter
    def buffers(self, buffers: DecodeBuffers) -> None:
        self.jpeg.buffers = buffers

    def decode(self, data: Any, key: int) -> tuple[np.ndarray, SampleContext]:
        """Decode ``data`` (at a reduced JPEG scale when the transforms allow) and
        return the image and the context :meth:`transform` needs. An image the
        source gave decoded (pixels, see ``sample.pixels``) is only converted to
        RGB: its transforms then read it as a decoded file's (the first one, a
        crop, reads the view of its crop)."""
        if isinstance(data, np.ndarray):
            try:
                img = rgb_of_pixels(data, self.max_pixels)
            except Exception as exc:
                raise with_field(exc, IMAGE)
            return img, SampleContext(img.shape[:2])
        img, size, ctx = decode_planned(data, self.max_pixels, self.plan, key, self.buffers,
                                        self.exif_orientation, self.jpeg)
        return img, ctx if ctx is not None else SampleContext(size)

    def transform(self, img: np.ndarray, key: int, ctx: SampleContext,
                  out: np.ndarray) -> tuple[int, int]:
        """Run the chain on a decoded image into ``out``, then recycle its decode
        memory; returns the (height, width) of the result (see ``Chain.run``)."""
        size = self.chain.run(img, key, ctx, out)
        self.buffers.give(buffer_of(img))
        return size

    def decode_mask(self, mask: Any, source_size: tuple[int, int]) -> np.ndarray:
        """A sample's mask (PNG bytes or an array) as a 2-D uint8/uint16 array of the
        full-size image's ``source_size``.

        Raises:
            DecodeError, FieldError: naming the field ``mask``.
        """
        try:
            if isinstance(mask, np.ndarray):
                mask = mask.view()
                mask.flags.writeable = False  # the source's memory, never written
            else:
                mask = decode_mask(mask, self.max_pixels)
            if mask.shape != source_size:
                raise FieldError(MASK, f"is {tuple(mask.shape)} but its image is "
                                       f"{tuple(source_size)} (height, width); a mask "
                                       f"has its image's full size")
        except Exception as exc:
            raise with_field(exc, MASK)
        return mask

    def check_instances(self, fields: dict[str, Any], source_size: tuple[int, int]) -> None:
        """Check a sample's per-instance masks (if any) against its full-size image:
        ``[N, H, W]`` of its size, within the memory bound (``max_pixels`` bytes).

        Raises:
            FieldError: naming the field ``masks``.
        """
        masks = fields.get(INSTANCE_MASKS)
        if masks is None:
            return
        if masks.shape[1:] != source_size:
            raise FieldError(INSTANCE_MASKS, f"are {tuple(masks.shape[1:])} (height, width) but "
                                             f"their image is {tuple(source_size)}; per-instance "
                                             f"masks have their image's full size, [N, H, W]")
        instances_fit(len(masks), source_size, self.max_pixels)

    def transform_sample(self, img: np.ndarray, key: int, ctx: SampleContext, out: np.ndarray,
                         fields: dict[str, Any]) -> list[tuple[str, str, Any]]:
        """:meth:`transform` for a sample with fields; returns them as the batch
        buffer stores them: ``(name, kind, value)``, the mask and boxes moved with
        the image."""
        chain = self.chain
        if chain.takes_samples or MASK in fields or BOXES in fields:
            # (per-instance masks and keypoints come with boxes)
            h, w = img.shape[:2]
            if ctx.origin is not None:
                # A region decode: the transforms report their geometry from the
                # whole image at ctx.scale (of which img is a window).
                s = ctx.scale
                geometry = Geometry(s, 0.0, s, 0.0, *ctx.scaled_size)
            else:
                sy, sx = decode_scale(ctx.source_size, (h, w))
                geometry = Geometry(sy, 0.0, sx, 0.0, h, w)
            fields, size = chain.run_fields_sized(img, key, ctx, out, fields, geometry)
        else:
            size = chain.run(img, key, ctx, out)
        self.buffers.give(buffer_of(img))
        specs = self.schema.specs
        record = [(name, specs[name].kind, value) for name, value in fields.items()]
        if self.variable:
            record.append((SIZE, NUMERIC, np.array(size, np.int64)))
        return record

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


def read_sample(source: Any, work: SampleWork, task: Task, sample: Any) -> Task:
    """The read step's checks of what ``source.read`` returned for ``task`` (see
    ``feeder.sample``); a pair of bytes and an int label, once the schema has seen
    one, never comes here (see :func:`steps`).

    Raises:
        SourceError: ``read`` returned something that is not a sample.
        FieldError: a field is malformed, or differs from the first sample's
            (naming the field).
    """
    schema = work.schema
    data, fields, is_dict = parse_sample(sample, source, task.index)
    if work.variable and SIZE in fields:
        raise ConfigError(f"sample {task.index} has a field {SIZE!r}, which variable-size batches "
                          f"(max_image_size) use for each image's valid (height, width): rename "
                          f"the source's field")
    schema.check(task.index, is_dict, tuple(sample) if is_dict else None, fields)
    task.data = data
    if not is_dict and not work.chain.takes_samples and schema.specs[LABEL] == INT_SCALAR:
        task.label = int(fields[LABEL])
        schema.classic = True
    else:
        task.fields = fields
    return task


def steps(source: Any, work: SampleWork, scratch: Any, seed: int,
          epoch: int) -> tuple[Step, Step, Step]:
    """The engine's three steps on a :class:`~feeder.sample.Task`, for one pass.

    ``read`` and ``decode`` return the task; ``augment`` writes the result into
    the task's slot of its batch (or a scratch array, when the batch has no buffer
    yet) and returns the batch when that completes it, else None.
    """
    read_source = source.read
    schema = work.schema
    low, high = _INT64
    pass_key = epoch_key(seed, epoch)  # each sample's key is then one mix away
    variable = work.variable

    def read(task: Task) -> Task:
        sample = read_source(task.index)
        # The classic pair takes no further work once the schema has seen one.
        if (schema.classic and type(sample) is tuple and len(sample) == 2 and type(sample[0]) is bytes
                and type(sample[1]) is int and low <= sample[1] < high):
            task.data, task.label = sample
            return task
        return read_sample(source, work, task, sample)

    def decode(task: Task) -> Task:
        task.key = key = index_key(pass_key, task.index)
        data, task.data = task.data, None
        task.image, task.ctx = work.decode(data, key)
        fields = task.fields
        if fields is not None and MASK in fields:
            fields[MASK] = work.decode_mask(fields[MASK], task.ctx.source_size)
        if fields is not None:
            work.check_instances(fields, task.ctx.source_size)
        return task

    def augment(task: Task) -> Any:
        batch = task.batch
        slot = task.slot
        buf = batch.buffer
        fields = task.fields
        if fields is not None:
            augment_fields(task, batch, slot, buf, fields)
        elif buf is not None:
            size = work.transform(task.image, task.key, task.ctx, buf.images[slot])
            task.image = None  # its memory is back in the pool (see below)
            buf.labels[slot] = task.label
            if variable:
                buf.array(SIZE, _SIZE_DTYPE, (2,))[slot] = size
            buf.indices[slot] = task.index
        else:
            # The batch has no buffer yet (the training loop still holds the last
            # free one): compute into a scratch array, copied in on binding.
            out = scratch.take()
            try:
                size = work.transform(task.image, task.key, task.ctx, out)
                # transform() has given the decode memory back: forget the image
                # before anything else can fail, or the failure path gives it twice.
                task.image = None
                label = as_label(task.label)  # fails here, as a write into the buffer would
            except BaseException:
                scratch.give(out)
                raise
            record = None
            if variable:
                record = [(LABEL, NUMERIC, np.int64(label)),
                          (SIZE, NUMERIC, np.array(size, _SIZE_DTYPE))]
                out = out[:size[0], :size[1]]  # only the image is copied into the slot
            batch.store(slot, out, label, scratch.give, task.index, record)
        return batch if batch.finish_slot() else None

    def augment_fields(task: Task, batch: Any, slot: int, buf: Any, fields: dict[str, Any]) -> None:
        out = buf.images[slot] if buf is not None else scratch.take()
        try:
            record = work.transform_sample(task.image, task.key, task.ctx, out, fields)
            task.image = None  # as above: its memory is back in the pool
        except BaseException:
            if buf is None:
                scratch.give(out)
            raise
        if buf is not None:
            buf.write(slot, record)
            buf.indices[slot] = task.index
        else:
            if variable:
                h, w = next(value for name, _, value in record if name == SIZE)
                out = out[:h, :w]  # only the image is copied into the slot
            batch.store(slot, out, -1, scratch.give, task.index, record)

    return Step("read", read), Step("decode", decode), Step("augment", augment)
