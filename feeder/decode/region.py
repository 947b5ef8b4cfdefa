"""The shown image and the stored one: EXIF orientation (read from every format
that carries it, applied to pixels and to boxes), and the region decode, which
decodes from a stored JPEG only the part of the shown image the first transform
reads (see :func:`decode_region`).

Decoders disagree on orientation: libjpeg-turbo ignores it, OpenCV applies it in
imdecode unless told not to, and its TIFF reader applies the TIFF tag whatever
the flags. Feeder always decodes the stored pixels and, when asked, applies
the tag itself, the same way for every format.
"""

from __future__ import annotations

import struct
from typing import Any

import cv2
import numpy as np

from ..sample import SampleContext, dct_denom

# The decoder's header and buffer pool types (``headers.Header``,
# ``image.DecodeBuffers``) are named by what they are in the signatures below,
# not imported: both modules import this one.
Header = Any
DecodeBuffers = Any

__all__ = ["decode_region", "orient", "orient_box", "orientation_of", "stored_tiff"]

TIFF_MAX_ENTRIES = 4096  # real IFDs hold tens of entries; more is a corrupt or hostile file


def _tiff_orientation(tiff: bytes) -> int:
    """The Orientation (1-8) in the first IFD of an EXIF TIFF structure; 1 when absent
    or unreadable (broken metadata never fails an image whose pixels are fine)."""
    try:
        order = {b"II": "<", b"MM": ">"}[tiff[:2]]
        magic, ifd = struct.unpack(order + "HI", tiff[2:8])
        if magic != 42:
            return 1
        (count,) = struct.unpack(order + "H", tiff[ifd:ifd + 2])
        for k in range(min(count, TIFF_MAX_ENTRIES)):
            at = ifd + 2 + 12 * k
            tag, kind, _, value = struct.unpack(order + "HHIH", tiff[at:at + 10])
            if tag == 274:
                return value if kind == 3 and 1 <= value <= 8 else 1
    except (KeyError, struct.error):
        pass
    return 1


def _jpeg_exif(data: bytes | memoryview) -> bytes:
    """The TIFF structure of a JPEG's APP1 Exif segment (b"" when none)."""
    pos, n = 2, len(data)
    while pos + 4 <= n and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xDA, 0xD9):  # start of scan, end of image: no more metadata
            break
        length = (data[pos + 2] << 8) | data[pos + 3]
        if marker == 0xE1 and bytes(data[pos + 4:pos + 10]) == b"Exif\x00\x00":
            return bytes(data[pos + 10:pos + 2 + length])
        pos += 2 + length
    return b""


def _png_exif(data: bytes | memoryview) -> bytes:
    pos, n = 8, len(data)
    while pos + 8 <= n:
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = bytes(data[pos + 4:pos + 8])
        if kind == b"eXIf":
            return bytes(data[pos + 8:pos + 8 + length])
        if kind == b"IEND":
            break
        pos += 12 + length
    return b""


def _webp_exif(data: bytes | memoryview) -> bytes:
    pos, n = 12, len(data)
    while pos + 8 <= n:
        length = int.from_bytes(data[pos + 4:pos + 8], "little")
        if bytes(data[pos:pos + 4]) == b"EXIF":
            exif = bytes(data[pos + 8:pos + 8 + length])
            return exif[6:] if exif.startswith(b"Exif\x00\x00") else exif
        pos += 8 + length + (length & 1)
    return b""


def orientation_of(header: Header | None, data: bytes | memoryview) -> int:
    """The EXIF orientation of an image (``header`` None: a JPEG); 1 for formats without one."""
    if header is None:
        return _tiff_orientation(_jpeg_exif(data))
    if header.format == "PNG":
        return _tiff_orientation(_png_exif(data))
    if header.format == "WebP":
        return _tiff_orientation(_webp_exif(data))
    if header.format == "TIFF" and header.tiff_orientation_at is not None:
        at = header.tiff_orientation_at
        value = struct.unpack(header.tiff_order + "H", bytes(data[at:at + 2]))[0]
        return value if 1 <= value <= 8 else 1
    return 1


def stored_tiff(data: bytes | memoryview, header: Header) -> bytes | memoryview:
    """The TIFF with its Orientation set to 1 (top-left), so that OpenCV, which applies
    the tag whatever the flags, returns the pixels as stored."""
    at = header.tiff_orientation_at
    if at is None or struct.unpack(header.tiff_order + "H", bytes(data[at:at + 2]))[0] == 1:
        return data
    patched = bytearray(data)
    patched[at:at + 2] = struct.pack(header.tiff_order + "H", 1)
    return patched


def orient(img: np.ndarray, orientation: int) -> np.ndarray:
    """Turn stored pixels into the displayed image of EXIF ``orientation`` (1-8)."""
    if orientation == 2:
        return cv2.flip(img, 1)
    if orientation == 3:
        return cv2.rotate(img, cv2.ROTATE_180)
    if orientation == 4:
        return cv2.flip(img, 0)
    if orientation == 5:
        return cv2.transpose(img)
    if orientation == 6:
        return cv2.rotate(img, cv2.ROTATE_90_CLOCKWISE)
    if orientation == 7:
        return cv2.flip(cv2.transpose(img), -1)
    if orientation == 8:
        return cv2.rotate(img, cv2.ROTATE_90_COUNTERCLOCKWISE)
    return img


# Orientation o shows the stored image flipped (rows, columns), then transposed
# (5-8): (flip rows, flip columns, transpose). _INVERSE[o] maps the shown frame
# back to the stored one (the others are their own inverse).
_FLIPS = {2: (False, True, False), 3: (True, True, False), 4: (True, False, False),
          5: (False, False, True), 6: (True, False, True), 7: (True, True, True),
          8: (False, True, True)}
_INVERSE = {6: 8, 8: 6}


def orient_box(box: tuple[int, int, int, int], size: tuple[int, int],
               orientation: int) -> tuple[int, int, int, int]:
    """Where ``box`` (top, left, height, width) of an image of ``size`` lands in
    ``orient(image, orientation)``."""
    flips = _FLIPS.get(orientation)
    if flips is None:
        return box
    t, l, bh, bw = box
    flip_rows, flip_cols, transpose = flips
    if flip_rows:
        t = size[0] - t - bh
    if flip_cols:
        l = size[1] - l - bw
    return (l, t, bw, bh) if transpose else (t, l, bh, bw)


def decode_region(ext: Any, data: bytes | memoryview, h: int, w: int, need: tuple[int, int] | None,
                  ctx: SampleContext, orientation: int, max_pixels: int,
                  buffers: DecodeBuffers | None, verify: bool = True, whole: bool = False,
                  index: bytes | None = None, record: int = 0,
                  fuse: tuple[Any, int, np.ndarray] | None = None) -> tuple[np.ndarray | None, bytes | None]:
    """Decode with ``ext`` (the extension ``feeder.decode._jpeg``) the part of a stored
    ``h`` x ``w`` JPEG that ``ctx.box`` (in the shown image's pixels) names, at the
    largest DCT reduction that still covers ``need``; fills in ``ctx.origin``,
    ``ctx.scaled_size`` and ``ctx.scale``. ``verify``: entropy-decode the rows
    below the region too, so that damage anywhere in the file is an error (as
    in a full decode), not wrong pixels; False stops after the region's last row.
    ``whole``: decode all of the image (at that reduction) as the region, with
    no row skipped and no column cropped (see ``USUAL_SAMPLINGS`` in ``jpeg``).
    ``index``: the row index recorded for these bytes (the decode starts at the
    checkpoint before the region's first column in each of its rows instead of
    the first row); ``record``: record one of at most this many checkpoints
    (0: none; see ``VerifiedJpegs.points``). ``fuse``: (``FusedCrop``, the
    sample's key, its batch slot): where the fused steps apply, the extension
    resizes the crop into the slot in the same call, and the image returned is
    None. Returns the image and the index recorded, or None."""
    swap = orientation >= 5
    d = dct_denom(h, w, None if need is None else ((need[1], need[0]) if swap else need))
    hs, ws = -(-h // d), -(-w // d)
    shown = (ws, hs) if swap else (hs, ws)
    if whole:
        y0, x0, y1, x1 = 0, 0, hs, ws
    else:
        t, l, bh, bw = (ctx.box if orientation == 1  # type: ignore[misc]
                        else orient_box(ctx.box, (w, h) if swap else (h, w),  # type: ignore[arg-type]
                                        _INVERSE.get(orientation, orientation)))
        # To the scaled image's pixels, one pixel wider each side when scaled: the
        # transforms map their box with the ratio of the scaled to the full size
        # (as for a whole scaled decode), which can round a pixel beyond t / d.
        m = 0 if d == 1 else 2
        y0, x0 = max(0, t // d - m), max(0, l // d - m)
        y1, x1 = min(hs, -(-(t + bh) // d) + m), min(ws, -(-(l + bw) // d) + m)
    rh, rw = y1 - y0, x1 - x0
    into = None
    if fuse is not None and orientation == 1 and not whole:
        # The context the chain would get, before the decode: the fused steps
        # draw from it what the chain would.
        ctx.origin, ctx.scaled_size, ctx.scale = (y0, x0), shown, 1.0 / d
        into = fuse[0].spec(ctx, (rh, rw), fuse[1])
    # libjpeg writes rows of the region widened to the iMCU grid (at most 32
    # pixels) and by ext.PAD each side.
    nbytes = rh * (rw + 2 * ext.PAD + 32) * 3
    buf = np.empty(nbytes, np.uint8) if buffers is None else buffers.take(nbytes)
    try:
        made = None
        if into is not None:
            (box, flip, area), slot = into, fuse[2]  # type: ignore[index]
            made = ext.decode(data, y0, x0, rh, rw, d, buf, max_pixels, False, verify, index=index,
                              record=record > 0, max_points=record or 16, into=slot, crop=box,
                              flip=flip, area=area)[2]
        elif index is None and not record:
            stride, offset = ext.decode(data, y0, x0, rh, rw, d, buf, max_pixels, False, verify)
        else:
            stride, offset, made, _ = ext.decode(data, y0, x0, rh, rw, d, buf, max_pixels, False,
                                                 verify, index=index, record=record > 0, max_points=record)
    except BaseException:
        if buffers is not None:
            buffers.give(buf)
        raise
    if into is not None:
        if buffers is not None:
            buffers.give(buf)
        return None, made
    img = buf[:rh * stride * 3].reshape(rh, stride, 3)[:, offset:offset + rw]
    top, left = (y0, x0) if orientation == 1 else orient_box((y0, x0, rh, rw), (hs, ws), orientation)[:2]
    ctx.origin, ctx.scaled_size, ctx.scale = (top, left), shown, 1.0 / d
    if orientation != 1:
        img = orient(img, orientation)  # a new array: the pool buffer is free again
        if buffers is not None:
            buffers.give(buf)
    return img, made
