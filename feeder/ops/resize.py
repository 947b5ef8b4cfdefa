"""Resizes on uint8 [H, W, 3] images: :class:`Resize`, :class:`RandomResize` and
:class:`RandomResizedCrop`, each reporting the :class:`~feeder.ops.Geometry` it applied."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import cv2
import numpy as np

from ..sample.rng import SampleRNG, _mix
from .base import (SampleContext, Transform, _choose, _crop_resize, _interp, _resize_into,
                   _resize_with_geometry, _size2, _whole, _window_box, check_flag, check_range)


# RandomResizedCrop's ten tries in C, the same double operations in the same
# order as its Python loop (the extension's rrc_draws), or None: the Python loop. Installed by the
# layer that loads the extension (feeder.decode.extension), which sits above this one.
_native_draws: Any = None
# RandomResizedCrop's bilinear resize and antialiased shrink in C (the
# extension's ``resize``), or None: cv2.resize (INTER_LINEAR, INTER_AREA). The
# extension's region decoder runs the same code on a crop in the same call as
# its decode (the fused path, ``FusedCrop``): a sample gets the same bytes
# whichever path it takes.
_native_resize: Any = None
#: The largest shrink per side that the extension's area shrink takes (its
#: 12-bit weights keep it within one level of cv2's INTER_AREA up to there;
#: ``_jpeg.c``'s fused call has the same bound). Larger ones take cv2's.
MAX_AREA_SHRINK = 6


def use_native_draws(draws: Any, resize: Any = None) -> None:
    """Draw RandomResizedCrop's tries with ``draws`` (the extension's
    ``rrc_draws``) and resize its crops (bilinear, and the antialiased shrink)
    with ``resize`` (the extension's); None: in Python, with cv2."""
    global _native_draws, _native_resize
    _native_draws = draws
    _native_resize = resize


def _bilinear_into(crop: np.ndarray, size: tuple[int, int], out: np.ndarray | None,
                   area: bool = False) -> np.ndarray:
    """RandomResizedCrop's bilinear resize of ``crop`` to ``size`` (``area``: its
    antialiased shrink, ``size`` no larger than the crop on either side): into
    ``out`` when it is a slot of that size, else into a new array."""
    resize = _native_resize
    h, w = size
    if resize is None or crop.dtype != np.uint8 or crop.ndim != 3 or crop.shape[2] != 3:
        return _resize_into(crop, size, cv2.INTER_AREA if area else cv2.INTER_LINEAR, out)
    if crop.strides[1:] != (3, 1) or crop.strides[0] < 0:
        # (the RGB of given RGBA pixels, a flipped view): rows of packed pixels
        crop = np.ascontiguousarray(crop)
    if out is None or out.shape != (h, w, 3) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        out = np.empty((h, w, 3), np.uint8)
    resize(crop, out, area=area)
    return out


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
            "nearest" takes the pixel under each output pixel's centre, as a
            mask follows (torch's "nearest-exact"; its "nearest" and cv2's
            INTER_NEAREST take ``floor(j * in / out)``, half a pixel off).
            "bilinear" samples at the half-pixel centres as cv2's INTER_LINEAR
            and torch's ``align_corners=False`` do, with feeder's own resize
            where its C extension is built: integer weights of 1/256, the same
            bytes on every CPU, within one level of cv2's (which rounds
            differently in its vector loop and its scalar tail). That resize
            runs in the same call as the region decode of a JPEG (decode, crop,
            resize and the flip after it in one call without the GIL), and a
            sample gets the same bytes whichever path it takes. Without the
            extension, cv2's INTER_LINEAR.
        antialias: Use area averaging when bilinear would shrink by more than 2x
            (with the extension built and the bilinear interpolation, its own
            where neither side grows nor shrinks more than 6x: integer weights
            of 1/4096, the same bytes on every CPU, within one level of cv2's
            INTER_AREA, in the same call as the region decode; otherwise cv2's
            INTER_AREA, as ``interpolation="area"`` always is).
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
        draws = _native_draws
        if draws is not None and type(rng) is SampleRNG:
            # The loop below in C, on the rng's state (a call per draw costs as
            # much as the draw): the same double operations in the same order,
            # so the same boxes and the same state after, bit for bit.
            z = rng._state
            if z < 0:  # the stream's first draw
                z = _mix(~z)
            found = draws(z, area, height, width, lo, hi - lo, log_lo, log_hi - log_lo)
            rng._state = found[-1]
            if found[0] is not None:
                return found[:4]
        else:
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

    def _area(self, h: int, w: int) -> bool | None:
        """Whether a crop of ``h`` x ``w`` takes the extension's antialiased shrink
        (False: the bilinear resize; None: cv2's resize: another interpolation,
        a shrink that grows the other side, or one of more than
        :data:`MAX_AREA_SHRINK` on a side)."""
        if self._interp != cv2.INTER_LINEAR:
            return None
        interpolation = _choose(self._interp, self.antialias, (h, w), self.output_size)
        if interpolation == cv2.INTER_LINEAR:
            return False
        oh, ow = self.output_size
        if oh <= h <= MAX_AREA_SHRINK * oh and ow <= w <= MAX_AREA_SHRINK * ow:
            return True
        return None

    def _resize(self, crop: np.ndarray, h: int, w: int, out: np.ndarray | None) -> np.ndarray:
        area = self._area(h, w)
        if area is not None:
            return _bilinear_into(crop, self.output_size, out, area)
        return _resize_into(crop, self.output_size,
                            _choose(self._interp, self.antialias, (h, w), self.output_size), out)

    def fused_box(self, shape: tuple[int, int], rng: SampleRNG,
                  ctx: SampleContext) -> tuple[tuple[int, int, int, int], bool] | None:
        """For a region decode (``ctx.origin`` set) of ``shape`` (height, width): the
        box (top, left, height, width, in the region's pixels) that :meth:`apply`
        would crop and resize with the extension's resize, and whether with its
        antialiased shrink; None when it would take cv2's (another
        interpolation, a shrink of one side that grows the other)."""
        top, left, h, w = self._box(shape[0], shape[1], rng, ctx)
        area = self._area(h, w)
        if area is None:
            return None
        top, left = _window_box(ctx, top, left, h, w, shape, self)
        return (top, left, h, w), area

    def apply(self, img, rng, out=None, ctx=None):
        box = self._box(img.shape[0], img.shape[1], rng, ctx)
        return self._resize(self._crop(img, box, ctx), box[2], box[3], out)

    def apply_geometry(self, img, rng, out=None, ctx=None):
        top, left, h, w = box = self._box(img.shape[0], img.shape[1], rng, ctx)
        oh, ow = self.output_size
        result = self._resize(self._crop(img, box, ctx), h, w, out)
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
