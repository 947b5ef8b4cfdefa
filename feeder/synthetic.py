"""Synthetic, photograph-like image datasets for examples, tests and benchmarks.

Flat colours and pure noise both decode at unrealistic speeds (JPEG codes
flat blocks in a few bits and noise in all of them), so the images here mix
smooth illumination, overlapping shapes with soft edges, and fine texture,
which lands in the size and decode cost of real photographs. Everything is
deterministic from the seed.

Segmentation and detection sets (:func:`make_segmentation_set`,
:func:`make_detection_set`) put objects of a few classes on a gray
photograph-like background: each class has its own colour, so the masks and
boxes follow the image content and a small model can learn them in seconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import cv2
import numpy as np
import simplejpeg

__all__ = ["CLASS_COLORS", "make_detection_sample", "make_detection_set", "make_guide_data", "make_image",
           "make_image_folder", "make_segmentation_sample", "make_segmentation_set"]

#: The colour of each object class (class 0 is the background), RGB.
CLASS_COLORS = ((0, 0, 0), (220, 40, 40), (40, 190, 60), (50, 80, 230), (230, 200, 40),
                (200, 60, 210), (40, 200, 210), (240, 130, 30))


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
        classes: Number of class folders.
        per_class: Images per class.
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


def _background(height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """A desaturated photograph-like background (float32 RGB), so class colours stand out."""
    img = make_image(height, width, seed=int(rng.integers(0, 2**31))).astype(np.float32)
    gray = img.mean(axis=2, keepdims=True)
    return gray * 0.8 + img * 0.2


def _paint(img: np.ndarray, region: np.ndarray, cls: int, rng: np.random.Generator) -> None:
    """Fill ``region`` (bool [H, W]) with class ``cls``'s colour, lit and textured."""
    color = np.array(CLASS_COLORS[cls], np.float32)
    light = rng.uniform(0.8, 1.1)
    noise = rng.normal(0.0, 10.0, (int(region.sum()), 3)).astype(np.float32)
    img[region] = color * light + noise


def make_segmentation_sample(height: int, width: int, seed: int, classes: int = 4,
                             objects: tuple[int, int] = (2, 6)) -> tuple[np.ndarray, np.ndarray]:
    """An image and its mask: ellipses, rectangles and polygons of ``classes - 1``
    object classes on a background (class 0), each class in its own colour.

    Returns:
        uint8 ``[height, width, 3]`` RGB, and uint8 ``[height, width]`` class ids
        (later objects cover earlier ones, in the image and the mask alike).
    """
    if not 2 <= classes <= len(CLASS_COLORS):
        raise ValueError(f"classes must be in [2, {len(CLASS_COLORS)}], got {classes}")
    rng = np.random.default_rng(seed)
    img = _background(height, width, rng)
    mask = np.zeros((height, width), np.uint8)
    for _ in range(int(rng.integers(objects[0], objects[1] + 1))):
        cls = int(rng.integers(1, classes))
        shape = np.zeros((height, width), np.uint8)
        cx, cy = int(rng.integers(0, width)), int(rng.integers(0, height))
        r = int(rng.integers(max(3, min(height, width) // 10), max(4, min(height, width) // 3)))
        kind = rng.integers(0, 3)
        if kind == 0:
            cv2.ellipse(shape, (cx, cy), (r, int(rng.integers(max(2, r // 3), r + 1))),
                        float(rng.uniform(0, 180)), 0, 360, 1, -1)
        elif kind == 1:
            cv2.rectangle(shape, (cx - r, cy - r // 2), (cx + r, cy + r // 2), 1, -1)
        else:
            pts = (rng.normal(0, r, (6, 2)) + (cx, cy)).astype(np.int32)
            cv2.fillPoly(shape, [cv2.convexHull(pts)], 1)
        region = shape.astype(bool)
        _paint(img, region, cls, rng)
        mask[region] = cls
    return np.clip(img, 0, 255).astype(np.uint8), mask


def make_detection_sample(height: int, width: int, seed: int, classes: int = 3,
                          objects: tuple[int, int] = (1, 5)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An image with textured rectangles of ``classes`` object classes, and their boxes.

    Rectangles do not overlap (so every box is fully visible).

    Returns:
        uint8 ``[height, width, 3]`` RGB; float32 ``[N, 4]`` boxes ``(x0, y0, x1, y1)`` in
        pixels (pixel edges: a box ``[x0, x1)`` covers columns ``x0 .. x1 - 1``); int64
        ``[N]`` labels in ``[0, classes)``.
    """
    if not 1 <= classes < len(CLASS_COLORS):
        raise ValueError(f"classes must be in [1, {len(CLASS_COLORS) - 1}], got {classes}")
    rng = np.random.default_rng(seed)
    img = _background(height, width, rng)
    taken = np.zeros((height, width), bool)
    boxes, labels = [], []
    want = int(rng.integers(objects[0], objects[1] + 1))
    for _ in range(want * 20):
        if len(boxes) == want:
            break
        bw = int(rng.integers(max(4, width // 8), max(5, width // 2)))
        bh = int(rng.integers(max(4, height // 8), max(5, height // 2)))
        x0, y0 = int(rng.integers(0, width - bw + 1)), int(rng.integers(0, height - bh + 1))
        if taken[max(0, y0 - 2):y0 + bh + 2, max(0, x0 - 2):x0 + bw + 2].any():
            continue
        taken[y0:y0 + bh, x0:x0 + bw] = True
        cls = int(rng.integers(0, classes))
        region = np.zeros((height, width), bool)
        region[y0:y0 + bh, x0:x0 + bw] = True
        _paint(img, region, cls + 1, rng)
        boxes.append((x0, y0, x0 + bw, y0 + bh))
        labels.append(cls)
    return (np.clip(img, 0, 255).astype(np.uint8), np.array(boxes, np.float32).reshape(-1, 4),
            np.array(labels, np.int64))


def _sizes(rng: np.random.Generator, size_range: tuple[int, int]) -> tuple[int, int]:
    h, w = (int(v) for v in rng.integers(size_range[0], size_range[1] + 1, 2))
    return h, w


def make_segmentation_set(root: str | os.PathLike, count: int = 200,
                          size_range: tuple[int, int] = (96, 192), classes: int = 4,
                          seed: int = 0, quality: int = 90) -> list[tuple[str, str]]:
    """Write a segmentation set: ``root/images/NNNNN.jpg`` and ``root/masks/NNNNN.png``
    (8-bit gray PNGs of class ids, see :func:`make_segmentation_sample`).

    Returns:
        ``(image_path, mask_path)`` pairs, in order.
    """
    root = os.fspath(root)
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    os.makedirs(os.path.join(root, "masks"), exist_ok=True)
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(count):
        h, w = _sizes(rng, size_range)
        img, mask = make_segmentation_sample(h, w, int(rng.integers(0, 2**31)), classes)
        image_path = os.path.join(root, "images", f"{i:05d}.jpg")
        mask_path = os.path.join(root, "masks", f"{i:05d}.png")
        with open(image_path, "wb") as f:
            f.write(simplejpeg.encode_jpeg(img, quality=quality, colorspace="RGB"))
        ok, png = cv2.imencode(".png", mask)
        if not ok:
            raise RuntimeError(f"could not encode {mask_path}")
        with open(mask_path, "wb") as f:
            f.write(png.tobytes())
        pairs.append((image_path, mask_path))
    return pairs


def make_detection_set(root: str | os.PathLike, count: int = 200,
                       size_range: tuple[int, int] = (96, 192), classes: int = 3,
                       seed: int = 0, quality: int = 90) -> list[dict]:
    """Write a detection set: ``root/images/NNNNN.jpg`` and ``root/annotations.json``,
    a list of ``{"image": path, "boxes": [[x0, y0, x1, y1], ...], "labels": [...]}``
    (see :func:`make_detection_sample`).

    Returns:
        The annotation records, as written.
    """
    root = os.fspath(root)
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        h, w = _sizes(rng, size_range)
        img, boxes, labels = make_detection_sample(h, w, int(rng.integers(0, 2**31)), classes)
        path = os.path.join(root, "images", f"{i:05d}.jpg")
        with open(path, "wb") as f:
            f.write(simplejpeg.encode_jpeg(img, quality=quality, colorspace="RGB"))
        records.append({"image": path, "boxes": boxes.tolist(), "labels": labels.tolist()})
    with open(os.path.join(root, "annotations.json"), "w") as f:
        json.dump(records, f)
    return records


def make_guide_data(base: str | os.PathLike = ".") -> None:
    """The small data the guides' snippets read, under ``base``: ``data/train`` (an
    ImageFolder, 2 classes x 128 images: one batch of 256), ``data/val`` (2 x 27),
    ``data/seg`` (32 image + mask pairs) and ``data/det`` (16 images with
    ``annotations.json``). The shards guide's ``feeder-pack`` command then makes
    ``shards/``. Also ``python -m feeder.synthetic [BASE]``."""
    base = os.fspath(base)
    make_image_folder(os.path.join(base, "data", "train"), classes=2, per_class=128,
                      size_range=(24, 40), seed=5)
    make_image_folder(os.path.join(base, "data", "val"), classes=2, per_class=27,
                      size_range=(24, 40), seed=6)
    make_segmentation_set(os.path.join(base, "data", "seg"), count=32, size_range=(48, 80), seed=7)
    make_detection_set(os.path.join(base, "data", "det"), count=16, size_range=(48, 80), seed=8)


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse  # noqa: PLC0415
    import sys  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m feeder.synthetic",
                                     description="write the small data the guides' snippets read "
                                                 "(data/train, data/val, data/seg, data/det) under BASE")
    parser.add_argument("base", nargs="?", default=".", help="the folder to write data/ in (default: .)")
    args = parser.parse_args(argv)
    try:
        make_guide_data(args.base)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"python -m feeder.synthetic: error: {exc}\n")
        return 2
    print(f"wrote {os.path.join(args.base, 'data')}: train (2 x 128), val (2 x 27), seg (32), det (16)")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
