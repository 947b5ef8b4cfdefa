"""Geometric transforms on uint8 [H, W, 3] images: crops, resizes and flips,
each reporting the :class:`~feeder.ops.Geometry` it applied (masks and boxes follow it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import cv2
import numpy as np

from .._rng import SampleRNG
from .base import (Geometry, SampleContext, Transform, _choose, _crop_resize, _interp, _resize_into,
                   _size2, _window_box)

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
        # Runs once per sample with the GIL held: bound methods and bounds kept in
        # locals (the draws and the arithmetic are exactly as written out plainly).
        area = height * width
        lo, hi = self.scale
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        uniform, sqrt, exp = rng.uniform, math.sqrt, math.exp
        for _ in range(10):
            target = area * uniform(lo, hi)
            aspect = exp(uniform(log_lo, log_hi))
            w = round(sqrt(target * aspect))
            h = round(sqrt(target / aspect))
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

    def decode_box(self, height, width, ctx):
        return ctx.plan  # drawn by decode_hint

    def _box(self, H: int, W: int, rng: SampleRNG, ctx: SampleContext | None) -> tuple[int, int, int, int]:
        if ctx is not None and ctx.origin is not None:
            # Region-decoded: ``img`` is a window of the whole image at the
            # decode's scale; the box is computed in that whole image's pixels,
            # exactly as below (see _crop for the window).
            H, W = ctx.scaled_size  # type: ignore[misc]
        if ctx is not None and ctx.source_size != (H, W):
            # Decoded at reduced scale: draw on the full size (same crop as a full
            # decode would get), then map the box onto the decoded pixels.
            sh, sw = ctx.source_size
            top, left, h, w = ctx.plan if ctx.plan is not None else self.params(sh, sw, rng)
            fy, fx = H / sh, W / sw
            top, left = min(H - 1, round(top * fy)), min(W - 1, round(left * fx))
            h, w = max(1, min(H - top, round(h * fy))), max(1, min(W - left, round(w * fx)))
            return top, left, h, w
        if ctx is not None and ctx.plan is not None:
            return ctx.plan
        return self.params(H, W, rng)

    def _crop(self, img: np.ndarray, box: tuple[int, int, int, int], ctx: SampleContext | None) -> np.ndarray:
        top, left, h, w = box
        if ctx is not None and ctx.origin is not None:
            top, left = _window_box(ctx, top, left, h, w, img.shape[:2], self)
        return img[top:top + h, left:left + w]

    def apply(self, img, rng, out=None, ctx=None):
        box = self._box(img.shape[0], img.shape[1], rng, ctx)
        crop = self._crop(img, box, ctx)
        h, w = box[2:]
        return _resize_into(crop, self.output_size, _choose(self._interp, self.antialias, (h, w), self.output_size), out)

    def apply_geometry(self, img, rng, out=None, ctx=None):
        top, left, h, w = box = self._box(img.shape[0], img.shape[1], rng, ctx)
        crop = self._crop(img, box, ctx)
        oh, ow = self.output_size
        result = _resize_into(crop, self.output_size,
                              _choose(self._interp, self.antialias, (h, w), self.output_size), out)
        return result, _crop_resize(top, left, h, w, oh, ow)

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

    def decode_box(self, height, width, ctx):
        # All of it, at the smallest DCT scale that covers the target: ``apply``
        # then sees the whole image at that scale (``ctx.origin`` is (0, 0)).
        return 0, 0, height, width

    def planned_size(self, height, width, ctx=None):
        return self.target(*(ctx.source_size if ctx is not None else (height, width)))

    def apply(self, img, rng, out=None, ctx=None):
        H, W = img.shape[:2]
        size = self.planned_size(H, W, ctx)
        return _resize_into(img, size, _choose(self._interp, self.antialias, (H, W), size), out)

    def apply_geometry(self, img, rng, out=None, ctx=None):
        H, W = img.shape[:2]
        size = self.planned_size(H, W, ctx)
        result = _resize_into(img, size, _choose(self._interp, self.antialias, (H, W), size), out)
        return result, _crop_resize(0, 0, H, W, size[0], size[1])

    def __repr__(self) -> str:
        return f"Resize({self.size!r}, interpolation={self.interpolation!r})"


class CenterCrop(Transform):
    """Crop the centre ``size`` region; pads with zeros where the image is smaller (torchvision)."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.output_size = _size2(size, "CenterCrop")

    def _centre(self, H: int, W: int) -> tuple[int, int]:
        h, w = self.output_size
        return int(round((H - h) / 2.0)), int(round((W - w) / 2.0))

    def decode_box(self, height, width, ctx):
        h, w = self.output_size
        if height < h or width < w:
            return None  # padded: the whole image is kept
        return (*self._centre(height, width), h, w)

    def apply(self, img, rng, out=None, ctx=None):
        h, w = self.output_size
        if ctx is not None and ctx.origin is not None:  # region-decoded (see decode_box)
            top, left = self._centre(*ctx.scaled_size)
            t, l = _window_box(ctx, top, left, h, w, img.shape[:2], self)
            crop = img[t:t + h, l:l + w]
            if out is not None and out.shape == crop.shape:
                np.copyto(out, crop)
                return out
            return crop
        H, W = img.shape[:2]
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

    def apply_geometry(self, img, rng, out=None, ctx=None):
        h, w = self.output_size
        if ctx is not None and ctx.origin is not None:
            top, left = self._centre(*ctx.scaled_size)
            return self.apply(img, rng, out, ctx), Geometry(1.0, float(-top), 1.0, float(-left), h, w)
        H, W = img.shape[:2]
        # As apply: pad to at least (h, w) (the smaller half before), then crop the centre.
        py, px = max(0, h - H), max(0, w - W)
        top, left = int(round((H + py - h) / 2.0)), int(round((W + px - w) / 2.0))
        return (self.apply(img, rng, out, ctx),
                Geometry(1.0, float(py // 2 - top), 1.0, float(px // 2 - left), h, w))

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

    def apply_geometry(self, img, rng, out=None, ctx=None):
        H, W = img.shape[:2]
        flipped = rng.random() < self.p
        if out is None:
            result = cv2.flip(img, 1) if flipped else img
        else:
            if flipped:
                cv2.flip(img, 1, dst=out)
            elif out is not img:
                np.copyto(out, img)
            result = out
        return result, (Geometry(1.0, 0.0, -1.0, float(W), H, W) if flipped
                        else Geometry.identity(H, W))

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"
