"""The decode step of one feeder: :class:`SampleWork` binds decoding and the
transform chain to the feeder's settings (the compiled chain, ``max_pixels``,
EXIF handling, reused decode memory, the fields'
:class:`~feeder.sample.Schema`). The engine's steps and the benchmarks' "same
per-sample work" rows both call it, so the two cannot drift apart.

::

    decode     bytes or pixels, key      -> (image, SampleContext)     SampleWork.decode
               mask bytes                -> mask array                 SampleWork.decode_mask
    transform  image, key, context, out  -> None (result in ``out``)   SampleWork.transform
               ... and the other fields  -> the fields, moved with it  SampleWork.transform_sample
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..errors import FieldError, with_field
from ..ops.chain import Chain
from ..sample import (BOXES, DEFAULT_MAX_PIXELS, IMAGE, INSTANCE_MASKS, MASK, NUMERIC, SIZE, Geometry,
                      SampleContext, Schema, instances_fit)
from .headers import JPEG_MAGIC
from .image import DecodeBuffers, buffer_of, decode_planned, decode_scale, rgb_of_pixels
from .jpeg import JpegDecoder
from .masks import decode_mask
from .verified import VerifiedJpegs
from ..sample.sizes import Padding

__all__ = ["DecodeOptions", "SampleWork"]

# The context of a sample fused on JpegDecoder.fused's path, which makes
# none (nothing reads a fused sample's context: it has no fields to move).
_FUSED = SampleContext((0, 0))


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """The feeder options of decoding (see ``Feeder``'s arguments of the same names)."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    exif_orientation: bool = False
    jpeg_verify: bool = True
    jpeg_index_bytes: int = VerifiedJpegs.INDEX_BYTES


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
        variable: Sizes vary (``max_image_size``); None: as the chain's.
    """

    def __init__(self, chain: Chain, max_pixels: int = DEFAULT_MAX_PIXELS,
                 exif_orientation: bool = False, jpeg_verify: bool = True,
                 jpeg_index_bytes: int = VerifiedJpegs.INDEX_BYTES, files: int | None = None,
                 verified: VerifiedJpegs | None = None, variable: bool | None = None) -> None:
        self.chain = chain
        self.plan = chain.plan
        self.image_size = chain.image_size
        #: Variable-size output (``max_image_size``): each sample's size is recorded.
        self.variable = chain.max_image_size is not None if variable is None else variable
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
        #: The chain's steps the region decoder can do in its own call (see
        #: :meth:`decode_into`), or None.
        self.fused = chain.fused if not self.variable else None

    @classmethod
    def of(cls, chain: Chain, options: DecodeOptions, padding: Padding | None,
           files: int | None = None, verified: VerifiedJpegs | None = None) -> "SampleWork":
        """The work of a feeder: its chain, its decode options and its
        :class:`~feeder.sample.sizes.Padding` (None: every image one size)."""
        return cls(chain, options.max_pixels, options.exif_orientation, options.jpeg_verify,
                   options.jpeg_index_bytes, files=files, verified=verified,
                   variable=padding is not None)

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
        jpeg = self.jpeg
        if type(data) is bytes and data[:3] == JPEG_MAGIC:
            # decode_planned's JPEG branch, without the call.
            img, size, ctx = jpeg.decode(data, self.plan, key)
        else:
            img, size, ctx = decode_planned(data, self.max_pixels, self.plan, key, jpeg.buffers,
                                            self.exif_orientation, jpeg)
        return img, ctx if ctx is not None else SampleContext(size)

    def decode_into(self, data: Any, key: int,
                    out: np.ndarray) -> tuple[np.ndarray | None, SampleContext]:
        """:meth:`decode`, which for a JPEG the region decoder takes also runs the
        chain's fused steps (:attr:`fused`: the crop, its resize and the flip) into
        ``out``, the sample's slot (a C-contiguous uint8 [H, W, 3] array), in the
        same call. Returns :meth:`decode`'s pair, or (None, context) when ``out``
        holds the fused steps' result: :meth:`finish_into` then runs the rest."""
        fused = self.fused
        if fused is not None and type(data) is bytes and data[:3] == JPEG_MAGIC:
            jpeg = self.jpeg
            if jpeg.fused(data, key, fused, out):
                return None, _FUSED
            img, size, ctx = jpeg.decode(data, self.plan, key, (fused, out))
            return img, ctx if ctx is not None else SampleContext(size)
        return self.decode(data, key)

    def read_into(self, path: str, key: int, out: np.ndarray) -> bool | bytes | None:
        """:meth:`decode_into` of the file at ``path``, read in the same call where
        the region decoder takes it (``JpegDecoder.fused_path``): True when
        ``out`` holds the fused steps' result (:meth:`finish_into` runs the
        rest), the file's bytes when it does not (for :meth:`decode_into`), or
        None when nothing was read (the caller reads the file itself).

        Raises:
            OSError: the file could not be read.
            DecodeError: the decode failed.
        """
        if self.fused is None:
            return None
        return self.jpeg.fused_path(path, key, self.fused, out)

    def read_run(self, paths: list[str], keys: list[int], outs: list[np.ndarray],
                 at: np.ndarray | None = None) -> list[bool | bytes | None] | None:
        """:meth:`read_into` on each of a run of files, read and decoded in one
        call (``JpegDecoder.fused_run``): per file True, its bytes, or None
        where the caller takes it alone with :meth:`read_into`; None for all
        where :meth:`read_into` would read nothing."""
        if self.fused is None:
            return None
        return self.jpeg.fused_run(paths, keys, self.fused, outs, at)

    def finish_into(self, key: int, out: np.ndarray) -> tuple[int, int]:
        """After :meth:`decode_into` fused the first steps into ``out``: the rest
        of the chain, in place; returns the (height, width) as :meth:`transform`."""
        return self.fused.finish(key, out)  # type: ignore[union-attr]

    def transform(self, img: np.ndarray, key: int, ctx: SampleContext,
                  out: np.ndarray) -> tuple[int, int]:
        """Run the chain on a decoded image into ``out``, then recycle its decode
        memory; returns the (height, width) of the result (see ``Chain.run``)."""
        size = self.chain.run(img, key, ctx, out)
        self.jpeg.buffers.give(buffer_of(img))  # the buffers property, without the call
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
