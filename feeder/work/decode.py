"""Decode stage: read a sample's bytes and decode them to uint8 HWC RGB (and a
mask PNG to its integer values: :func:`decode_mask`).

JPEGs go through feeder's own extension ``feeder.work._jpeg`` when it was built
(the system's libjpeg-turbo, decoding only the region the first transform
reads, at DCT scale 1/1, 1/2, 1/4 or 1/8: see :func:`jpeg_decoder`), else
through simplejpeg (libjpeg-turbo, whole image, reduced scale when it covers);
everything else through ``cv2.imdecode``. All release the GIL while they work,
which is what lets a pool of threads use every core. Grayscale, RGBA, CMYK and
16-bit inputs all become 3-channel uint8.

Only the formats in :data:`SUPPORTED_FORMATS` are decoded, because their size
is read from the header and checked against ``max_pixels`` before decoding;
anything else OpenCV could decode is refused (see :func:`decode_image`). The
EXIF orientation is ignored unless asked for, the same way for every format
(see ``_region.py``, which also holds the region decode's geometry).
"""

from __future__ import annotations

import logging
import re
import struct
import weakref
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import cv2
import numpy as np
import simplejpeg

from ..sample import SampleContext
from .region import TIFF_MAX_ENTRIES, decode_region, orient, orientation_of, stored_tiff
from ..sample import DEFAULT_MAX_PIXELS
from .verified import VerifiedJpegs
from . import extension
from .extension import HOW_TO_BUILD, NO_EXTENSION_ENV
from ..errors import DecodeError

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_PIXELS", "DecodeBuffers", "SUPPORTED_FORMATS", "buffer_of", "decode_image",
           "decode_mask", "decode_planned", "decode_scale", "jpeg_decoder", "note_jpeg_decoder",
           "rgb_of_pixels"]

_jpeg, _jpeg_missing = extension.jpeg, extension.missing
_noted = False


def jpeg_decoder() -> dict[str, Any]:
    """Which JPEG decoder feeder uses in this process.

    Returns:
        ``{"decoder": "feeder.work._jpeg" or "simplejpeg", "region_decode": bool,
        "libjpeg_turbo": version or None, "huffman": "feeder" (its own Huffman
        decoder, with the row index) or "libjpeg-turbo" (the running library's
        entropy-decoder layout is not one it knows) or None, "reason": why the
        extension is not used, or None}``.
    """
    if _jpeg is not None:
        own = getattr(_jpeg, "ENTROPY_LAYOUT", None) is not None
        return {"decoder": "feeder.work._jpeg", "region_decode": True,
                "libjpeg_turbo": _jpeg.LIBJPEG_TURBO_VERSION,
                "huffman": "feeder" if own else "libjpeg-turbo", "reason": None}
    return {"decoder": "simplejpeg", "region_decode": False, "libjpeg_turbo": None,
            "huffman": None, "reason": _jpeg_missing}


def note_jpeg_decoder() -> None:
    """Log once per process which JPEG decoder runs (called by the first Feeder)."""
    global _noted
    if _noted:
        return
    _noted = True
    if _jpeg is not None:
        log.debug("JPEG decoding: feeder.work._jpeg (libjpeg-turbo %s), region + DCT-scaled",
                  _jpeg.LIBJPEG_TURBO_VERSION)
    elif _jpeg_missing is not None and _jpeg_missing.startswith(NO_EXTENSION_ENV):
        log.info("JPEG decoding: simplejpeg (whole image before every crop): %s", _jpeg_missing)
    else:
        log.warning("JPEG decoding: simplejpeg, which decodes the whole image before every crop: %s. "
                    "For the faster region decoder, %s.", _jpeg_missing, HOW_TO_BUILD)

# Formats decoded, each with its size read from the header before any pixel
# memory is allocated. OpenCV can decode more (Radiance HDR, PFM, PAM, Sun
# raster, JPEG 2000, AVIF, OpenEXR, ...), but without a header check a small file
# claiming a huge size would be decoded first and rejected after: those are refused.
SUPPORTED_FORMATS = ("JPEG", "PNG", "BMP", "GIF", "WebP", "PNM (P1-P6)", "TIFF (and BigTIFF)")

_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Formats recognised only to name them when refusing them: (magic test, name).
_REFUSED = (
    (lambda h: h.startswith((b"#?RADIANCE", b"#?RGBE")), "Radiance HDR"),
    (lambda h: h[:3] in (b"PF\n", b"Pf\n", b"PF\r", b"Pf\r", b"PF ", b"Pf "), "PFM"),
    (lambda h: h[:3] in (b"P7\n", b"P7 ", b"P7\r"), "PAM"),
    (lambda h: h.startswith(b"\x59\xa6\x6a\x95"), "Sun raster"),
    (lambda h: h.startswith((b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"\xff\x4f\xff\x51")), "JPEG 2000"),
    (lambda h: h[4:8] == b"ftyp" and h[8:12] in (b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1"),
     "AVIF/HEIF"),
    (lambda h: h.startswith(b"\x76\x2f\x31\x01"), "OpenEXR"),
    (lambda h: h.startswith((b"\xff\x0a", b"\x00\x00\x00\x0cJXL \r\n\x87\n")), "JPEG XL"),
)

Hint = Callable[[int, int, Any], "tuple[int, int] | None"]
Plan = Callable[[int, int, Any], "tuple[tuple[int, int] | None, Any]"]


class _Header(NamedTuple):
    """What decoding needs to know before it starts (non-JPEG formats)."""

    format: str
    height: int
    width: int
    # TIFF only: where the first IFD's Orientation value is, and its byte order.
    tiff_orientation_at: int | None = None
    tiff_order: str = "<"


def _corrupt(fmt: str, what: str) -> DecodeError:
    return DecodeError(f"corrupt {fmt} header: {what}")


_PNM_TOKEN = re.compile(rb"(?:\s|#[^\n]*\n)*(\d+)")


def _pnm_header(data: bytes | memoryview) -> _Header:
    head = bytes(data[:1024])
    pos, dims = 2, []
    for _ in range(2):
        m = _PNM_TOKEN.match(head, pos)
        if m is None:
            raise _corrupt("PNM", "no width and height in its first 1024 bytes")
        dims.append(int(m.group(1)))
        pos = m.end()
    return _Header("PNM", dims[1], dims[0])


# Classic TIFF (magic 42) and BigTIFF (43): IFD entry count format, entry
# size, where an entry's value starts.
_TIFF_LAYOUT = {42: ("H", 12, 8), 43: ("Q", 20, 12)}
_TIFF_SIZE_TYPES = {3: "H", 4: "I", 16: "Q"}  # SHORT, LONG, LONG8 (BigTIFF)


def _tiff_header(data: bytes | memoryview) -> _Header:
    """Size (and where the Orientation tag is) from the first IFD of a TIFF or BigTIFF."""
    order = "<" if bytes(data[:2]) == b"II" else ">"
    try:
        (magic,) = struct.unpack(order + "H", bytes(data[2:4]))  # 42 or 43: the caller checked
        count_fmt, entry_size, value_at = _TIFF_LAYOUT[magic]
        if magic == 42:
            (ifd,) = struct.unpack(order + "I", bytes(data[4:8]))
        else:
            bytesize, _, ifd = struct.unpack(order + "HHQ", bytes(data[4:16]))
            if bytesize != 8:
                raise _corrupt("TIFF", f"BigTIFF offset size {bytesize} (expected 8)")
        count_size = struct.calcsize(count_fmt)
        (count,) = struct.unpack(order + count_fmt, bytes(data[ifd:ifd + count_size]))
    except struct.error:
        raise _corrupt("TIFF", "truncated before the first IFD") from None
    if not 0 < count <= TIFF_MAX_ENTRIES:
        raise _corrupt("TIFF", f"first IFD has {count} entries")
    start = ifd + count_size
    table = bytes(data[start:start + count * entry_size])
    if len(table) < count * entry_size:
        raise _corrupt("TIFF", "first IFD runs past the end of the file")
    size: dict[int, int] = {}
    orientation_at = None
    for k in range(count):
        at = k * entry_size
        tag, kind = struct.unpack(order + "HH", table[at:at + 4])
        if tag in (256, 257):  # ImageWidth, ImageLength
            fmt = _TIFF_SIZE_TYPES.get(kind)
            if fmt is None or (kind == 16 and magic == 42):
                raise _corrupt("TIFF", f"tag {tag} has type {kind}")
            v = at + value_at
            size[tag] = struct.unpack(order + fmt, table[v:v + struct.calcsize(fmt)])[0]
        elif tag == 274 and kind == 3:  # Orientation, a SHORT
            orientation_at = start + at + value_at
    if 256 not in size or 257 not in size:
        raise _corrupt("TIFF", "first IFD has no ImageWidth/ImageLength")
    return _Header("TIFF", size[257], size[256], orientation_at, order)


def _webp_header(head: bytes) -> _Header:
    if len(head) < 30:
        raise _corrupt("WebP", "truncated")
    chunk = head[12:16]
    if chunk == b"VP8X":
        return _Header("WebP", int.from_bytes(head[27:30], "little") + 1,
                       int.from_bytes(head[24:27], "little") + 1)
    if chunk == b"VP8L":
        if head[20] != 0x2F:
            raise _corrupt("WebP", "bad VP8L signature")
        bits = int.from_bytes(head[21:25], "little")
        return _Header("WebP", ((bits >> 14) & 0x3FFF) + 1, (bits & 0x3FFF) + 1)
    if chunk == b"VP8 ":
        if head[23:26] != b"\x9d\x01\x2a":
            raise _corrupt("WebP", "bad VP8 start code")
        w, h = struct.unpack("<HH", head[26:30])
        return _Header("WebP", h & 0x3FFF, w & 0x3FFF)
    raise _corrupt("WebP", f"unknown first chunk {chunk!r}")


def _bmp_header(head: bytes) -> _Header:
    if len(head) < 26:
        raise _corrupt("BMP", "truncated")
    (dib,) = struct.unpack("<I", head[14:18])
    if dib == 12:  # OS/2 BITMAPCOREHEADER: unsigned 16-bit sizes
        w, h = struct.unpack("<HH", head[18:22])
        return _Header("BMP", h, w)
    if dib < 16:
        raise _corrupt("BMP", f"DIB header size {dib}")
    w, h = struct.unpack("<ii", head[18:26])
    if w <= 0:
        raise _corrupt("BMP", f"width {w}")
    return _Header("BMP", abs(h), w)  # a negative height means rows stored top-down


def _read_header(data: bytes | memoryview) -> _Header:
    """The format and size of a non-JPEG image, from its header.

    Raises:
        DecodeError: a format outside :data:`SUPPORTED_FORMATS`, or a header that
            cannot be read (nothing unchecked ever reaches the decoder).
    """
    head = bytes(data[:32])
    if head[:1] == b"P" and head[1:2] in b"123456" and len(head) > 2 and head[2:3] in b" \t\r\n#":
        return _pnm_header(data)
    if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return _tiff_header(data)
    if head.startswith(_PNG_MAGIC):
        if len(head) < 24 or head[12:16] != b"IHDR":
            raise _corrupt("PNG", "no IHDR chunk first")
        w, h = struct.unpack(">II", head[16:24])
        return _Header("PNG", h, w)
    if head[:2] == b"BM":
        return _bmp_header(head)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        if len(head) < 10:
            raise _corrupt("GIF", "truncated")
        w, h = struct.unpack("<HH", head[6:10])
        return _Header("GIF", h, w)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_header(head)
    accepted = ", ".join(SUPPORTED_FORMATS)
    for test, name in _REFUSED:
        if test(head):
            raise DecodeError(f"{name} images are not supported (accepted formats: {accepted}); "
                              f"convert it to one of those")
    raise DecodeError(f"not a decodable image: format not recognised from its first bytes "
                      f"{head[:8]!r} (accepted formats: {accepted})")


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
        raise DecodeError(f"header gives an empty image: ({h}, {w}) (height, width)")
    if h * w > max_pixels:
        raise DecodeError(
            f"image of ({h}, {w}) (height, width) = {w * h} pixels exceeds max_pixels={max_pixels} "
            f"(possible decompression bomb); raise max_pixels to accept it")


# A JPEG's start-of-frame marker names its coding process (ITU-T T.81, table
# B.1); 0xC4, 0xC8 and 0xCC in that range are other markers (DHT, JPG, DAC).
_SOF_PROCESS = {
    0xC0: "baseline", 0xC1: "extended sequential", 0xC2: "progressive", 0xC3: "lossless",
    0xC5: "differential sequential", 0xC6: "differential progressive", 0xC7: "differential lossless",
    0xC9: "extended sequential, arithmetic", 0xCA: "progressive, arithmetic",
    0xCB: "lossless, arithmetic", 0xCD: "differential sequential, arithmetic",
    0xCE: "differential progressive, arithmetic", 0xCF: "differential lossless, arithmetic",
}
_LOSSLESS_SOF = frozenset((0xC3, 0xCB))
_HIERARCHICAL_SOF = frozenset((0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF))
_PROGRESSIVE_SOF = frozenset((0xC2, 0xCA))
# Segments (and fill bytes) walked before the first scan: real files have
# tens at most (an ICC profile is cut into at most 255 APP2 segments); the
# bound keeps a hostile run of tiny segments from costing a Python loop per
# four bytes of the file.
_MAX_HEADER_STEPS = 4096


class _JpegFrame(NamedTuple):
    """A JPEG's frame header (its SOF segment), read by :func:`_jpeg_frame`."""

    marker: int  # 0xC0..0xCF: the coding process
    precision: int  # bits per sample
    height: int
    width: int
    components: int
    scan_at: int  # a progressive frame's first SOS marker (where the walk stopped when none)

    @property
    def process(self) -> str:
        return f"SOF{self.marker - 0xC0}, {_SOF_PROCESS[self.marker]}"

    @property
    def lossless(self) -> bool:
        return self.marker in _LOSSLESS_SOF

    @property
    def progressive(self) -> bool:
        return self.marker in _PROGRESSIVE_SOF


def _jpeg_frame(data: bytes | memoryview) -> _JpegFrame | None:
    """The frame header of a JPEG, found by walking its marker segments from
    SOI to the first scan (each length checked against the bytes left), and
    checked against what feeder decodes.

    The decoders' own header reading does not say which process a file uses,
    and that decides how it may be decoded: DCT scaling has no meaning for a
    lossless file, and a libjpeg-turbo that ignores it there writes a full-size
    image where a scaled one was asked for (libjpeg-turbo 3.0 to 3.1.3's
    TurboJPEG, which simplejpeg bundles, past the end of its output).

    Returns:
        The frame, or None when the walk found none before the first scan (or
        the data's end): a corrupt header, for the decoder to report.

    Raises:
        DecodeError: a process or sample precision feeder does not decode
            (hierarchical files; samples of other than 8 bits), or a header of
            more than ``_MAX_HEADER_STEPS`` segments and fill bytes.
    """
    pos, n, frame = 2, len(data), None
    for _ in range(_MAX_HEADER_STEPS):
        if pos + 4 > n or data[pos] != 0xFF:
            break
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0xDA or marker == 0xD9:  # first scan, or end of image
            break
        length = (data[pos + 2] << 8) | data[pos + 3]
        if length < 2 or pos + 2 + length > n:
            break
        if marker in _SOF_PROCESS and frame is None:  # a second one is the decoder's error
            if length < 8:
                break
            frame = (marker, data[pos + 4], (data[pos + 5] << 8) | data[pos + 6],
                     (data[pos + 7] << 8) | data[pos + 8], data[pos + 9])
            if marker not in _PROGRESSIVE_SOF:
                break  # only a progressive frame's scans are counted: stop here
        pos += 2 + length
    else:
        raise DecodeError(f"corrupt JPEG header: more than {_MAX_HEADER_STEPS} marker segments "
                          f"and fill bytes before the first scan")
    if frame is None:
        return None
    found = _JpegFrame(*frame, pos)
    if found.marker in _HIERARCHICAL_SOF:
        raise DecodeError(f"hierarchical JPEG ({found.process}) is not supported: libjpeg-turbo "
                          f"decodes no differential frames; re-encode it as a baseline or "
                          f"progressive JPEG")
    if found.precision != 8:
        raise DecodeError(f"JPEG of {found.precision}-bit samples ({found.process}) is not "
                          f"supported: feeder decodes 8-bit JPEGs (libjpeg-turbo's 8-bit "
                          f"interface); convert it to 8 bits, or to a 16-bit PNG or TIFF")
    return found


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
    _check_pixels(h, w, max_pixels)
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
    of :data:`SUPPORTED_FORMATS`: their sizes are read from the header and checked
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
                   buffers: DecodeBuffers | None, exif_orientation: bool, jpeg_verify: bool = True,
                   verified: VerifiedJpegs | None = None) -> tuple[np.ndarray, tuple[int, int], Any]:
    """:func:`decode_image` with the transforms' plan: ``plan(height, width, key)``
    returns ``(need, planned)``, ``need`` as ``hint`` would and ``planned`` whatever
    the transforms drew to compute it (handed back, so that nothing is drawn twice).

    ``jpeg_verify``: a JPEG decoded by region is still entropy-decoded to its
    end, so damage anywhere in the file fails it as a full decode would (see
    ``Feeder``'s ``jpeg_verify``); with ``verified``, only the first time its
    exact bytes come (see :class:`~feeder.work.verified.VerifiedJpegs`).

    Returns:
        The image, its full (oriented) size, and ``planned`` (None when ``plan`` was
        not called: not a JPEG, or no plan).
    """
    if len(data) == 0:
        raise DecodeError("empty file (0 bytes)")
    if (data[:3] if type(data) is bytes else bytes(data[:3])) == _JPEG_MAGIC:
        return _decode_jpeg(data, max_pixels, plan, key, buffers, exif_orientation, jpeg_verify,
                            verified)
    header = _read_header(data)
    _check_pixels(header.height, header.width, max_pixels)
    if header.format == "PNG":
        _check_png_chunks(data)
    stored = stored_tiff(data, header) if header.format == "TIFF" else data
    # IMREAD_UNCHANGED keeps 16-bit depth for an exact conversion, and makes
    # imdecode ignore EXIF orientation (it cannot be combined with
    # IMREAD_IGNORE_ORIENTATION: it is -1, all bits set).
    img = _to_rgb8(_cv2_decode(stored, cv2.IMREAD_UNCHANGED))
    # A multi-page or malformed file may decode to another size than its header's.
    _check_pixels(img.shape[0], img.shape[1], max_pixels)
    if exif_orientation:
        img = orient(img, orientation_of(header, data))
    return img, (img.shape[0], img.shape[1]), None


def _decode_jpeg(data: bytes | memoryview, max_pixels: int, plan: Plan | None, key: Any,
                 buffers: DecodeBuffers | None, exif_orientation: bool, jpeg_verify: bool = True,
                 verified: VerifiedJpegs | None = None) -> tuple[np.ndarray, tuple[int, int], Any]:
    frame = _jpeg_frame(data)  # the process first: it decides how the file may be decoded
    lossless = frame is not None and frame.lossless
    if _jpeg is not None and not lossless:
        w, h, _, colorspace, sampling, scans = _jpeg.header(data)  # raises DecodeError("corrupt JPEG header: ...")
    else:
        # A lossless file is read by simplejpeg whatever the path: the system's
        # libjpeg-turbo before 3.0 knows no lossless process.
        try:
            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as exc:
            needs = " (lossless JPEGs need libjpeg-turbo 3.0 or later)" if lossless else ""
            raise DecodeError(f"corrupt JPEG header: {_simplejpeg_says(exc)}{needs}") from exc
        sampling = scans = None
    if frame is None:  # the decoder read a header that the marker walk could not
        raise DecodeError("corrupt JPEG header: no frame header (SOF) in a walk of its marker "
                          "segments (bytes between them?)")
    if h <= 0 or w <= 0 or h * w > max_pixels:
        _check_pixels(h, w, max_pixels)  # raises, saying which
    orientation = orientation_of(None, data) if exif_orientation else 1
    swap = orientation >= 5  # transposing orientations: the shown image is w x h
    size = (w, h) if swap else (h, w)
    if colorspace in ("CMYK", "YCCK"):
        # libjpeg-turbo cannot convert CMYK to RGB: decode the (Adobe, inverted)
        # ink values with simplejpeg, whose corrupt-data warnings are errors as
        # for every other JPEG (OpenCV's reader only prints them), and convert
        # as browsers and OpenCV do: R = C * K / 255, rounded. Rare in datasets.
        # Whole, at full size, whatever the transforms need (lossless files too).
        _check_scans(data, frame)
        ink = _simplejpeg_whole(data, "CMYK", frame, colorspace)
        k = ink[..., 3:4].astype(np.uint16)
        img = ((ink[..., :3].astype(np.uint16) * k + 127) // 255).astype(np.uint8)
        return orient(img, orientation), size, None
    if lossless:
        # DCT scaling means nothing to a lossless file, and libjpeg-turbo 3.0 to
        # 3.1.3 (simplejpeg bundles one) decodes it at full size into the
        # output sized for the scale asked for: garbage with a pool buffer,
        # a heap overrun without. It is decoded whole at full size, as a PNG
        # is, and the transforms draw their crop from that. libjpeg-turbo
        # converts no colours in lossless mode: gray is widened here.
        if colorspace == "Gray":
            img = cv2.cvtColor(_simplejpeg_whole(data, "GRAY", frame, colorspace), cv2.COLOR_GRAY2RGB)
        elif colorspace == "RGB":
            img = _simplejpeg_whole(data, "RGB", frame, colorspace)
        else:
            raise DecodeError(f"lossless JPEG ({frame.process}) stored as {colorspace} is not "
                              f"supported: libjpeg-turbo converts no colours in lossless mode "
                              f"(RGB, gray and CMYK lossless JPEGs are decoded)")
        return orient(img, orientation), size, None
    min_h = min_w = 0
    planned = None
    # Chroma sampling factors other than the usual ones (valid JPEG, rare):
    # libjpeg-turbo's partial decode can loop forever or give wrong pixels on
    # them, and simplejpeg refuses them; the extension decodes them whole.
    unusual = _jpeg is not None and sampling not in USUAL_SAMPLINGS and colorspace in ("Gray", "YCbCr", "RGB")
    need = None
    if plan is not None:
        need, planned = plan(size[0], size[1], key)
    if unusual or (_jpeg is not None and colorspace in ("Gray", "YCbCr", "RGB") and need is None
                   and getattr(planned, "box", None) is None):
        # The whole image at the largest reduction that covers need; a chain that
        # planned a box gets its context filled in as for a region decode. A
        # whole image at full size goes through the extension too, so that one
        # Huffman decoder judges damaged data whether a crop is drawn or not
        # (feeder's reports the junk bytes before a marker that libjpeg-turbo's
        # read-ahead, and so simplejpeg's, can pass over). A hint without a box
        # stays with simplejpeg, whose 3/8, 5/8... scales the extension has not.
        ctx = planned if getattr(planned, "box", None) is not None else SampleContext(size)
        img, _ = decode_region(_jpeg, data, h, w, need, ctx, orientation, max_pixels, buffers, True,
                               whole=True)
        return img, size, planned
    if plan is not None:
        if (_jpeg is not None and colorspace in ("Gray", "YCbCr", "RGB")
                and getattr(planned, "box", None) is not None):
            # Bytes that were read to their end without an error before decode
            # the same way again: reading may stop after the crop's last row.
            # (A progressive file's scans are all read before any row: its end
            # costs nothing more to reach, so it is not remembered.)
            # Every decode also records where the rows it passes start (the row
            # index, see verified.py: all of them in the read to the end, down
            # to the crop otherwise); a later one starts at the row above its
            # crop, and records on past the index's last row if it goes further.
            fp, check = (verified.fingerprints(data) if verified is not None and not scans
                         else (0, 0))
            index = verified.index(fp, check) if fp else None  # type: ignore[union-attr]
            verify = jpeg_verify and not (fp and verified.seen(fp))  # type: ignore[union-attr]
            img, made = decode_region(_jpeg, data, h, w, need, planned, orientation, max_pixels,
                                      buffers, verify, index=index,
                                      record=verified.points_of(len(data)) if fp else 0)  # type: ignore[union-attr]
            # A buffer other than bytes may have changed while it was decoded
            # (the decoder and the CRC release the GIL): remember only bytes
            # that were the same before and after.
            if fp and (verify or made is not None) and (
                    type(data) is bytes or verified.fingerprints(data) == (fp, check)):  # type: ignore[union-attr]
                if verify:
                    verified.add(fp, made, check)  # type: ignore[union-attr]
                else:
                    verified.keep_index(fp, made, check)  # type: ignore[union-attr, arg-type]
            return img, size, planned
        if need is not None and swap:
            need = (need[1], need[0])
        # Reduced-scale IDCT pays off from 1/2 down; scales between 1/2 and 1
        # are slower than a full decode in libjpeg-turbo, so they are not used.
        if need is not None and 2 * need[0] <= h and 2 * need[1] <= w:
            min_h, min_w = need
    _check_scans(data, frame)
    buf = None if buffers is None else buffers.take(h * w * 3)
    try:
        img = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w,
                                     buffer=buf)
    except ValueError as exc:
        if buffers is not None:
            buffers.give(buf)
        raise DecodeError(f"corrupt JPEG: {_simplejpeg_says(exc)}") from exc
    if orientation != 1:
        img = orient(img, orientation)  # a new array: the pool buffer is free again
        if buffers is not None:
            buffers.give(buf)
    return img, size, planned


#: The chroma layouts (the extension's header names them) that libjpeg-turbo's
#: partial decode (rows skipped, columns cropped) and simplejpeg handle. Other
#: sampling factors are valid JPEG and rare (a 4x4 luma, a 2x1 Cr beside a 1x1
#: Cb): libjpeg-turbo 2.1's row skipping loops forever on some of them and its
#: column cropping gives wrong pixels at reduced scales, and simplejpeg refuses
#: them all, so the extension decodes them whole (``decode_region(whole=True)``).
USUAL_SAMPLINGS = frozenset(("gray", "4:4:4", "4:2:2", "4:2:0", "4:4:0", "4:1:1"))


def _simplejpeg_whole(data: bytes | memoryview, colorspace: str, frame: _JpegFrame,
                      stored: str) -> np.ndarray:
    """The whole image at full size through simplejpeg (no scaling asked for)."""
    try:
        return simplejpeg.decode_jpeg(data, colorspace=colorspace)
    except ValueError as exc:
        raise DecodeError(f"corrupt JPEG ({frame.process}, {stored}): {exc}") from exc


def _simplejpeg_says(exc: Exception) -> str:
    """simplejpeg's error, with what it means when the file is valid but has sampling
    factors it cannot decode (TurboJPEG's API knows the usual layouts only)."""
    text = str(exc)
    if "subsampling level" in text:
        return (f"{text} (the file's chroma sampling factors are not one of the usual layouts, "
                f"which simplejpeg alone decodes; feeder's JPEG extension decodes them: "
                f"{HOW_TO_BUILD})")
    return text


# The region decoder's bound on a progressive file's scans (each a pass over the
# whole coefficient buffer: a small hostile file with thousands takes seconds;
# real encoders write about ten), held on the simplejpeg path too, so that a
# file is accepted or refused whatever the transforms and the decoder.
MAX_SCANS = 500


def _check_scans(data: bytes | memoryview, frame: _JpegFrame) -> None:
    """Refuse a progressive JPEG of more than :data:`MAX_SCANS` scans.

    A progressive frame's scans are counted as the ``FF DA`` pairs from its
    first scan on: inside entropy-coded data an ``FF`` byte is always followed
    by ``00`` or a restart marker, so every such pair is a scan."""
    if frame.progressive and (data if type(data) is bytes else bytes(data)).count(
            b"\xff\xda", frame.scan_at) > MAX_SCANS:
        raise DecodeError(f"corrupt JPEG: more than {MAX_SCANS} scans (a real encoder writes "
                          f"about ten)")


def buffer_of(img: np.ndarray | None) -> np.ndarray | None:
    """The pool buffer behind an image from :func:`decode_image`, if it has one."""
    base = getattr(img, "base", None)
    return base if isinstance(base, np.ndarray) and base.ndim == 1 else None


# -- masks ---------------------------------------------------------------------------
#
# A mask's pixel values are class ids, so it is decoded without any colour
# conversion. libpng (inside OpenCV) expands palette PNGs to their colours and
# scales 1/2/4-bit gray to 0-255; to get the stored values instead, the PNG is
# rewritten as a palette PNG whose entry i is the colour (i, i, i) before
# decoding, so the colour of every pixel is its stored value. Only the small
# PLTE/IHDR chunks change; the pixel data is decoded by libpng as usual.

_PNG_GRAY, _PNG_PALETTE = 0, 3
_PNG_COLOR_NAMES = {0: "gray", 2: "RGB", 3: "palette", 4: "gray + alpha", 6: "RGBA"}


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return (len(payload).to_bytes(4, "big") + kind + payload
            + zlib.crc32(kind + payload).to_bytes(4, "big"))


def _identity_palette_png(data: bytes | memoryview, depth: int, color: int) -> bytes:
    """The PNG with an identity palette (entry i = (i, i, i)) and no transparency; a
    gray PNG of 1, 2, 4 or 8 bits is made a palette PNG of the same depth (the
    pixel data of both is one index a pixel)."""
    raw = bytes(data)
    out = [raw[:8]]
    pos = 8
    entries = 1 << depth
    while pos + 8 <= len(raw):
        length = int.from_bytes(raw[pos:pos + 4], "big")
        kind = raw[pos + 4:pos + 8]
        end = pos + 12 + length
        if kind == b"IHDR":
            ihdr = bytearray(raw[pos + 8:pos + 8 + length])
            ihdr[9] = _PNG_PALETTE
            out.append(_png_chunk(b"IHDR", bytes(ihdr)))
            if color == _PNG_GRAY:
                out.append(_png_chunk(b"PLTE", bytes(np.repeat(np.arange(entries, dtype=np.uint8), 3))))
        elif kind == b"PLTE":
            # Every index the depth allows: libpng would turn an index past the
            # file's own palette into 0, hiding a value the mask holds.
            out.append(_png_chunk(b"PLTE", bytes(np.repeat(np.arange(entries, dtype=np.uint8), 3))))
        elif kind in (b"tRNS", b"bKGD", b"sBIT", b"hIST"):
            pass  # refer to palette entries or gray values: meaningless once rewritten
        else:
            out.append(raw[pos:end])
        if kind == b"IEND":
            break
        pos = end
    return b"".join(out)


def decode_mask(data: bytes | memoryview, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode a mask PNG to its stored values: a 2-D uint8 array (8-bit or lower
    gray, palette indices) or uint16 (16-bit gray).

    Raises:
        DecodeError: not a PNG, not single-channel (RGB, gray + alpha...),
            corrupt, or larger than ``max_pixels``.
    """
    if len(data) == 0:
        raise DecodeError("empty file (0 bytes)")
    head = bytes(data[:32])
    if not head.startswith(_PNG_MAGIC):
        try:
            name = "JPEG" if head.startswith(_JPEG_MAGIC) else _read_header(data).format
        except DecodeError:
            name = "not an image format feeder reads"
        raise DecodeError(f"a mask must be a PNG (lossless, single-channel); this one is {name}")
    header = _read_header(data)
    _check_pixels(header.height, header.width, max_pixels)
    _check_png_chunks(data)
    depth, color = head[24], head[25]
    if color not in (_PNG_GRAY, _PNG_PALETTE):
        raise DecodeError(f"a mask must be a single-channel PNG (gray or palette); this one is "
                          f"{_PNG_COLOR_NAMES.get(color, f'color type {color}')}")
    if color == _PNG_PALETTE or depth < 8:
        data = _identity_palette_png(data, depth, color)
    mask = _cv2_decode(data, cv2.IMREAD_UNCHANGED)
    if mask.ndim == 3:
        mask = np.ascontiguousarray(mask[:, :, 0])  # the identity palette's three equal channels
    if mask.shape != (header.height, header.width) or mask.dtype not in (np.uint8, np.uint16):
        raise DecodeError(f"the mask decoded to {mask.shape} {mask.dtype}, not its header's "
                          f"({header.height}, {header.width}) (height, width)")
    return mask


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


def header_size(data: bytes | memoryview, exif_orientation: bool = False) -> tuple[int, int]:
    """The (height, width) an image decodes to, from its header alone (no pixel is
    decoded or allocated); transposed by its EXIF orientation when that is applied.

    Raises:
        DecodeError: a format that cannot be decoded, or a header that cannot be read.
    """
    if bytes(data[:2]) == b"\xff\xd8":
        frame = _jpeg_frame(data)  # refuses what decode_image refuses, by the same words
        if frame is not None and frame.lossless:
            h, w = frame.height, frame.width  # the system's libjpeg-turbo may not read it
        elif _jpeg is not None:
            w, h = _jpeg.header(data)[:2]
        else:
            try:
                h, w = simplejpeg.decode_jpeg_header(data)[:2]
            except ValueError as exc:
                raise DecodeError(f"corrupt JPEG header: {exc}") from exc
        header = None
    else:
        header = _read_header(data)
        h, w = header.height, header.width
    if exif_orientation and orientation_of(header, data) >= 5:
        return int(w), int(h)
    return int(h), int(w)
