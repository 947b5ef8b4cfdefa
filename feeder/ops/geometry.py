"""Geometric transforms on uint8 [H, W, 3] images: crops, resizes and flips,
each reporting the :class:`~feeder.ops.Geometry` it applied (masks and boxes follow it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import cv2
import numpy as np

from ..sample.rng import SampleRNG
from .base import (Geometry, SampleContext, Transform, _choose, _crop_resize, _interp, _resize_into,
                   _resize_with_geometry, _size2, _whole, _window_box, check_flag, check_number,
                   check_range)

def _resize_extras(antialias: bool, interpolation: str | None = None) -> str:
    """The settings a resize's repr names only when they are not the default (a
    feeder's state compares reprs on resume: one that left a setting out would
    let a resume change it unnoticed, one that named a default would refuse the
    states saved before it was named)."""
    extra = f", interpolation={interpolation!r}" if interpolation not in (None, "bilinear") else ""
    return extra + ("" if antialias else ", antialias=False")


def _shorter_side(height: int, width: int, size: int, max_size: int | None) -> tuple[int, int]:
    """(height, width) with the shorter side ``size``, torchvision's ``_compute_resized_output_size``:
    the longer side ``int(size * long / short)``; when that exceeds ``max_size``, the
    longer side becomes ``max_size`` and the shorter ``int(max_size * short / long)``."""
    short, long = (height, width) if height <= width else (width, height)
    new_short, new_long = size, int(size * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    new_short, new_long = max(1, new_short), max(1, new_long)
    return (new_short, new_long) if height <= width else (new_long, new_short)


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
        self.scale = check_range(scale, "scale", "RandomResizedCrop", low=0.0, low_open=True)
        self.ratio = check_range(ratio, "ratio", "RandomResizedCrop", low=0.0, low_open=True)
        self.interpolation = interpolation
        self._interp = _interp(interpolation, "RandomResizedCrop")
        self.antialias = check_flag(antialias, "antialias", "RandomResizedCrop")

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
                f"({_ratio_text(self.ratio[0])}, {_ratio_text(self.ratio[1])}), "
                f"interpolation={self.interpolation!r}{_resize_extras(self.antialias)})")


def _ratio_text(value: float) -> str:
    # Four digits, as saved states have them, where that names the value exactly
    # (or it is the default's 3/4 or 4/3); every digit otherwise, so that resume
    # tells (0.75, 1.3334) from the default.
    short = f"{value:.4g}"
    return short if float(short) == value or value in (3 / 4, 4 / 3) else repr(value)


class Resize(Transform):
    """Resize so the shorter side is ``size`` (an int), or to exactly (height, width)
    (torchvision semantics).

    Args:
        size: Shorter-side length, or (height, width).
        interpolation: As in :class:`RandomResizedCrop`.
        antialias: Use area averaging when bilinear would shrink by more than 2x.
        max_size: With an int ``size``: the longest the longer side may be. An
            image whose longer side would exceed it is resized so that the longer
            side is ``max_size`` instead, and the shorter side is then below ``size``
            (torchvision's ``max_size``: detection's ``Resize(800, max_size=1333)``).

    Raises:
        ValueError: a size that is not positive, or ``max_size`` with a (height,
            width) size or not above ``size``.
    """

    def __init__(self, size: int | Sequence[int], interpolation: str = "bilinear",
                 antialias: bool = True, max_size: int | None = None) -> None:
        if _whole(size):
            if size <= 0:
                raise ValueError(f"Resize: size must be positive, got {size}")
            self.shorter: int | None = int(size)
            self.output_size = None
        else:
            self.shorter = None
            self.output_size = _size2(size, "Resize")
        if max_size is not None:
            if self.shorter is None:
                raise ValueError(f"Resize: max_size applies to an int size (the shorter side), "
                                 f"got size={size!r}")
            if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size <= self.shorter:
                raise ValueError(f"Resize: max_size must be an int above size={size}, got {max_size!r}")
        self.max_size = max_size
        self.size = size
        self.interpolation = interpolation
        self._interp = _interp(interpolation, "Resize")
        self.antialias = check_flag(antialias, "antialias", "Resize")

    def target(self, height: int, width: int) -> tuple[int, int]:
        if self.shorter is None:
            return self.output_size  # type: ignore[return-value]
        return _shorter_side(height, width, self.shorter, self.max_size)

    def decode_hint(self, height, width, rng, ctx=None):
        return self.target(height, width)

    def decode_box(self, height, width, ctx):
        # All of it, at the smallest DCT scale that covers the target: ``apply``
        # then sees the whole image at that scale (``ctx.origin`` is (0, 0)).
        return 0, 0, height, width

    def planned_size(self, height, width, ctx=None):
        return self.target(*(ctx.source_size if ctx is not None else (height, width)))

    def largest_output(self, largest_input):
        if self.shorter is None:
            return self.output_size
        # Both sides at most max_size (the shorter at most size, below it); without
        # it, a narrow image's longer side grows without bound.
        return None if self.max_size is None else (self.max_size, self.max_size)

    def apply(self, img, rng, out=None, ctx=None):
        H, W = img.shape[:2]
        size = self.planned_size(H, W, ctx)
        return _resize_into(img, size, _choose(self._interp, self.antialias, (H, W), size), out)

    def apply_geometry(self, img, rng, out=None, ctx=None):
        size = self.planned_size(img.shape[0], img.shape[1], ctx)
        return _resize_with_geometry(img, size, self._interp, self.antialias, out)

    def __repr__(self) -> str:
        extra = f", max_size={self.max_size}" if self.max_size is not None else ""
        extra += _resize_extras(self.antialias)
        return f"Resize({self.size!r}, interpolation={self.interpolation!r}{extra})"


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


#: The left/right map of COCO's 17 person keypoints (nose, eyes, ears, shoulders,
#: elbows, wrists, hips, knees, ankles: each left one swaps with its right one),
#: for ``RandomHorizontalFlip(keypoint_flip=...)``; torchvision's detection
#: reference flips them so.
COCO_PERSON_KEYPOINT_FLIP = (0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15)


def _flip_map(value: Sequence[int] | None) -> np.ndarray | None:
    if value is None:
        return None
    what = "RandomHorizontalFlip"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{what}: keypoint_flip must be a sequence of keypoint indices, got "
                         f"{value!r}")
    items = tuple(value)
    k = len(items)
    if (not k or not all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))
                         for i in items) or sorted(int(i) for i in items) != list(range(k))):
        raise ValueError(f"{what}: keypoint_flip must hold each of 0..K-1 once (entry k: the "
                         f"keypoint that takes keypoint k's place when flipped), got {value!r}")
    order = np.asarray(items, np.intp)
    if (order[order] != np.arange(k)).any():
        k0 = int(np.flatnonzero(order[order] != np.arange(k))[0])
        raise ValueError(f"{what}: keypoint_flip must swap keypoints in pairs (flipping twice "
                         f"gives them back), but {k0} goes to {int(order[k0])}, which goes to "
                         f"{int(order[order[k0]])}: got {value!r}")
    return order


class RandomHorizontalFlip(Transform):
    """Mirror left-right with probability ``p``. Works in place.

    Boxes, masks and per-instance masks follow the image. Keypoints (the
    ``"keypoints"`` field) also need to know which of them swap places, the
    left eye becoming the right one: ``keypoint_flip`` says it, and a sample
    with keypoints through a flip without it is a :class:`~feeder.ConfigError`
    (feeder does not guess a map from the number of keypoints).

    Args:
        p: Probability of a flip.
        keypoint_flip: For samples with keypoints ``[N, K, 3]``: entry ``k`` is
            the keypoint that takes keypoint ``k``'s place in a flipped sample
            (each of ``0..K-1`` once, in pairs: :data:`COCO_PERSON_KEYPOINT_FLIP`
            for COCO's person keypoints, ``list(range(K))`` to swap none).

    Raises:
        ValueError: ``p`` not in [0, 1], ``keypoint_flip`` not such a map.
    """

    preserves_size = True
    inplace = True

    def __init__(self, p: float = 0.5, keypoint_flip: Sequence[int] | None = None) -> None:
        self.p = check_number(p, "p", "RandomHorizontalFlip", 0.0, 1.0)
        self.keypoint_flip = _flip_map(keypoint_flip)

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
        geometry = Geometry(1.0, 0.0, -1.0, float(W), H, W) if flipped else Geometry.identity(H, W)
        if self.keypoint_flip is None:
            geometry.unmapped = self
        elif flipped:
            geometry.order = self.keypoint_flip
        return result, geometry

    def __repr__(self) -> str:
        extra = "" if self.keypoint_flip is None else f", keypoint_flip={self.keypoint_flip.tolist()}"
        return f"RandomHorizontalFlip(p={self.p}{extra})"


class RandomResize(Transform):
    """Resize so the shorter side is a random length in ``[min_size, max_size]``, drawn
    per sample (torchvision's segmentation reference ``RandomResize``; both ends
    included). A mask follows with nearest neighbour, boxes are scaled.

    The output size varies from sample to sample: follow it with a fixed-size
    transform (:class:`RandomCrop`, :class:`CenterCrop`, ``Resize((h, w))``) or give
    the feeder a way to batch variable sizes.

    Args:
        min_size: Smallest shorter side.
        max_size: Largest shorter side (default ``min_size``).
        interpolation: As in :class:`RandomResizedCrop`.
        antialias: Use area averaging when bilinear would shrink by more than 2x.
        max_long: The longest the longer side may be (as :class:`Resize`'s ``max_size``); None: no cap.

    Raises:
        ValueError: sizes that are not positive ints with ``min_size <= max_size``.
    """

    def __init__(self, min_size: int, max_size: int | None = None, interpolation: str = "bilinear",
                 antialias: bool = True, max_long: int | None = None) -> None:
        max_size = min_size if max_size is None else max_size
        for name, v in (("min_size", min_size), ("max_size", max_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"RandomResize: {name} must be a positive int, got {v!r}")
        if min_size > max_size:
            raise ValueError(f"RandomResize: min_size ({min_size}) is above max_size ({max_size})")
        if max_long is not None and (isinstance(max_long, bool) or not isinstance(max_long, int)
                                     or max_long < max_size):
            raise ValueError(f"RandomResize: max_long must be an int >= max_size ({max_size}), "
                             f"got {max_long!r}")
        self.min_size, self.max_size, self.max_long = min_size, max_size, max_long
        self.interpolation = interpolation
        self._interp = _interp(interpolation, "RandomResize")
        self.antialias = check_flag(antialias, "antialias", "RandomResize")

    def target(self, height: int, width: int, rng: SampleRNG) -> tuple[int, int]:
        """The output size for one sample (one draw from ``rng``)."""
        size = rng.integers(self.min_size, self.max_size + 1)
        return _shorter_side(height, width, size, self.max_long)

    def planned_size_for(self, height, width, rng, ctx=None):
        return self.target(height, width, rng)

    def largest_output(self, largest_input):
        # The shorter side is at most max_size <= max_long, the longer at most max_long.
        return None if self.max_long is None else (self.max_long, self.max_long)

    def apply(self, img, rng, out=None, ctx=None):
        return self.apply_geometry(img, rng, out, ctx)[0]

    def apply_geometry(self, img, rng, out=None, ctx=None):
        size = self.target(img.shape[0], img.shape[1], rng)
        return _resize_with_geometry(img, size, self._interp, self.antialias, out)

    def __repr__(self) -> str:
        extra = f", max_long={self.max_long}" if self.max_long is not None else ""
        extra += _resize_extras(self.antialias)
        return (f"RandomResize({self.min_size}, {self.max_size}, "
                f"interpolation={self.interpolation!r}{extra})")


def _padding4(padding: int | Sequence[int] | None) -> tuple[int, int, int, int]:
    """torchvision's padding forms as (left, top, right, bottom)."""
    if padding is None:
        return 0, 0, 0, 0
    if isinstance(padding, int) and not isinstance(padding, bool):
        p = (padding,) * 4
    elif isinstance(padding, (str, bytes)) or not hasattr(padding, "__iter__"):
        p = (padding,)  # refused below, with the value
    else:
        p = tuple(padding)
        if len(p) == 2:
            p = (p[0], p[1], p[0], p[1])
    if len(p) != 4 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in p):
        raise ValueError(f"RandomCrop: padding must be an int >= 0, (left/right, top/bottom) or "
                         f"(left, top, right, bottom), got {padding!r}")
    return p  # type: ignore[return-value]


def _fill3(fill: int | Sequence[int], what: str) -> tuple[int, int, int]:
    single = isinstance(fill, (int, float)) or not hasattr(fill, "__iter__")
    f = (fill,) * 3 if single else tuple(fill)  # a float or None: refused below, not a TypeError
    if len(f) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 255 for v in f):
        raise ValueError(f"{what}: fill must be an int in [0, 255] or three of them (R, G, B), got {fill!r}")
    return f  # type: ignore[return-value]


def _mask_fill(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{what}: mask_fill must be an int in [0, 65535], got {value!r}")
    return value


class RandomCrop(Transform):
    """Crop a random ``size`` region (torchvision's ``RandomCrop``), padding first
    where asked or needed.

    The image is padded by ``padding``, then, with ``pad_if_needed``, on each side
    where it is still smaller than ``size``: by the shortfall on both sides
    (torchvision's ``RandomCrop``: ``pad_at="both"``) or on the right and bottom
    only (torchvision's segmentation reference ``pad_if_smaller``: ``pad_at="end"``).
    Then a ``size`` window is drawn uniformly. Image padding is ``fill``, mask
    padding ``mask_fill`` (255, the ignore index of the segmentation losses); boxes
    are shifted, clipped to the crop and dropped when nothing of them is inside.

    Args:
        size: Output size, an int (square) or (height, width).
        padding: Pixels added on every side (int), (left/right, top/bottom) or
            (left, top, right, bottom), before the crop.
        pad_if_needed: Pad an image smaller than ``size``; without it, such an image
            is an error naming its size.
        fill: Image padding value, an int or (R, G, B).
        mask_fill: Mask padding value.
        pad_at: ``"both"`` or ``"end"`` (see above).

    Raises:
        ValueError: bad parameters, with the value.
    """

    def __init__(self, size: int | Sequence[int], padding: int | Sequence[int] | None = None,
                 pad_if_needed: bool = True, fill: int | Sequence[int] = 0, mask_fill: int = 255,
                 pad_at: str = "both") -> None:
        self.output_size = _size2(size, "RandomCrop")
        self.padding = _padding4(padding)
        if not isinstance(pad_if_needed, bool):
            raise ValueError(f"RandomCrop: pad_if_needed must be True or False, got {pad_if_needed!r}")
        if pad_at not in ("both", "end"):
            raise ValueError(f"RandomCrop: pad_at must be 'both' or 'end', got {pad_at!r}")
        self.pad_if_needed, self.pad_at = pad_if_needed, pad_at
        self.fill = _fill3(fill, "RandomCrop")
        self.mask_fill = _mask_fill(mask_fill, "RandomCrop")

    def window(self, height: int, width: int, rng: SampleRNG) -> tuple[int, int]:
        """(top, left) of the crop in input pixels (negative: in the padding)."""
        h, w = self.output_size
        left, top, right, bottom = self.padding
        ph, pw = height + top + bottom, width + left + right
        if self.pad_if_needed:
            dy, dx = max(0, h - ph), max(0, w - pw)
            if self.pad_at == "both":
                top, bottom, left, right = top + dy, bottom + dy, left + dx, right + dx
            else:
                bottom, right = bottom + dy, right + dx
            ph, pw = height + top + bottom, width + left + right
        if ph < h or pw < w:
            raise ValueError(f"RandomCrop: a ({height}, {width}) image (height, width), padded to "
                             f"({ph}, {pw}), is smaller than the crop ({h}, {w}); pass "
                             f"pad_if_needed=True")
        return rng.integers(0, ph - h + 1) - top, rng.integers(0, pw - w + 1) - left

    def apply(self, img, rng, out=None, ctx=None):
        return self.apply_geometry(img, rng, out, ctx)[0]

    def apply_geometry(self, img, rng, out=None, ctx=None):
        H, W = img.shape[:2]
        h, w = self.output_size
        top, left = self.window(H, W, rng)
        y0, y1, x0, x1 = max(0, top), min(H, top + h), max(0, left), min(W, left + w)
        inside = img[y0:y1, x0:x1]
        if out is None or out.shape != (h, w, 3) or out.dtype != np.uint8:
            out = np.empty((h, w, 3), np.uint8)
        if inside.shape[:2] != (h, w):  # some of the window is padding
            if self.fill[0] == self.fill[1] == self.fill[2]:
                out.fill(self.fill[0])
            else:  # numpy broadcasting a 3-tuple is ~30x slower than OpenCV's fill
                cv2.rectangle(out, (0, 0), (w - 1, h - 1), self.fill, -1)
        if y1 > y0 and x1 > x0:
            out[y0 - top:y1 - top, x0 - left:x1 - left] = inside
        return out, Geometry(1.0, float(-top), 1.0, float(-left), h, w, self.mask_fill)

    def __repr__(self) -> str:
        return (f"RandomCrop({self.output_size}, padding={self.padding}, pad_if_needed="
                f"{self.pad_if_needed}, fill={self.fill}, mask_fill={self.mask_fill}, pad_at={self.pad_at!r})")
