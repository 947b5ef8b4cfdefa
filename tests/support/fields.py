"""Sources and images for the field tests: samples whose ground truth survives any
transform, and an independent PNG writer (palette and low-bit PNGs, which
OpenCV cannot write)."""

from __future__ import annotations

import struct
import zlib

import cv2
import numpy as np

CELL = 8  # the mask's class changes every CELL source pixels


def png(values: np.ndarray, depth: int = 8, palette: list[tuple[int, int, int]] | None = None,
        gray_trns: int | None = None) -> bytes:
    """A PNG of a 2-D array of stored values: gray (color type 0) or, with
    ``palette``, palette indices (color type 3), at ``depth`` bits (1, 2, 4, 8, 16).
    Written here, with plain zlib, so the tests do not trust feeder's reading of
    what OpenCV writes."""
    h, w = values.shape
    color = 3 if palette is not None else 0
    if depth == 16:
        rows = values.astype(">u2").tobytes()
        stride = w * 2
        raw = b"".join(b"\x00" + rows[r * stride:(r + 1) * stride] for r in range(h))
    else:
        per_byte = 8 // depth
        raw_rows = []
        for r in range(h):
            row = bytearray()
            for c0 in range(0, w, per_byte):
                byte = 0
                for k in range(per_byte):
                    v = int(values[r, c0 + k]) if c0 + k < w else 0
                    byte |= v << (8 - depth * (k + 1))
                row.append(byte)
            raw_rows.append(b"\x00" + bytes(row))
        raw = b"".join(raw_rows)

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    out = [b"\x89PNG\r\n\x1a\n", chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, color, 0, 0, 0))]
    if palette is not None:
        out.append(chunk(b"PLTE", b"".join(bytes(c) for c in palette)))
        out.append(chunk(b"tRNS", bytes([255] * (len(palette) - 1) + [0])))
    if gray_trns is not None:
        out.append(chunk(b"tRNS", struct.pack(">H", gray_trns)))
    out.append(chunk(b"IDAT", zlib.compress(raw)))
    out.append(chunk(b"IEND", b""))
    return b"".join(out)


def rgb_png(img: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(img[..., ::-1]))
    assert ok
    return buf.tobytes()


def coordinate_image(h: int, w: int, step: int = 1) -> np.ndarray:
    """R = x / step, G = y / step (pixel centres), B = 128: any pixel of a transformed
    copy tells where in the source it came from."""
    y, x = np.mgrid[0:h, 0:w]
    img = np.empty((h, w, 3), np.uint8)
    img[..., 0] = np.clip(np.round(x / step), 0, 255)
    img[..., 1] = np.clip(np.round(y / step), 0, 255)
    img[..., 2] = 128
    return img


def cell_mask(h: int, w: int, cell: int = CELL) -> np.ndarray:
    """Class id of source pixel (y, x): its cell in a grid of ``cell``-pixel cells."""
    y, x = np.mgrid[0:h, 0:w]
    return ((x // cell) % 16 + 16 * ((y // cell) % 16)).astype(np.uint8)


def check_mask_follows_image(image: np.ndarray, mask: np.ndarray, step: int = 1, cell: int = CELL,
                             margin: float = 1.5, padded: np.ndarray | None = None) -> int:
    """Assert that each output pixel's mask value is the class of the source pixel
    its image value says it came from, wherever that is not within ``margin``
    source pixels of a cell boundary (interpolation blurs the image there).
    ``image`` is [3, H, W] or [H, W, 3]. Returns how many pixels were checked."""
    img = np.asarray(image)
    if img.shape[0] == 3 and img.shape[-1] != 3:
        img = img.transpose(1, 2, 0)
    x = img[..., 0].astype(np.float64) * step
    y = img[..., 1].astype(np.float64) * step
    m = np.asarray(mask).astype(np.int64)
    inside = img[..., 2] >= 64  # padding is black: B = 0 there
    fx, fy = x % cell, y % cell
    clear = ((fx > margin) & (fx < cell - 1 - margin) & (fy > margin) & (fy < cell - 1 - margin)) & inside
    expected = (x // cell) % 16 + 16 * ((y // cell) % 16)
    bad = clear & (m != expected)
    assert not bad.any(), (f"{int(bad.sum())} of {int(clear.sum())} pixels disagree; first at "
                           f"{np.argwhere(bad)[0].tolist()}: mask {m[bad][0]}, image says {expected[bad][0]}")
    if padded is not None or (~inside).any():
        assert (m[~inside] == 0).all(), "the mask's padding is not 0"
    return int(clear.sum())


def rectangles_image(h: int, w: int, boxes: np.ndarray, colors: list[tuple[int, int, int]]) -> np.ndarray:
    """Black image with box i filled with colors[i] (later boxes on top)."""
    img = np.zeros((h, w, 3), np.uint8)
    for (x0, y0, x1, y1), color in zip(boxes.astype(int), colors):
        img[y0:y1, x0:x1] = color
    return img


class DictSource:
    """Samples made by ``make(i) -> dict`` (fresh each read)."""

    def __init__(self, n: int, make, names: list[str] | None = None) -> None:
        self.n = n
        self.make = make
        self.names = names

    def __len__(self) -> int:
        return self.n

    def read(self, index: int):
        return self.make(index)

    def describe(self, index: int) -> str:
        return self.names[index] if self.names else f"dict://{index}"
