"""CPU transforms on uint8 [H, W, 3] RGB arrays.

Any plain callable ``fn(img, rng) -> img`` is a transform: ``rng`` is a
:class:`~feeder._rng.SampleRNG` drawn from (seed, epoch, sample index, position
in the chain), so results do not depend on thread counts or scheduling. A
callable that changes the image size may say so with an ``output_size``
attribute ``(height, width)``.

The classes here follow torchvision's semantics and add what the engine uses
to go fast: ``output_size`` (to size the batch buffers), ``decode_hint`` (the
smallest decoded size they need, for reduced-scale JPEG decoding) and writing
the final result straight into the batch buffer (``out=``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
import cv2
import numpy as np

from ._rng import SampleRNG

__all__ = ["CenterCrop", "RandomHorizontalFlip", "RandomResizedCrop", "Resize", "Transform"]

_INTERPOLATION = {
    "nearest": cv2.INTER_NEAREST,
    "bilinear": cv2.INTER_LINEAR,
    "bicubic": cv2.INTER_CUBIC,
    "area": cv2.INTER_AREA,
    "lanczos": cv2.INTER_LANCZOS4,
}


def _size2(size: int | Sequence[int], what: str) -> tuple[int, int]:
    if isinstance(size, int):
        pair = (size, size)
    else:
        pair = tuple(int(s) for s in size)
        if len(pair) != 2:
            raise ValueError(f"{what}: size must be an int or (height, width), got {size!r}")
    if min(pair) <= 0:
        raise ValueError(f"{what}: size must be positive, got {size!r}")
    return pair  # type: ignore[return-value]


def _interp(name: str, what: str) -> int:
    try:
        return _INTERPOLATION[name]
    except KeyError:
        raise ValueError(f"{what}: interpolation must be one of {sorted(_INTERPOLATION)}, "
                         f"got {name!r}") from None


class SampleContext:
    """What a transform may know about the sample beyond its pixels.

    Attributes:
        source_size: (height, width) of the full-size image, before any
            reduced-scale decode.
        plan: What the decode-hinting transform already drew for this sample in
            ``decode_hint`` (so ``apply`` need not draw it again), or None.
    """

    __slots__ = ("source_size", "plan")

    def __init__(self, source_size: tuple[int, int], plan: object = None) -> None:
        self.source_size = source_size
        self.plan = plan


class Transform:
    """Base class of the built-in transforms.

    Attributes:
        output_size: (height, width) of every output, or None when it depends on the input.
        preserves_size: The output has the input's size.
        inplace: ``apply(img, rng, out=img)`` is valid (the result may overwrite the input).
    """

    output_size: tuple[int, int] | None = None
    preserves_size = False
    inplace = False

    def __call__(self, img: np.ndarray, rng: SampleRNG) -> np.ndarray:
        return self.apply(img, rng)

    def apply(self, img: np.ndarray, rng: SampleRNG, out: np.ndarray | None = None,
              ctx: SampleContext | None = None) -> np.ndarray:
        """Transform ``img``; when ``out`` fits, write into it and return it."""
        raise NotImplementedError

    def decode_hint(self, height: int, width: int, rng: SampleRNG,
                    ctx: SampleContext | None = None) -> tuple[int, int] | None:
        """Smallest (height, width) of the decoded image this transform needs, given the
        full size; ``rng`` is the same stream ``apply`` will get, and ``ctx`` the one
        ``apply`` will get (``ctx.plan`` may keep what was drawn). None: the full size."""
        return None


def _resize_into(img: np.ndarray, size: tuple[int, int], interpolation: int,
                 out: np.ndarray | None) -> np.ndarray:
    h, w = size
    # Only an input of the slot's own type can be resized into it: for anything
    # else cv2 silently allocates a new array and leaves ``out`` stale.
    if (out is not None and out.shape == (h, w, 3) and out.dtype == np.uint8
            and img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3):
        cv2.resize(img, (w, h), dst=out, interpolation=interpolation)
        return out
    return cv2.resize(img, (w, h), interpolation=interpolation)


def _choose(interpolation: int, antialias: bool, src: tuple[int, int], dst: tuple[int, int]) -> int:
    # Bilinear sampling aliases when shrinking by more than 2x; area averaging is
    # OpenCV's anti-aliased shrink (torchvision antialiases by default too).
    if antialias and interpolation == cv2.INTER_LINEAR and (src[0] > 2 * dst[0] or src[1] > 2 * dst[1]):
        return cv2.INTER_AREA
    return interpolation


class RandomResizedCrop(Transform):
    """Crop a random area and aspect ratio, then resize to ``size`` (torchvision semantics).

    Args:
        size: Output size, an int (square) or (height, width).
        scale: Range of the crop's area as a fraction of the image area.
        ratio: Range of the crop's aspect ratio (width / height), drawn log-uniformly.
        interpolation: "bilinear" (default), "nearest", "bicubic", "area" or "lanczos".
        antialias: Use area averaging when bilinear would shrink by more than 2x.
    """

    def __init__(self, size: int | Sequence[int], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), interpolation: str = "bilinear",
                 antialias: bool = True) -> None:
        self.output_size = _size2(size, "RandomResizedCrop")
        if not (0 < scale[0] <= scale[1]):
            raise ValueError(f"RandomResizedCrop: scale must satisfy 0 < min <= max, got {scale}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"RandomResizedCrop: ratio must satisfy 0 < min <= max, got {ratio}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.interpolation = interpolation
        self._interp = _interp(interpolation, "RandomResizedCrop")
        self.antialias = antialias

    def params(self, height: int, width: int, rng: SampleRNG) -> tuple[int, int, int, int]:
        """(top, left, crop_height, crop_width), as torchvision's ``get_params``."""
        area = height * width
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(log_lo, log_hi))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return rng.integers(0, height - h + 1), rng.integers(0, width - w + 1), h, w
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            h, w = height, int(round(height * self.ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def decode_hint(self, height, width, rng, ctx=None):
        params = self.params(height, width, rng)
        if ctx is not None:
            ctx.plan = params
        _, _, h, w = params
        oh, ow = self.output_size
        # Decoded at scale s the crop is (h*s, w*s); keep it at least the output size.
        return (min(height, -(-height * oh // h)), min(width, -(-width * ow // w)))

    def apply(self, img, rng, out=None, ctx=None):
        H, W = img.shape[:2]
        if ctx is not None and ctx.source_size != (H, W):
            # Decoded at reduced scale: draw on the full size (same crop as a full
            # decode would get), then map the box onto the decoded pixels.
            sh, sw = ctx.source_size
            top, left, h, w = ctx.plan if ctx.plan is not None else self.params(sh, sw, rng)
            fy, fx = H / sh, W / sw
            top, left = min(H - 1, round(top * fy)), min(W - 1, round(left * fx))
            h, w = max(1, min(H - top, round(h * fy))), max(1, min(W - left, round(w * fx)))
        elif ctx is not None and ctx.plan is not None:
            top, left, h, w = ctx.plan
        else:
            top, left, h, w = self.params(H, W, rng)
        crop = img[top:top + h, left:left + w]
        return _resize_into(crop, self.output_size, _choose(self._interp, self.antialias, (h, w), self.output_size), out)

    def __repr__(self) -> str:
        return (f"RandomResizedCrop(size={self.output_size}, scale={self.scale}, ratio="
                f"({self.ratio[0]:.4g}, {self.ratio[1]:.4g}), interpolation={self.interpolation!r})")


class Resize(Transform):
    """Resize so the shorter side is ``size`` (an int), or to exactly (height, width).

    Args:
        size: Shorter-side length, or (height, width).
        interpolation: As in :class:`RandomResizedCrop`.
        antialias: Use area averaging when bilinear would shrink by more than 2x.
    """

    def __init__(self, size: int | Sequence[int], interpolation: str = "bilinear",
                 antialias: bool = True) -> None:
        if isinstance(size, int):
            if size <= 0:
                raise ValueError(f"Resize: size must be positive, got {size}")
            self.shorter: int | None = size
            self.output_size = None
        else:
            self.shorter = None
            self.output_size = _size2(size, "Resize")
        self.size = size
        self.interpolation = interpolation
        self._interp = _interp(interpolation, "Resize")
        self.antialias = antialias

    def target(self, height: int, width: int) -> tuple[int, int]:
        if self.shorter is None:
            return self.output_size  # type: ignore[return-value]
        s = self.shorter
        if height <= width:
            return s, max(1, int(s * width / height))
        return max(1, int(s * height / width)), s

    def decode_hint(self, height, width, rng, ctx=None):
        return self.target(height, width)

    def apply(self, img, rng, out=None, ctx=None):
        H, W = img.shape[:2]
        size = self.target(*(ctx.source_size if ctx is not None else (H, W)))
        return _resize_into(img, size, _choose(self._interp, self.antialias, (H, W), size), out)

    def __repr__(self) -> str:
        return f"Resize({self.size!r}, interpolation={self.interpolation!r})"


class CenterCrop(Transform):
    """Crop the centre ``size`` region; pads with zeros where the image is smaller (torchvision)."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.output_size = _size2(size, "CenterCrop")

    def apply(self, img, rng, out=None, ctx=None):
        H, W = img.shape[:2]
        h, w = self.output_size
        if H < h or W < w:
            py, px = max(0, h - H), max(0, w - W)
            img = cv2.copyMakeBorder(img, py // 2, py - py // 2, px // 2, px - px // 2,
                                     cv2.BORDER_CONSTANT, value=(0, 0, 0))
            H, W = img.shape[:2]
        top, left = int(round((H - h) / 2.0)), int(round((W - w) / 2.0))
        crop = img[top:top + h, left:left + w]
        if out is not None and out.shape == crop.shape:
            np.copyto(out, crop)
            return out
        return crop

    def __repr__(self) -> str:
        return f"CenterCrop({self.output_size})"


class RandomHorizontalFlip(Transform):
    """Mirror left-right with probability ``p``. Works in place."""

    preserves_size = True
    inplace = True

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomHorizontalFlip: p must be in [0, 1], got {p}")
        self.p = p

    def apply(self, img, rng, out=None, ctx=None):
        flip = rng.random() < self.p
        if out is None:
            return cv2.flip(img, 1) if flip else img
        if flip:
            cv2.flip(img, 1, dst=out)  # OpenCV's horizontal flip is safe in place
        elif out is not img:
            np.copyto(out, img)
        return out

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"
