"""What an encoded image is, read from its first bytes: its format (one of
:data:`SUPPORTED_FORMATS`, any other refused by name), its size, checked
against ``max_pixels`` before any pixel memory is allocated
(:func:`check_pixels`), and a JPEG's frame (:func:`jpeg_frame`: its coding
process decides how it may be decoded). :func:`header_size` gives the size
an image decodes to without decoding it."""

from __future__ import annotations

import re
import struct
from typing import NamedTuple

import simplejpeg

from ..errors import DecodeError
from . import extension
from .region import TIFF_MAX_ENTRIES, orientation_of

# Formats decoded, each with its size read from the header before any pixel
# memory is allocated. OpenCV can decode more (Radiance HDR, PFM, PAM, Sun
# raster, JPEG 2000, AVIF, OpenEXR, ...), but without a header check a small file
# claiming a huge size would be decoded first and rejected after: those are refused.
SUPPORTED_FORMATS = ("JPEG", "PNG", "BMP", "GIF", "WebP", "PNM (P1-P6)", "TIFF (and BigTIFF)")

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

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

class Header(NamedTuple):
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


def _pnm_header(data: bytes | memoryview) -> Header:
    head = bytes(data[:1024])
    pos, dims = 2, []
    for _ in range(2):
        m = _PNM_TOKEN.match(head, pos)
        if m is None:
            raise _corrupt("PNM", "no width and height in its first 1024 bytes")
        dims.append(int(m.group(1)))
        pos = m.end()
    return Header("PNM", dims[1], dims[0])


# Classic TIFF (magic 42) and BigTIFF (43): IFD entry count format, entry
# size, where an entry's value starts.
_TIFF_LAYOUT = {42: ("H", 12, 8), 43: ("Q", 20, 12)}
_TIFF_SIZE_TYPES = {3: "H", 4: "I", 16: "Q"}  # SHORT, LONG, LONG8 (BigTIFF)


def _tiff_header(data: bytes | memoryview) -> Header:
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
    return Header("TIFF", size[257], size[256], orientation_at, order)


def _webp_header(head: bytes) -> Header:
    if len(head) < 30:
        raise _corrupt("WebP", "truncated")
    chunk = head[12:16]
    if chunk == b"VP8X":
        return Header("WebP", int.from_bytes(head[27:30], "little") + 1,
                       int.from_bytes(head[24:27], "little") + 1)
    if chunk == b"VP8L":
        if head[20] != 0x2F:
            raise _corrupt("WebP", "bad VP8L signature")
        bits = int.from_bytes(head[21:25], "little")
        return Header("WebP", ((bits >> 14) & 0x3FFF) + 1, (bits & 0x3FFF) + 1)
    if chunk == b"VP8 ":
        if head[23:26] != b"\x9d\x01\x2a":
            raise _corrupt("WebP", "bad VP8 start code")
        w, h = struct.unpack("<HH", head[26:30])
        return Header("WebP", h & 0x3FFF, w & 0x3FFF)
    raise _corrupt("WebP", f"unknown first chunk {chunk!r}")


def _bmp_header(head: bytes) -> Header:
    if len(head) < 26:
        raise _corrupt("BMP", "truncated")
    (dib,) = struct.unpack("<I", head[14:18])
    if dib == 12:  # OS/2 BITMAPCOREHEADER: unsigned 16-bit sizes
        w, h = struct.unpack("<HH", head[18:22])
        return Header("BMP", h, w)
    if dib < 16:
        raise _corrupt("BMP", f"DIB header size {dib}")
    w, h = struct.unpack("<ii", head[18:26])
    if w <= 0:
        raise _corrupt("BMP", f"width {w}")
    return Header("BMP", abs(h), w)  # a negative height means rows stored top-down


def read_header(data: bytes | memoryview) -> Header:
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
    if head.startswith(PNG_MAGIC):
        if len(head) < 24 or head[12:16] != b"IHDR":
            raise _corrupt("PNG", "no IHDR chunk first")
        w, h = struct.unpack(">II", head[16:24])
        return Header("PNG", h, w)
    if head[:2] == b"BM":
        return _bmp_header(head)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        if len(head) < 10:
            raise _corrupt("GIF", "truncated")
        w, h = struct.unpack("<HH", head[6:10])
        return Header("GIF", h, w)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_header(head)
    accepted = ", ".join(SUPPORTED_FORMATS)
    for test, name in _REFUSED:
        if test(head):
            raise DecodeError(f"{name} images are not supported (accepted formats: {accepted}); "
                              f"convert it to one of those")
    raise DecodeError(f"not a decodable image: format not recognised from its first bytes "
                      f"{head[:8]!r} (accepted formats: {accepted})")


def check_png_chunks(data: bytes | memoryview) -> None:
    """Reject a PNG with a chunk longer than the rest of the file, before OpenCV reads it.

    OpenCV allocates (and touches) what a chunk's length field claims before it
    finds the data missing: a 147-byte file whose IDAT claims 3.9 GB cost 3.7 GB
    of memory and seconds of CPU. It never decodes such a file anyway.
    """
    n = len(data)
    pos = len(PNG_MAGIC)
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


def check_pixels(h: int, w: int, max_pixels: int) -> None:
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


class JpegFrame(NamedTuple):
    """A JPEG's frame header (its SOF segment), read by :func:`jpeg_frame`."""

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


def _walk(data: bytes | memoryview) -> tuple[int, int, int, int, int, int] | bool | None:
    """:func:`jpeg_frame`'s walk: ``(marker, precision, height, width, components,
    where it stopped)``, None when it found no frame header, False after
    ``_MAX_HEADER_STEPS`` segments and fill bytes (the extension's ``frame``
    takes the same steps)."""
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
        return False
    return None if frame is None else (*frame, pos)


def jpeg_frame(data: bytes | memoryview) -> JpegFrame | None:
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
    ext = extension.jpeg
    if ext is not None and (type(data) is bytes or (type(data) is memoryview and data.format == "B"
                                                    and data.c_contiguous)):
        walked = ext.frame(data, _MAX_HEADER_STEPS)  # _walk, in C
    else:
        walked = _walk(data)
    if walked is False:
        raise DecodeError(f"corrupt JPEG header: more than {_MAX_HEADER_STEPS} marker segments "
                          f"and fill bytes before the first scan")
    if walked is None:
        return None
    found = tuple.__new__(JpegFrame, walked)  # JpegFrame(*walked), without its Python __new__
    if found.marker in _HIERARCHICAL_SOF:
        raise DecodeError(f"hierarchical JPEG ({found.process}) is not supported: libjpeg-turbo "
                          f"decodes no differential frames; re-encode it as a baseline or "
                          f"progressive JPEG")
    if found.precision != 8:
        raise DecodeError(f"JPEG of {found.precision}-bit samples ({found.process}) is not "
                          f"supported: feeder decodes 8-bit JPEGs (libjpeg-turbo's 8-bit "
                          f"interface); convert it to 8 bits, or to a 16-bit PNG or TIFF")
    return found


def header_size(data: bytes | memoryview, exif_orientation: bool = False) -> tuple[int, int]:
    """The (height, width) an image decodes to, from its header alone (no pixel is
    decoded or allocated); transposed by its EXIF orientation when that is applied.

    Raises:
        DecodeError: a format that cannot be decoded, or a header that cannot be read.
    """
    if bytes(data[:2]) == b"\xff\xd8":
        frame = jpeg_frame(data)  # refuses what decode_image refuses, by the same words
        if frame is not None and frame.lossless:
            h, w = frame.height, frame.width  # the system's libjpeg-turbo may not read it
        elif extension.jpeg is not None:
            w, h = extension.jpeg.header(data)[:2]
        else:
            try:
                h, w = simplejpeg.decode_jpeg_header(data)[:2]
            except ValueError as exc:
                raise DecodeError(f"corrupt JPEG header: {exc}") from exc
        header = None
    else:
        header = read_header(data)
        h, w = header.height, header.width
    if exif_orientation and orientation_of(header, data) >= 5:
        return int(w), int(h)
    return int(h), int(w)
