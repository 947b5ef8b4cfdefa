"""Decoding a mask PNG to its stored values (:func:`decode_mask`): class ids,
never colours."""

from __future__ import annotations

import zlib

import cv2
import numpy as np

from ..errors import DecodeError
from ..sample import DEFAULT_MAX_PIXELS
from .headers import JPEG_MAGIC, PNG_MAGIC, check_png_chunks, check_pixels, read_header
from .image import cv2_decode

__all__ = ["decode_mask"]

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
    if not head.startswith(PNG_MAGIC):
        try:
            name = "JPEG" if head.startswith(JPEG_MAGIC) else read_header(data).format
        except DecodeError:
            name = "not an image format feeder reads"
        raise DecodeError(f"a mask must be a PNG (lossless, single-channel); this one is {name}")
    header = read_header(data)
    check_pixels(header.height, header.width, max_pixels)
    check_png_chunks(data)
    depth, color = head[24], head[25]
    if color not in (_PNG_GRAY, _PNG_PALETTE):
        raise DecodeError(f"a mask must be a single-channel PNG (gray or palette); this one is "
                          f"{_PNG_COLOR_NAMES.get(color, f'color type {color}')}")
    if color == _PNG_PALETTE or depth < 8:
        data = _identity_palette_png(data, depth, color)
    mask = cv2_decode(data, cv2.IMREAD_UNCHANGED)
    if mask.ndim == 3:
        mask = np.ascontiguousarray(mask[:, :, 0])  # the identity palette's three equal channels
    if mask.shape != (header.height, header.width) or mask.dtype not in (np.uint8, np.uint16):
        raise DecodeError(f"the mask decoded to {mask.shape} {mask.dtype}, not its header's "
                          f"({header.height}, {header.width}) (height, width)")
    return mask
