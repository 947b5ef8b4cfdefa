"""Automatic augmentation policies on uint8 [H, W, 3] RGB images:
:class:`TrivialAugmentWide` and :class:`RandAugment`, with torchvision's op sets,
magnitude tables and defaults (nearest interpolation, fill 0).

The ops (torchvision's ``_augmentation_space``): Identity, ShearX, ShearY,
TranslateX, TranslateY, Rotate, Brightness, Color (saturation), Contrast,
Sharpness, Posterize, Solarize, AutoContrast, Equalize. The geometric ones
(shears, translations, rotation) move a mask (nearest, new pixels ``mask_fill``)
and boxes (the box around the moved corners, clipped; a box left with no area is
dropped with its per-box fields); the others leave both alone. Every op is one
or two OpenCV calls, which release the GIL.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import cv2
import numpy as np

from ..sample.rng import SampleRNG
from ..sample import BOXES, INSTANCE_MASKS, KEYPOINTS, MASK
from . import color
from .base import Geometry, Transform, _interp, check_mask_fill, keep_boxes, move_fields
from .crop import _fill3, _mask_fill

_GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")


@functools.lru_cache(maxsize=256)
def _space(kind: str, num_bins: int, height: int, width: int) -> list[tuple[str, np.ndarray | None, bool]]:
    """torchvision's ``_augmentation_space``: (op, magnitudes or None, signed) in its order.
    Cached: built per draw it held the GIL for longer than the op it picks often
    runs (RandAugment's depends on the image size; a training set has few
    distinct sizes at that point)."""
    lin = np.linspace
    if kind == "wide":
        shear, tx, ty, rot, amount, bits = 0.99, 32.0, 32.0, 135.0, 0.99, 6
    else:
        shear, tx, ty, rot, amount, bits = (0.3, 150.0 / 331.0 * width, 150.0 / 331.0 * height,
                                            30.0, 0.9, 4)
    posterize = 8 - np.round(np.arange(num_bins) / ((num_bins - 1) / bits)).astype(np.int64)
    return [
        ("Identity", None, False),
        ("ShearX", lin(0.0, shear, num_bins), True),
        ("ShearY", lin(0.0, shear, num_bins), True),
        ("TranslateX", lin(0.0, tx, num_bins), True),
        ("TranslateY", lin(0.0, ty, num_bins), True),
        ("Rotate", lin(0.0, rot, num_bins), True),
        ("Brightness", lin(0.0, amount, num_bins), True),
        ("Color", lin(0.0, amount, num_bins), True),
        ("Contrast", lin(0.0, amount, num_bins), True),
        ("Sharpness", lin(0.0, amount, num_bins), True),
        ("Posterize", posterize, False),
        ("Solarize", lin(255.0, 0.0, num_bins), False),
        ("AutoContrast", None, False),
        ("Equalize", None, False),
    ]


def affine(name: str, magnitude: float, height: int, width: int) -> np.ndarray:
    """The forward 2x3 map of a geometric op, in pixel-edge coordinates (pixel i spans
    [i, i + 1)), as torchvision's ``affine``/``rotate`` define it: shears about the
    top-left corner (``x' = x - m * y``), translations by ``int(m)`` pixels, rotation
    by ``m`` degrees counter-clockwise about the image centre."""
    if name == "ShearX":
        return np.array([[1.0, -magnitude, 0.0], [0.0, 1.0, 0.0]])
    if name == "ShearY":
        return np.array([[1.0, 0.0, 0.0], [-magnitude, 1.0, 0.0]])
    if name == "TranslateX":
        return np.array([[1.0, 0.0, float(int(magnitude))], [0.0, 1.0, 0.0]])
    if name == "TranslateY":
        return np.array([[1.0, 0.0, 0.0], [0.0, 1.0, float(int(magnitude))]])
    if name == "Rotate":
        t = math.radians(magnitude)
        a = np.array([[math.cos(t), math.sin(t)], [-math.sin(t), math.cos(t)]])
        p = np.array([width / 2.0, height / 2.0])
        return np.hstack([a, (p - a @ p)[:, None]])
    raise ValueError(f"{name} is not a geometric op")


def _to_cv2(m: np.ndarray) -> np.ndarray:
    # OpenCV puts pixel centres at integer coordinates: e = c + 0.5.
    a, t = m[:, :2], m[:, 2]
    return np.hstack([a, (a @ np.array([0.5, 0.5]) + t - 0.5)[:, None]])


def warp(img: np.ndarray, m: np.ndarray, interpolation: int, fill: Any) -> np.ndarray:
    """``img`` moved by the edge-coordinate map ``m``, same size, new pixels ``fill``."""
    H, W = img.shape[:2]
    return cv2.warpAffine(img, _to_cv2(m), (W, H), flags=interpolation,
                          borderMode=cv2.BORDER_CONSTANT, borderValue=fill)


def warp_boxes(boxes: np.ndarray, m: np.ndarray, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (x0, y0, x1, y1) moved by ``m``: the box around the moved corners,
    clipped to the image; returns them and the keep mask (area left)."""
    b = boxes.astype(np.float64)
    xs = b[:, [0, 2, 0, 2]]
    ys = b[:, [1, 1, 3, 3]]
    nx = m[0, 0] * xs + m[0, 1] * ys + m[0, 2]
    ny = m[1, 0] * xs + m[1, 1] * ys + m[1, 2]
    out = np.stack([np.clip(nx.min(1), 0, width), np.clip(ny.min(1), 0, height),
                    np.clip(nx.max(1), 0, width), np.clip(ny.max(1), 0, height)], 1).astype(np.float32)
    keep = (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])
    return out[keep], keep


def warp_keypoints(points: np.ndarray, m: np.ndarray, height: int, width: int) -> np.ndarray:
    """Keypoints ``[N, K, 3]`` moved by ``m``; one that leaves the image becomes
    ``(0, 0, 0)`` (see ``Geometry.keypoints``)."""
    x, y = points[..., 0].astype(np.float64), points[..., 1].astype(np.float64)
    nx = m[0, 0] * x + m[0, 1] * y + m[0, 2]
    ny = m[1, 0] * x + m[1, 1] * y + m[1, 2]
    inside = (nx >= 0) & (nx <= width) & (ny >= 0) & (ny <= height) & (points[..., 2] != 0)
    return np.stack([np.where(inside, nx, 0), np.where(inside, ny, 0),
                     np.where(inside, points[..., 2], 0)], -1).astype(np.float32)


def apply_op(img: np.ndarray, name: str, magnitude: float, interpolation: int, fill: Any) -> np.ndarray:
    """One op of the policies on ``img`` (torchvision's ``_apply_op``)."""
    if name == "Identity":
        return img
    if name in _GEOMETRIC:
        return warp(img, affine(name, magnitude, *img.shape[:2]), interpolation, fill)
    if name == "Brightness":
        return color.adjust_brightness(img, 1.0 + magnitude)
    if name == "Color":
        return color.adjust_saturation(img, 1.0 + magnitude)
    if name == "Contrast":
        return color.adjust_contrast(img, 1.0 + magnitude)
    if name == "Sharpness":
        return color.adjust_sharpness(img, 1.0 + magnitude)
    if name == "Posterize":
        return color.posterize(img, int(magnitude))
    if name == "Solarize":
        return color.solarize(img, magnitude)
    if name == "AutoContrast":
        return color.autocontrast(img)
    if name == "Equalize":
        return color.equalize(img)
    raise ValueError(f"unknown op {name!r}")


class _Policy(Transform):
    """Shared by the policies: drawing, applying, moving the fields."""

    preserves_size = True
    moves_fields = True

    def __init__(self, num_magnitude_bins: int, interpolation: str, fill: Any, mask_fill: int) -> None:
        name = type(self).__name__
        if (isinstance(num_magnitude_bins, bool) or not isinstance(num_magnitude_bins, int)
                or num_magnitude_bins < 2):
            raise ValueError(f"{name}: num_magnitude_bins must be an int >= 2, got {num_magnitude_bins!r}")
        if interpolation not in ("nearest", "bilinear"):
            raise ValueError(f"{name}: interpolation must be 'nearest' or 'bilinear' (torchvision's "
                             f"choices for these policies), got {interpolation!r}")
        self.num_magnitude_bins = num_magnitude_bins
        self.interpolation = interpolation
        self._interp = _interp(interpolation, name)
        self.fill = _fill3(fill, name)
        self.mask_fill = _mask_fill(mask_fill, name)

    def draw(self, rng: SampleRNG, height: int, width: int) -> list[tuple[str, float]]:
        """The (op, signed magnitude) pairs for one sample of this size, in order."""
        raise NotImplementedError

    def apply(self, img, rng, out=None, ctx=None):
        for name, magnitude in self.draw(rng, *img.shape[:2]):
            img = apply_op(img, name, magnitude, self._interp, self.fill)
        if out is not None and out.shape == img.shape and out is not img:
            np.copyto(out, img)
            return out
        return img

    def apply_geometry(self, img, rng, out=None, ctx=None):
        # Only for callers without fields; the chain calls apply_fields on samples
        # with fields. A shear or a rotation has no per-axis Geometry.
        ops = self.draw(rng, *img.shape[:2])
        if any(name in ("ShearX", "ShearY", "Rotate") and mag != 0 for name, mag in ops):
            return self.apply(img, _Replay(ops), out, ctx), None
        H, W = img.shape[:2]
        geometry = Geometry.identity(H, W)
        for name, mag in ops:
            if name in ("TranslateX", "TranslateY"):
                m = affine(name, mag, H, W)
                geometry = geometry.then(Geometry(1.0, m[1, 2], 1.0, m[0, 2], H, W, self.mask_fill))
        return self.apply(img, _Replay(ops), out, ctx), geometry

    def apply_fields(self, img, rng, fields, geometry, out=None, ctx=None):
        if MASK in fields:
            # cv2.warpAffine would saturate the fill to the mask's dtype.
            check_mask_fill(self.mask_fill, fields[MASK], self)
        H, W = img.shape[:2]
        ops = self.draw(rng, H, W)
        for name, mag in ops:
            img = apply_op(img, name, mag, self._interp, self.fill)
            if name not in _GEOMETRIC:
                continue
            m = affine(name, mag, H, W)
            if name in ("TranslateX", "TranslateY"):
                # A shift is a Geometry: the fields follow lazily, with the chain's.
                geometry = geometry.then(Geometry(1.0, m[1, 2], 1.0, m[0, 2], H, W, self.mask_fill))
                continue
            fields = move_fields(fields, geometry)
            geometry = Geometry.identity(H, W)
            if MASK in fields:
                fields = dict(fields)
                fields[MASK] = warp(fields[MASK], m, cv2.INTER_NEAREST, self.mask_fill)
            if BOXES in fields:
                fields = keep_boxes(fields, *warp_boxes(fields[BOXES], m, H, W))
            if INSTANCE_MASKS in fields:
                masks = fields[INSTANCE_MASKS]
                fields[INSTANCE_MASKS] = (np.stack([warp(k, m, cv2.INTER_NEAREST, 0) for k in masks])
                                          if len(masks) else masks)
            if KEYPOINTS in fields:
                fields[KEYPOINTS] = warp_keypoints(fields[KEYPOINTS], m, H, W)
        if out is not None and out.shape == img.shape and out is not img:
            np.copyto(out, img)
            img = out
        return img, fields, geometry


class _Replay:
    """Hands ``draw`` the ops already drawn (so apply_geometry draws once)."""

    def __init__(self, ops: list[tuple[str, float]]) -> None:
        self.ops = ops


class TrivialAugmentWide(_Policy):
    """TrivialAugment (Müller and Hutter, 2021), torchvision's ``TrivialAugmentWide``:
    one op drawn uniformly per sample, at a magnitude drawn uniformly from its
    ``num_magnitude_bins`` bins, negated with probability 1/2 for the signed ops.

    Args:
        num_magnitude_bins: Number of magnitude bins (torchvision: 31).
        interpolation: "nearest" (torchvision's default) or "bilinear".
        fill: Image value of pixels moved in by a geometric op, int or (R, G, B).
        mask_fill: Mask value of those pixels (255: the segmentation ignore index).

    Raises:
        ValueError: bad parameters, with the value.
    """

    def __init__(self, num_magnitude_bins: int = 31, interpolation: str = "nearest", fill: Any = 0,
                 mask_fill: int = 255) -> None:
        super().__init__(num_magnitude_bins, interpolation, fill, mask_fill)

    def draw(self, rng, height, width):
        if isinstance(rng, _Replay):
            return rng.ops
        space = _space("wide", self.num_magnitude_bins, height, width)
        name, magnitudes, signed = space[rng.integers(0, len(space))]
        mag = float(magnitudes[rng.integers(0, len(magnitudes))]) if magnitudes is not None else 0.0
        if signed and rng.integers(0, 2):
            mag = -mag
        return [(name, mag)]

    def __repr__(self) -> str:
        return (f"TrivialAugmentWide(num_magnitude_bins={self.num_magnitude_bins}, "
                f"interpolation={self.interpolation!r}, fill={self.fill}, mask_fill={self.mask_fill})")


class RandAugment(_Policy):
    """RandAugment (Cubuk et al., 2020), torchvision's ``RandAugment``: ``num_ops`` ops
    drawn uniformly (with repetition) per sample, each at the fixed ``magnitude``
    bin, negated with probability 1/2 for the signed ops.

    Args:
        num_ops: Ops applied per sample.
        magnitude: Magnitude bin, in [0, num_magnitude_bins).
        num_magnitude_bins: Number of magnitude bins (torchvision: 31).
        interpolation: "nearest" (torchvision's default) or "bilinear".
        fill: Image value of pixels moved in by a geometric op, int or (R, G, B).
        mask_fill: Mask value of those pixels.

    Raises:
        ValueError: bad parameters, with the value.
    """

    def __init__(self, num_ops: int = 2, magnitude: int = 9, num_magnitude_bins: int = 31,
                 interpolation: str = "nearest", fill: Any = 0, mask_fill: int = 255) -> None:
        super().__init__(num_magnitude_bins, interpolation, fill, mask_fill)
        if isinstance(num_ops, bool) or not isinstance(num_ops, int) or num_ops < 0:
            raise ValueError(f"RandAugment: num_ops must be an int >= 0, got {num_ops!r}")
        if (isinstance(magnitude, bool) or not isinstance(magnitude, int)
                or not 0 <= magnitude < num_magnitude_bins):
            raise ValueError(f"RandAugment: magnitude must be an int in [0, {num_magnitude_bins}), "
                             f"got {magnitude!r}")
        self.num_ops, self.magnitude = num_ops, magnitude

    def draw(self, rng, height, width):
        if isinstance(rng, _Replay):
            return rng.ops
        space = _space("rand", self.num_magnitude_bins, height, width)
        ops = []
        for _ in range(self.num_ops):
            name, magnitudes, signed = space[rng.integers(0, len(space))]
            mag = float(magnitudes[self.magnitude]) if magnitudes is not None else 0.0
            if signed and rng.integers(0, 2):
                mag = -mag
            ops.append((name, mag))
        return ops

    def __repr__(self) -> str:
        return (f"RandAugment(num_ops={self.num_ops}, magnitude={self.magnitude}, num_magnitude_bins="
                f"{self.num_magnitude_bins}, interpolation={self.interpolation!r}, fill={self.fill}, "
                f"mask_fill={self.mask_fill})")
