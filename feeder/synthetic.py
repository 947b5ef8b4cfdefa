"""Synthetic, photograph-like image datasets for examples, tests and benchmarks.

Flat colours and pure noise both decode at unrealistic speeds (JPEG codes
flat blocks in a few bits and noise in all of them), so the images here mix
smooth illumination, overlapping shapes with soft edges, and fine texture,
which lands in the size and decode cost of real photographs. Everything is
deterministic from the seed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import cv2
import numpy as np
import simplejpeg

__all__ = ["make_image", "make_image_folder"]


def make_image(height: int, width: int, seed: int) -> np.ndarray:
    """A photograph-like uint8 [height, width, 3] RGB image, deterministic from ``seed``."""
    rng = np.random.default_rng(seed)
    # Smooth illumination: a few low-frequency waves per channel.
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), np.float32)
    for c in range(3):
        fx, fy, px, py = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 6.3), rng.uniform(0, 6.3)
        img[..., c] = (110 + rng.uniform(-40, 40) + 50 * np.sin(x / width * fx * np.pi + px)
                       + 40 * np.cos(y / height * fy * np.pi + py))
    # Objects: many shapes of all sizes with hard, anti-aliased edges.
    for _ in range(int(rng.integers(25, 60))):
        color = tuple(float(v) for v in rng.uniform(0, 255, 3))
        cx, cy = int(rng.integers(0, width)), int(rng.integers(0, height))
        r = int(rng.integers(3, max(4, min(height, width) // 4)))
        kind = rng.integers(0, 3)
        if kind == 0:
            cv2.ellipse(img, (cx, cy), (r, int(rng.integers(2, r + 2))), float(rng.uniform(0, 180)),
                        0, 360, color, -1, cv2.LINE_AA)
        elif kind == 1:
            pts = (rng.normal(0, r, (5, 2)) + (cx, cy)).astype(np.int32)
            cv2.fillPoly(img, [pts], color, cv2.LINE_AA)
        else:
            cv2.line(img, (cx, cy), (cx + int(rng.normal(0, 3 * r)), cy + int(rng.normal(0, 3 * r))),
                     color, int(rng.integers(1, 6)), cv2.LINE_AA)
    # Texture: fractal (1/f) noise over five octaves, like foliage, fabric, grain.
    texture = np.zeros((height, width), np.float32)
    for octave in range(5):
        f = 2 ** octave
        small = rng.normal(0.0, 1.0, (max(2, height // (32 // f)), max(2, width // (32 // f))))
        texture += cv2.resize(small.astype(np.float32), (width, height),
                              interpolation=cv2.INTER_CUBIC) * (18.0 / (octave + 1))
    img += texture[..., None] * rng.uniform(0.6, 1.2, 3).astype(np.float32)
    img += rng.normal(0.0, 4.0, (height, width, 3)).astype(np.float32)  # sensor noise
    return np.clip(img, 0, 255).astype(np.uint8)


def make_image_folder(root: str | os.PathLike, classes: int = 10, per_class: int = 100,
                      size_range: tuple[int, int] = (300, 600), quality: Sequence[int] = (75, 95),
                      seed: int = 0, large: bool = False) -> list[str]:
    """Write an ImageFolder tree of JPEGs: ``root/class_XX/img_XXXXX.jpg``.

    Args:
        root: Folder to write into (created).
        classes, per_class: Dataset shape.
        size_range: Each side drawn uniformly from this range, in pixels (ImageNet-like).
        quality: JPEG quality range.
        seed: Makes the whole dataset deterministic.
        large: Photos of about 1500x1100 pixels instead (ignores ``size_range``).

    Returns:
        The paths written, in class order.
    """
    rng = np.random.default_rng(seed)
    paths = []
    for c in range(classes):
        folder = os.path.join(os.fspath(root), f"class_{c:02d}")
        os.makedirs(folder, exist_ok=True)
        for i in range(per_class):
            if large:
                h, w = int(rng.integers(1000, 1200)), int(rng.integers(1400, 1600))
            else:
                h, w = (int(v) for v in rng.integers(size_range[0], size_range[1] + 1, 2))
            q = int(rng.integers(quality[0], quality[1] + 1))
            img = make_image(h, w, seed=int(rng.integers(0, 2**31)))
            path = os.path.join(folder, f"img_{i:05d}.jpg")
            with open(path, "wb") as f:
                f.write(simplejpeg.encode_jpeg(img, quality=q, colorspace="RGB"))
            paths.append(path)
    return paths
