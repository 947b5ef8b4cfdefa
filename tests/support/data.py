"""Test data: encoded images of the generated photographs, shards packed by
``feeder-pack``."""

from __future__ import annotations

import hashlib

import cv2
import numpy as np
import simplejpeg

SIZES = [(64, 80), (96, 72), (120, 150), (50, 50), (130, 90)]


def encode_jpeg(img: np.ndarray, quality: int = 90) -> bytes:
    return simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=quality, colorspace="RGB")


def encode_png(img: np.ndarray) -> bytes:
    """PNG of an RGB, RGBA, gray or 16-bit image (cv2 wants BGR order)."""
    if img.ndim == 3 and img.shape[2] == 3:
        img = img[..., ::-1]
    elif img.ndim == 3 and img.shape[2] == 4:
        img = img[..., [2, 1, 0, 3]]
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(img))
    assert ok
    return buf.tobytes()


def content_hash(img) -> str:
    return hashlib.sha1(np.ascontiguousarray(img).tobytes()).hexdigest()


def pack_numbered(root, blobs, shard_size: str) -> tuple[str, int]:
    """``blobs`` (label = sample number) packed by ``feeder-pack`` into shards of
    about ``shard_size`` under ``root/out``: ``(that folder, number of shards)``."""
    from feeder.pack import pack, parse_size

    lines = []
    for i, blob in enumerate(blobs):
        (root / f"{i}.jpg").write_bytes(blob)
        lines.append(f"{i}.jpg {i}")
    (root / "list.txt").write_text("\n".join(lines))
    res = pack(str(root / "list.txt"), str(root / "out"), shard_size=parse_size(shard_size))
    return str(root / "out"), len(res.shards)
