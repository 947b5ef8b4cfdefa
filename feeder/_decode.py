"""Decode stage: read a sample's bytes and decode them to uint8 HWC RGB.

JPEGs go through simplejpeg (libjpeg-turbo), everything else through
``cv2.imdecode``; both release the GIL while they work, which is what lets a
pool of threads use every core. Grayscale, RGBA, CMYK and 16-bit inputs all
become 3-channel uint8.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
import simplejpeg

from ._rng import sample_key
from .ops import SampleContext
from ._stage import Counters, MapStage, _now
from .errors import DecodeError

if TYPE_CHECKING:
    from ._sampler import Task

# Default ceiling on decoded pixels (width * height): a decompression bomb is
# rejected from its header before any pixel memory is allocated. 2**28 pixels
# is 768 MiB of RGB, far beyond any training image.
DEFAULT_MAX_PIXELS = 1 << 28

_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

Hint = Callable[[int, int, Any], "tuple[int, int] | None"]


_PNM_TOKEN = re.compile(rb"(?:\s|#[^\n]*\n)*(\d+)")


def _pnm_size(data: bytes | memoryview) -> tuple[int, int] | None:
    head = bytes(data[:512])
    pos, dims = 2, []
    for _ in range(2):
        m = _PNM_TOKEN.match(head, pos)
        if m is None:
            return None
        dims.append(int(m.group(1)))
        pos = m.end()
    return dims[1], dims[0]


def _tiff_size(data: bytes | memoryview) -> tuple[int, int] | None:
    order = "<" if bytes(data[:2]) == b"II" else ">"
    (ifd,) = struct.unpack(order + "I", bytes(data[4:8]))
    (count,) = struct.unpack(order + "H", bytes(data[ifd:ifd + 2]))
    size = {}
    for k in range(min(count, 512)):
        entry = bytes(data[ifd + 2 + 12 * k: ifd + 14 + 12 * k])
        tag, kind = struct.unpack(order + "HH", entry[:4])
        if tag in (256, 257):  # ImageWidth, ImageLength: SHORT (3) or LONG (4)
            value = struct.unpack(order + ("H" if kind == 3 else "I"), entry[8:10] if kind == 3 else entry[8:12])[0]
            size[tag] = value
    if 256 in size and 257 in size:
        return size[257], size[256]
    return None


def _header_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """(height, width) from a PNG, BMP, GIF, WebP, PNM or TIFF header, or None when
    not one of those (or unreadable: the decoder then reports the corruption)."""
    head = bytes(data[:32])
    try:
        if head[:1] == b"P" and head[1:2] in b"123456" and len(head) > 2 and head[2:3].isspace():
            return _pnm_size(data)
        if head[:4] in (b"II*\x00", b"MM\x00*"):
            return _tiff_size(data)
        if head.startswith(_PNG_MAGIC) and head[12:16] == b"IHDR":
            w, h = struct.unpack(">II", head[16:24])
            return h, w
        if head[:2] == b"BM" and len(head) >= 26:
            w, h = struct.unpack("<ii", head[18:26])
            return abs(h), abs(w)
        if head[:6] in (b"GIF87a", b"GIF89a"):
            w, h = struct.unpack("<HH", head[6:10])
            return h, w
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            chunk = head[12:16]
            if chunk == b"VP8X":
                w = int.from_bytes(head[24:27], "little") + 1
                h = int.from_bytes(head[27:30], "little") + 1
                return h, w
            if chunk == b"VP8L":
                bits = int.from_bytes(head[21:25], "little")
                return ((bits >> 14) & 0x3FFF) + 1, (bits & 0x3FFF) + 1
            if chunk == b"VP8 ":
                w, h = struct.unpack("<HH", head[26:30])
                return h & 0x3FFF, w & 0x3FFF
    except struct.error:
        return None
    return None


def _check_png_chunks(data: bytes | memoryview) -> None:
    """Reject a PNG with a chunk longer than the rest of the file, before OpenCV reads it.

    OpenCV allocates (and touches) what a chunk's length field claims before it
    finds the data missing: a 147-byte file whose IDAT claims 3.9 GB cost 3.7 GB
    of memory and seconds of CPU. It never decodes such a file anyway.
    """
    n = len(data)
    pos = len(_PNG_MAGIC)
    while pos + 8 <= n:
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = bytes(data[pos + 4:pos + 8])
        end = pos + 12 + length  # length, type, data, CRC
        if end > n:
            raise DecodeError(f"truncated or corrupt PNG: chunk {kind.decode('latin-1')!r} at byte {pos} "
                              f"claims {length} bytes; the file has {max(0, n - pos - 12)} left")
        if kind == b"IEND":
            return
        pos = end


def _check_pixels(h: int, w: int, max_pixels: int) -> None:
    if h <= 0 or w <= 0:
        raise DecodeError(f"header gives an empty image ({w}x{h})")
    if h * w > max_pixels:
        raise DecodeError(
            f"image of {w}x{h} = {w * h} pixels exceeds max_pixels={max_pixels} "
            f"(possible decompression bomb); raise max_pixels to accept it")


def _to_rgb8(img: np.ndarray) -> np.ndarray:
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


def _cv2_decode(data: bytes | memoryview, flags: int) -> np.ndarray:
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
    every sample (measured: ~40 minor faults per image with threads, against
    ~1 with reuse). Buffers are flat uint8 arrays that only grow; the number
    alive is bounded by the samples in flight (each in-flight sample holds at
    most one). ``list.pop``/``append`` are atomic under the GIL, so no lock.
    """

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        try:
            buf = self._free.pop()
        except IndexError:
            return np.empty(nbytes + nbytes // 4, np.uint8)
        if buf.size < nbytes:
            return np.empty(nbytes + nbytes // 4, np.uint8)
        return buf

    def give(self, buf: np.ndarray | None) -> None:
        if buf is not None and not self.closed:
            self._free.append(buf)

    closed = False

    def close(self) -> None:
        """Free the spare buffers; later ones are dropped as they come back."""
        self.closed = True
        self._free.clear()


def decode_image(data: bytes | memoryview, max_pixels: int = DEFAULT_MAX_PIXELS,
                 hint: Hint | None = None, key: Any = 0,
                 buffers: DecodeBuffers | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """Decode encoded image bytes to a contiguous uint8 [H, W, 3] RGB array.

    Args:
        data: The encoded file contents.
        max_pixels: Largest accepted ``width * height``, checked from the header.
        hint: ``hint(height, width, key) -> (min_height, min_width) | None``: the
            smallest decoded size the transforms need. A JPEG that is at least
            twice that size is decoded at a reduced DCT scale that still covers it.
        key: Passed to ``hint`` as its third argument (the sample).
        buffers: Where JPEG output memory comes from. The returned image is then a
            view of a pool buffer: give its ``.base`` back with ``buffers.give``
            when done (see :func:`buffer_of`).

    Returns:
        The image, and the (height, width) of the full-size image.

    Raises:
        DecodeError: empty, corrupt, truncated, unsupported or oversized input.
    """
    if len(data) == 0:
        raise DecodeError("empty file (0 bytes)")
    if bytes(data[:3]) == _JPEG_MAGIC:
        try:
            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as exc:
            raise DecodeError(f"corrupt JPEG header: {exc}") from exc
        _check_pixels(h, w, max_pixels)
        if colorspace in ("CMYK", "YCCK"):
            # libjpeg-turbo cannot convert CMYK to RGB; OpenCV's reader handles
            # Adobe's inverted CMYK. Rare in datasets, so the slower path is fine.
            return _to_rgb8(_cv2_decode(data, cv2.IMREAD_COLOR)), (h, w)
        min_h = min_w = 0
        if hint is not None:
            need = hint(h, w, key)
            # Reduced-scale IDCT pays off from 1/2 down; scales between 1/2 and 1
            # are slower than a full decode in libjpeg-turbo, so they are not used.
            if need is not None and 2 * need[0] <= h and 2 * need[1] <= w:
                min_h, min_w = need
        buf = None if buffers is None else buffers.take(h * w * 3)
        try:
            img = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w,
                                         buffer=buf)
        except ValueError as exc:
            if buffers is not None:
                buffers.give(buf)
            raise DecodeError(f"corrupt JPEG: {exc}") from exc
        return img, (h, w)
    size = _header_size(data)
    if size is not None:
        _check_pixels(size[0], size[1], max_pixels)
    if bytes(data[:8]) == _PNG_MAGIC:
        _check_png_chunks(data)
    img = _to_rgb8(_cv2_decode(data, cv2.IMREAD_UNCHANGED))
    if size is None:
        _check_pixels(img.shape[0], img.shape[1], max_pixels)
    return img, (img.shape[0], img.shape[1])


def buffer_of(img: np.ndarray | None) -> np.ndarray | None:
    """The pool buffer behind an image from :func:`decode_image`, if it has one."""
    base = getattr(img, "base", None)
    return base if isinstance(base, np.ndarray) and base.ndim == 1 else None


class Decoder(MapStage):
    """Reads each sample from the source and decodes it; hands it to the augment stage."""

    name = "decode"
    phase = "read"

    def process(self, task: "Task", c: Counters) -> None:
        run = self.run
        try:
            data, label = run.source.read(task.index)
        except Exception as exc:
            run.sample_failed("read", task, exc, c)
            return
        c.current = ("decode", task.index, _now())
        task.label = label
        task.key = sample_key(run.seed, run.epoch, task.index)
        task.ctx = None
        task.image, size = decode_image(data, run.max_pixels, run.hint, task, run.decode_buffers)
        if task.ctx is None:  # no hint was asked for (not a JPEG, or no hinting transform)
            task.ctx = SampleContext(size)
        if run.augmenter.num_threads:
            self.put(c, self.outbox, task)
        else:
            run.augmenter.inline(task, c)
