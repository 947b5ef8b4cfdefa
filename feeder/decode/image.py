"""Decoding an image's bytes to uint8 HWC RGB (:func:`decode_image`, and
:func:`decode_planned` with the transforms' plan), into reused memory
(:class:`DecodeBuffers`).

JPEGs go through :class:`~feeder.decode.jpeg.JpegDecoder` (feeder's region
decoder when it is built, see :func:`~feeder.decode.status.jpeg_decoder`,
else simplejpeg); everything else through ``cv2.imdecode``. All release the
GIL while they work, which is what lets a pool of threads use every core.
Grayscale, RGBA, CMYK and 16-bit inputs all become 3-channel uint8.

Only the formats in :data:`~feeder.decode.headers.SUPPORTED_FORMATS` are
decoded, because their size is read from the header and checked against
``max_pixels`` before decoding; anything else OpenCV could decode is refused.
The EXIF orientation is ignored unless asked for, the same way for every
format (see :mod:`feeder.decode.region`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import cv2
import numpy as np

from ..errors import DecodeError
from ..sample import DEFAULT_MAX_PIXELS
from .headers import JPEG_MAGIC, check_png_chunks, check_pixels, read_header
from .jpeg import JpegDecoder, Plan
from .region import orient, orientation_of, stored_tiff

__all__ = ["DecodeBuffers", "buffer_of", "cv2_decode", "decode_image", "decode_planned",
           "decode_scale", "rgb_of_pixels", "to_rgb8"]

#: ``hint(height, width, key) -> (min_height, min_width) | None``: the smallest
#: decoded size the transforms need.
Hint = Callable[[int, int, Any], "tuple[int, int] | None"]


def to_rgb8(img: np.ndarray) -> np.ndarray:
    """Any cv2.imdecode result (gray, BGR, BGRA; 8/16-bit or float) to uint8 RGB."""
    if img.dtype == np.uint16:
        img = cv2.convertScaleAbs(img, alpha=1.0 / 257.0)  # rounds 0..65535 to 0..255
    elif img.dtype != np.uint8:
        img = cv2.convertScaleAbs(np.clip(img.astype(np.float32), 0.0, 1.0), alpha=255.0)
    if img.ndim == 2:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
    channels = img.shape[2]
    if channels == 3:
        return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    if channels == 4:
        return cv2.cvtColor(img, cv2.COLOR_BGRA2RGB)
    if channels in (1, 2):
        return cv2.cvtColor(np.ascontiguousarray(img[:, :, 0]), cv2.COLOR_GRAY2RGB)
    raise DecodeError(f"unsupported channel count {channels}")


def cv2_decode(data: bytes | memoryview, flags: int) -> np.ndarray:
    try:
        img = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags)
    except cv2.error as exc:  # OpenCV raises for some inputs (its own size cap) instead of None
        raise DecodeError(f"OpenCV could not decode it: {str(exc).strip().splitlines()[-1]}") from exc
    if img is None:
        raise DecodeError("not a decodable image (unknown format, or corrupt data)")
    return img


class DecodeBuffers:
    """Reusable output memory for JPEG decoding.

    A fresh half-megabyte array per image costs the allocator page faults on
    every sample; reused buffers do not. Buffers are flat uint8 arrays that
    only grow; the number alive is bounded by the samples in flight (each
    in-flight sample holds at most one). ``list.pop``/``append`` are atomic under the GIL, so no lock.
    """

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        # The buffers this pool made, by id, held weakly: give() takes back only
        # those. Any other array is someone else's memory (a 1-D array behind a
        # source's own image looks exactly like a pool buffer from its view's
        # ``.base``), which a later decode must never write into.
        self._made: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    def take(self, nbytes: int) -> np.ndarray:
        try:
            buf = self._free.pop()
        except IndexError:
            return self._new(nbytes)
        if buf.size < nbytes:
            return self._new(nbytes)
        return buf

    def _new(self, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes + nbytes // 4, np.uint8)
        self._made[id(buf)] = buf
        return buf

    def nbytes(self) -> int:
        """Bytes of the buffers this pool made that are alive now, spare or in use."""
        return sum(b.nbytes for b in list(self._made.values()))

    def give(self, buf: np.ndarray | None) -> None:
        """Take ``buf`` back for reuse if this pool made it (anything else is ignored)."""
        if buf is not None and not self.closed and self._made.get(id(buf)) is buf:
            self._free.append(buf)

    closed = False

    def close(self) -> None:
        """Free the spare buffers; later ones are dropped as they come back."""
        self.closed = True
        self._free.clear()


def rgb_of_pixels(arr: np.ndarray, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """An image the source gave decoded (checked by ``sample.pixels`` and the read
    step: uint8 ``[H, W]`` or ``[H, W, C]``, C in 1, 3, 4) as the decoders' output, uint8
    ``[H, W, 3]`` RGB, the way a file of the same pixels is decoded: gray widened
    to three channels, an alpha channel dropped.

    RGB and RGBA come back as a read-only view of ``arr``, whatever its strides
    (the transforms read the view of what they crop and never write into their
    input); gray as a new array.

    Raises:
        DecodeError: larger than ``max_pixels``.
    """
    h, w = arr.shape[:2]
    check_pixels(h, w, max_pixels)
    if arr.ndim == 2:
        return cv2.cvtColor(arr, cv2.COLOR_GRAY2RGB)
    if arr.shape[2] == 1:
        return cv2.cvtColor(arr[:, :, 0], cv2.COLOR_GRAY2RGB)
    view = arr[:, :, :3]
    view.flags.writeable = False  # the source's memory: a transform writing there is a bug
    return view


def decode_image(data: bytes | memoryview, max_pixels: int = DEFAULT_MAX_PIXELS,
                 hint: Hint | None = None, key: Any = 0,
                 buffers: DecodeBuffers | None = None,
                 exif_orientation: bool = False) -> tuple[np.ndarray, tuple[int, int]]:
    """Decode encoded image bytes to a contiguous uint8 [H, W, 3] RGB array.

    The format is recognised from the bytes (never the file name) and must be one
    of :data:`~feeder.decode.headers.SUPPORTED_FORMATS`: their sizes are read from the header and checked
    against ``max_pixels`` before any pixel memory is allocated. Other formats,
    and headers that cannot be read, are refused.

    Args:
        data: The encoded file contents.
        max_pixels: Largest accepted ``width * height``, checked from the header
            (and again on the decoded image, for files whose first frame or page
            differs from what the header promised).
        hint: ``hint(height, width, key) -> (min_height, min_width) | None``: the
            smallest decoded size the transforms need. A JPEG that is at least
            twice that size is decoded at a reduced DCT scale that still covers it.
            Sizes are those of the returned (oriented) image.
        key: Passed to ``hint`` as its third argument (the sample).
        buffers: Where JPEG output memory comes from. The returned image is then a
            view of a pool buffer: give its ``.base`` back with ``buffers.give``
            when done (see :func:`buffer_of`).
        exif_orientation: Apply the EXIF Orientation tag (JPEG APP1 Exif, PNG
            eXIf, WebP EXIF, TIFF tag 274) by rotating/flipping the pixels. By
            default it is ignored for every format and the pixels come out as stored.

    Returns:
        The image, and the (height, width) of the full-size image (after orientation).

    Raises:
        DecodeError: empty, corrupt, truncated, unsupported or oversized input.
    """
    plan = None if hint is None else (lambda h, w, k: (hint(h, w, k), None))
    img, size, _ = decode_planned(data, max_pixels, plan, key, buffers, exif_orientation)
    return img, size


def decode_planned(data: bytes | memoryview, max_pixels: int, plan: Plan | None, key: Any,
                   buffers: DecodeBuffers | None, exif_orientation: bool,
                   jpeg: JpegDecoder | None = None) -> tuple[np.ndarray, tuple[int, int], Any]:
    """:func:`decode_image` with the transforms' plan: ``plan(height, width, key)``
    returns ``(need, planned)``, ``need`` as ``hint`` would and ``planned`` whatever
    the transforms drew to compute it (handed back, so that nothing is drawn twice).

    ``jpeg``: how JPEGs are decoded, with its own settings (the region decoder
    reads a region-decoded file to its end, once per distinct byte string: see
    :class:`~feeder.decode.jpeg.JpegDecoder`); by default one of the settings
    given here.

    Returns:
        The image, its full (oriented) size, and ``planned`` (None when ``plan`` was
        not called: not a JPEG, or no plan).
    """
    if len(data) == 0:
        raise DecodeError("empty file (0 bytes)")
    if (data[:3] if type(data) is bytes else bytes(data[:3])) == JPEG_MAGIC:
        if jpeg is None:
            jpeg = JpegDecoder(max_pixels, buffers, exif_orientation)
        return jpeg.decode(data, plan, key)
    header = read_header(data)
    check_pixels(header.height, header.width, max_pixels)
    if header.format == "PNG":
        check_png_chunks(data)
    stored = stored_tiff(data, header) if header.format == "TIFF" else data
    # IMREAD_UNCHANGED keeps 16-bit depth for an exact conversion, and makes
    # imdecode ignore EXIF orientation (it cannot be combined with
    # IMREAD_IGNORE_ORIENTATION: it is -1, all bits set).
    img = to_rgb8(cv2_decode(stored, cv2.IMREAD_UNCHANGED))
    # A multi-page or malformed file may decode to another size than its header's.
    check_pixels(img.shape[0], img.shape[1], max_pixels)
    if exif_orientation:
        img = orient(img, orientation_of(header, data))
    return img, (img.shape[0], img.shape[1]), None


def buffer_of(img: np.ndarray | None) -> np.ndarray | None:
    """The pool buffer behind an image from :func:`decode_image`, if it has one."""
    base = getattr(img, "base", None)
    return base if isinstance(base, np.ndarray) and base.ndim == 1 else None


def decode_scale(full: tuple[int, int], decoded: tuple[int, int]) -> tuple[float, float]:
    """(y, x) scale from the full-size image's pixels to the decoded image's.

    libjpeg-turbo's scaled decode of ``n`` pixels at scale ``k/8`` gives
    ``ceil(n * k / 8)`` of them, each covering exactly ``8/k`` source pixels
    (the last one partly past the edge), so the scale is ``k/8``, not the ratio
    of the sizes.
    """
    if full == decoded:
        return 1.0, 1.0
    for k in (7, 6, 5, 4, 3, 2, 1):
        if all(-(-f * k // 8) == d for f, d in zip(full, decoded)):
            return k / 8, k / 8
    return decoded[0] / full[0], decoded[1] / full[1]
