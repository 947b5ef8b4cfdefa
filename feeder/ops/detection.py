"""The detection recipes' augmentations (torchvision's ``references/detection``,
``transforms.v2``): :class:`RandomPhotometricDistort`, :class:`RandomZoomOut`,
:class:`RandomIoUCrop`, :class:`ScaleJitter` and :class:`RandomShortestSize`.

All but the photometric one change the image size from sample to sample: follow
them with a fixed-size transform, or batch variable sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..sample.rng import SampleRNG
from ..sample import BOXES
from . import color
from .base import (Geometry, Photometric, Transform, _interp, _into,
                   _resize_with_geometry, _whole, check_flag, check_number, check_range, keep_boxes,
                   move_fields)
from .crop import _fill3, _mask_fill
from .resize import _resize_extras


def _pair(value: Sequence[float], name: str, what: str, low: float = 0.0,
          high: float = float("inf"), low_open: bool = False) -> tuple[float, float]:
    return check_range(value, name, what, low, high, low_open)


class RandomPhotometricDistort(Photometric):
    """torchvision's ``RandomPhotometricDistort`` (SSD's photometric distortion):
    each of brightness, contrast, saturation and hue is changed with probability
    ``p`` by a factor drawn from its range, contrast before or after the others
    (even odds), then the channels are permuted with probability ``p``.

    Args:
        brightness: Range of the brightness factor.
        contrast: Range of the contrast factor.
        saturation: Range of the saturation factor.
        hue: Range of the hue shift, in turns (within [-0.5, 0.5]).
        p: Probability of each change.

    Raises:
        ValueError: bad parameters, with the value.
    """

    preserves_size = True

    def __init__(self, brightness: Sequence[float] = (0.875, 1.125), contrast: Sequence[float] = (0.5, 1.5),
                 saturation: Sequence[float] = (0.5, 1.5), hue: Sequence[float] = (-0.05, 0.05),
                 p: float = 0.5) -> None:
        what = "RandomPhotometricDistort"
        self.brightness = _pair(brightness, "brightness", what)
        self.contrast = _pair(contrast, "contrast", what)
        self.saturation = _pair(saturation, "saturation", what)
        self.hue = _pair(hue, "hue", what, low=-0.5, high=0.5)
        self.p = check_number(p, "p", what, 0.0, 1.0)

    def params(self, rng: SampleRNG) -> dict[str, Any]:
        """The draws for one sample, in torchvision's order: each factor or None,
        ``contrast_before``, and the channel permutation or None."""
        out: dict[str, Any] = {}
        for key, (lo, hi) in (("brightness", self.brightness), ("contrast", self.contrast),
                              ("saturation", self.saturation), ("hue", self.hue)):
            out[key] = rng.uniform(lo, hi) if rng.random() < self.p else None
        out["contrast_before"] = rng.random() < 0.5
        perm = None
        if rng.random() < self.p:
            perm = [0, 1, 2]
            for i in range(2, 0, -1):
                j = rng.integers(0, i + 1)
                perm[i], perm[j] = perm[j], perm[i]
        out["permutation"] = perm
        return out

    def apply(self, img, rng, out=None, ctx=None):
        q = self.params(rng)
        if q["brightness"] is not None:
            img = color.adjust_brightness(img, q["brightness"])
        if q["contrast"] is not None and q["contrast_before"]:
            img = color.adjust_contrast(img, q["contrast"])
        if q["saturation"] is not None:
            img = color.adjust_saturation(img, q["saturation"])
        if q["hue"] is not None:
            img = color.adjust_hue(img, q["hue"])
        if q["contrast"] is not None and not q["contrast_before"]:
            img = color.adjust_contrast(img, q["contrast"])
        if q["permutation"] is not None:
            img = color.permute_channels(img, q["permutation"])
        return _into(img, out)

    def __repr__(self) -> str:
        return (f"RandomPhotometricDistort(brightness={self.brightness}, contrast={self.contrast}, "
                f"saturation={self.saturation}, hue={self.hue}, p={self.p})")


class RandomZoomOut(Transform):
    """torchvision's ``RandomZoomOut`` (SSD's expansion): with probability ``p``, the
    image is placed at a random position on a canvas ``r`` times its size, ``r``
    drawn from ``side_range``; the rest is ``fill`` (the mask: ``mask_fill``).
    Boxes move with the image.

    Args:
        fill: Canvas value, an int or (R, G, B).
        side_range: Range of the canvas side as a multiple of the image's (>= 1).
        p: Probability of zooming out.
        mask_fill: Mask value of the canvas.

    Raises:
        ValueError: bad parameters, with the value.
    """

    def __init__(self, fill: Any = 0, side_range: Sequence[float] = (1.0, 4.0), p: float = 0.5,
                 mask_fill: int = 255) -> None:
        self.fill = _fill3(fill, "RandomZoomOut")
        self.side_range = _pair(side_range, "side_range", "RandomZoomOut", low=1.0)
        self.p = check_number(p, "p", "RandomZoomOut", 0.0, 1.0)
        self.mask_fill = _mask_fill(mask_fill, "RandomZoomOut")

    def params(self, height: int, width: int, rng: SampleRNG) -> tuple[int, int, int, int] | None:
        """(top, left, canvas height, canvas width), or None: not zoomed out."""
        if rng.random() >= self.p:
            return None
        r = self.side_range[0] + rng.random() * (self.side_range[1] - self.side_range[0])
        cw, ch = int(width * r), int(height * r)
        left, top = int((cw - width) * rng.random()), int((ch - height) * rng.random())
        return top, left, ch, cw

    def planned_size_for(self, height, width, rng, ctx=None):
        q = self.params(height, width, rng)
        return (height, width) if q is None else (q[2], q[3])

    def largest_output(self, largest_input):
        if largest_input is None:
            return None
        r = self.side_range[1]  # the margin absorbs the rounding of a drawn r
        return int(largest_input[0] * r + 1e-6), int(largest_input[1] * r + 1e-6)

    def apply(self, img, rng, out=None, ctx=None):
        return self.apply_geometry(img, rng, out, ctx)[0]

    def apply_geometry(self, img, rng, out=None, ctx=None):
        H, W = img.shape[:2]
        q = self.params(H, W, rng)
        if q is None:
            # With the fill all the same: a mask that cannot hold it is refused on
            # every sample, not only on those that get a canvas.
            return img, Geometry(1.0, 0.0, 1.0, 0.0, H, W, self.mask_fill)
        top, left, ch, cw = q
        if out is None or out.shape != (ch, cw, 3) or out.dtype != np.uint8:
            out = np.empty((ch, cw, 3), np.uint8)
        out[...] = np.asarray(self.fill, np.uint8)
        out[top:top + H, left:left + W] = img
        return out, Geometry(1.0, float(top), 1.0, float(left), ch, cw, self.mask_fill)

    def __repr__(self) -> str:
        # mask_fill only when not the default: states saved before it was named still load.
        extra = f", mask_fill={self.mask_fill}" if self.mask_fill != 255 else ""
        return f"RandomZoomOut(fill={self.fill}, side_range={self.side_range}, p={self.p}{extra})"


def _iou(boxes: np.ndarray, box: tuple[float, float, float, float]) -> np.ndarray:
    x0, y0, x1, y1 = box
    iw = np.clip(np.minimum(boxes[:, 2], x1) - np.maximum(boxes[:, 0], x0), 0, None)
    ih = np.clip(np.minimum(boxes[:, 3], y1) - np.maximum(boxes[:, 1], y0), 0, None)
    inter = iw * ih
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return inter / (area + (x1 - x0) * (y1 - y0) - inter)


class RandomIoUCrop(Transform):
    """torchvision's ``RandomIoUCrop`` (SSD's sampling crop): draw a minimum IoU from
    ``sampler_options`` (1.0: no crop), then up to ``trials`` crops of scale
    ``[min_scale, max_scale]`` per side and aspect ratio within bounds, keeping the
    first one that holds the centre of some box and overlaps one of those boxes
    with at least that IoU; else draw again. Boxes whose centres fall outside the
    crop are dropped with their ``box_*`` rows; the others are clipped. Needs
    samples with boxes (``"boxes"``).

    Args:
        min_scale: Smallest crop side, as a fraction of the image's.
        max_scale: Largest crop side, as a fraction.
        min_aspect_ratio: Smallest crop width / height.
        max_aspect_ratio: Largest crop width / height.
        sampler_options: The minimum IoUs drawn from.
        trials: Crops tried per drawn IoU.

    Raises:
        ValueError: bad parameters, with the value.
    """

    moves_fields = True

    def __init__(self, min_scale: float = 0.3, max_scale: float = 1.0, min_aspect_ratio: float = 0.5,
                 max_aspect_ratio: float = 2.0,
                 sampler_options: Sequence[float] = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0),
                 trials: int = 40) -> None:
        self.min_scale, self.max_scale = _pair((min_scale, max_scale), "(min_scale, max_scale)",
                                               "RandomIoUCrop", 0.0, 1.0, low_open=True)
        self.min_aspect_ratio, self.max_aspect_ratio = _pair(
            (min_aspect_ratio, max_aspect_ratio), "(min_aspect_ratio, max_aspect_ratio)",
            "RandomIoUCrop", low_open=True)
        if isinstance(sampler_options, (str, bytes)) or not hasattr(sampler_options, "__iter__"):
            raise ValueError(f"RandomIoUCrop: sampler_options must be a list of minimum IoUs in "
                             f"[0, 1], got {sampler_options!r}")
        # A NaN option would accept any crop (no IoU compares below it).
        self.options = [check_number(o, f"sampler_options {list(sampler_options)!r}: each",
                                     "RandomIoUCrop", 0.0, 1.0) for o in sampler_options]
        if not self.options:
            raise ValueError("RandomIoUCrop: sampler_options is empty")
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
            raise ValueError(f"RandomIoUCrop: trials must be a positive int, got {trials!r}")
        self.trials = trials

    def params(self, height: int, width: int, boxes: np.ndarray, rng: SampleRNG
               ) -> tuple[int, int, int, int, np.ndarray] | None:
        """(top, left, h, w, boxes-within mask), or None: no crop. Loops as
        torchvision does until a crop is found or the option 1.0 is drawn; without
        1.0 in ``sampler_options`` and no box anywhere it stops after 1000 draws."""
        b = boxes.astype(np.float64)
        cx, cy = 0.5 * (b[:, 0] + b[:, 2]), 0.5 * (b[:, 1] + b[:, 3])
        for _ in range(1000):
            min_iou = self.options[rng.integers(0, len(self.options))]
            if min_iou >= 1.0:
                return None
            for _ in range(self.trials):
                r0, r1 = rng.random(), rng.random()
                new_w = int(width * (self.min_scale + (self.max_scale - self.min_scale) * r0))
                new_h = int(height * (self.min_scale + (self.max_scale - self.min_scale) * r1))
                if new_h == 0 or not self.min_aspect_ratio <= new_w / new_h <= self.max_aspect_ratio:
                    continue
                left = int((width - new_w) * rng.random())
                top = int((height - new_h) * rng.random())
                right, bottom = left + new_w, top + new_h
                if left == right or top == bottom:
                    continue
                within = (left < cx) & (cx < right) & (top < cy) & (cy < bottom)
                if not within.any():
                    continue
                if _iou(b[within], (left, top, right, bottom)).max() < min_iou:
                    continue
                return top, left, new_h, new_w, within
        return None

    def largest_output(self, largest_input):
        return largest_input  # a crop of the input, or the input itself

    def apply(self, img, rng, out=None, ctx=None):
        raise ValueError("RandomIoUCrop needs samples with boxes (a \"boxes\" field): it chooses "
                         "crops by their overlap with the boxes")

    def apply_fields(self, img, rng, fields, geometry, out=None, ctx=None):
        if BOXES not in fields:
            self.apply(img, rng)
        fields = move_fields(fields, geometry)
        H, W = img.shape[:2]
        q = self.params(H, W, fields[BOXES], rng)
        if q is None:
            return img, fields, Geometry.identity(H, W)
        top, left, h, w, within = q
        fields = keep_boxes(fields, fields[BOXES][within], within)
        crop = img[top:top + h, left:left + w]
        if out is not None and out.shape == crop.shape:
            np.copyto(out, crop)
            crop = out
        return crop, fields, Geometry(1.0, float(-top), 1.0, float(-left), h, w)

    def __repr__(self) -> str:
        return (f"RandomIoUCrop(min_scale={self.min_scale}, max_scale={self.max_scale}, "
                f"aspect=({self.min_aspect_ratio}, {self.max_aspect_ratio}), "
                f"sampler_options={self.options}, trials={self.trials})")


class _RandomScale(Transform):
    """A resize by a random factor: the size from :meth:`size`."""

    def __init__(self, interpolation: str, antialias: bool) -> None:
        self.interpolation = interpolation
        self._interp = _interp(interpolation, type(self).__name__)
        self.antialias = check_flag(antialias, "antialias", type(self).__name__)

    def size(self, height: int, width: int, rng: SampleRNG) -> tuple[int, int]:
        raise NotImplementedError

    def planned_size_for(self, height, width, rng, ctx=None):
        return self.size(height, width, rng)

    def apply(self, img, rng, out=None, ctx=None):
        return self.apply_geometry(img, rng, out, ctx)[0]

    def apply_geometry(self, img, rng, out=None, ctx=None):
        size = self.size(img.shape[0], img.shape[1], rng)
        return _resize_with_geometry(img, size, self._interp, self.antialias, out)


class ScaleJitter(_RandomScale):
    """torchvision's ``ScaleJitter`` (large scale jitter, Ghiasi et al.): resize by
    ``min(target_w / w, target_h / h) * s``, ``s`` drawn from ``scale_range``.

    Args:
        target_size: (width, height) the scale is relative to, in torchvision's
            order (its ``ScaleJitter`` reads ``target_size[0]`` against the
            width), so a recipe's value carries over unchanged; the recipes'
            square ``(1024, 1024)`` reads the same either way.
        scale_range: Range of ``s``.
        interpolation: As in :class:`~feeder.ops.RandomResizedCrop`.
        antialias: Use area averaging when bilinear would shrink by more than 2x.

    Raises:
        ValueError: bad parameters, with the value.
    """

    def __init__(self, target_size: Sequence[int], scale_range: Sequence[float] = (0.1, 2.0),
                 interpolation: str = "bilinear", antialias: bool = True) -> None:
        super().__init__(interpolation, antialias)
        if (isinstance(target_size, (str, bytes)) or not hasattr(target_size, "__len__")
                or len(target_size) != 2 or any(not _whole(v) or v <= 0 for v in target_size)):
            raise ValueError(f"ScaleJitter: target_size must be (width, height), two positive ints, "
                             f"got {target_size!r}")
        self.target_size = (int(target_size[0]), int(target_size[1]))
        self.scale_range = _pair(scale_range, "scale_range", "ScaleJitter", low_open=True)

    def size(self, height, width, rng):
        s = self.scale_range[0] + rng.random() * (self.scale_range[1] - self.scale_range[0])
        r = min(self.target_size[1] / height, self.target_size[0] / width) * s
        return max(1, int(height * r)), max(1, int(width * r))

    def largest_output(self, largest_input):
        # height * r <= target height * s < target height * scale_range[1] (and
        # the width likewise); the margin absorbs the rounding of r.
        top = self.scale_range[1]
        return (max(1, math.floor(self.target_size[1] * top + 1e-6)),
                max(1, math.floor(self.target_size[0] * top + 1e-6)))

    def __repr__(self) -> str:
        return (f"ScaleJitter({self.target_size}, scale_range={self.scale_range}"
                f"{_resize_extras(self.antialias, self.interpolation)})")


class RandomShortestSize(_RandomScale):
    """torchvision's ``RandomShortestSize`` (the detection reference's multi-scale
    training): the shorter side becomes one of ``min_size`` (drawn uniformly), the
    longer side at most ``max_size``.

    Args:
        min_size: Shorter-side lengths to draw from (an int: that one).
        max_size: Cap of the longer side, or None.
        interpolation: As in :class:`~feeder.ops.RandomResizedCrop`.
        antialias: Use area averaging when bilinear would shrink by more than 2x.

    Raises:
        ValueError: bad parameters, with the value.
    """

    def __init__(self, min_size: int | Sequence[int], max_size: int | None = None,
                 interpolation: str = "bilinear", antialias: bool = True) -> None:
        super().__init__(interpolation, antialias)
        iterable = not isinstance(min_size, (str, bytes)) and hasattr(min_size, "__iter__")
        sizes = list(min_size) if iterable else [min_size]  # type: ignore[arg-type]
        if not sizes or any(not _whole(v) or v <= 0 for v in sizes):
            raise ValueError(f"RandomShortestSize: min_size must be a positive int or a list of "
                             f"them, got {min_size!r}")
        if max_size is not None and (not _whole(max_size) or max_size <= 0):
            raise ValueError(f"RandomShortestSize: max_size must be a positive int, got {max_size!r}")
        self.min_size, self.max_size = [int(v) for v in sizes], max_size

    def size(self, height, width, rng):
        s = self.min_size[rng.integers(0, len(self.min_size))]
        r = s / min(height, width)
        if self.max_size is not None:
            r = min(r, self.max_size / max(height, width))
        return max(1, int(height * r)), max(1, int(width * r))

    def largest_output(self, largest_input):
        # r <= max_size / longer side: both sides at most max_size; without it, a
        # narrow image's longer side grows without bound.
        return None if self.max_size is None else (self.max_size, self.max_size)

    def __repr__(self) -> str:
        return (f"RandomShortestSize({self.min_size}, max_size={self.max_size}"
                f"{_resize_extras(self.antialias, self.interpolation)})")
