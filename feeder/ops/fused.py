"""Steps fused for speed.

:class:`ResizeCenterCrop`: ``Resize(int)`` followed by ``CenterCrop``, fused into
one step that computes only the pixels the crop keeps (and reads only the
region of the image they come from).

:class:`FusedCrop`: a chain's leading ``RandomResizedCrop`` (bilinear) and the
flip after it, handed to the region decoder, which decodes, crops, resizes and
flips into the batch slot in one call without the GIL (a small image's sample
otherwise passes the GIL four times and runs some 70 Python calls)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import cv2
import numpy as np

from ..sample import SampleContext, SampleRNG
from .base import Geometry, Transform, _choose, dct_denom, name_transform, nearest_rows
from .crop import CenterCrop
from .flip import RandomHorizontalFlip
from ..sample.rng import _GOLDEN, _MASK
from .resize import RandomResizedCrop, Resize


class FusedCrop:
    """What the region decoder does for a chain that starts with a bilinear
    :class:`~feeder.ops.RandomResizedCrop` (optionally followed by a
    :class:`~feeder.ops.RandomHorizontalFlip`): the crop's box in the decoded
    region and whether to flip, drawn exactly as the chain draws them, so the
    fused decode writes the bytes the chain would (the resize is the
    extension's ``resize`` in both).

    Args:
        crop: The chain's first step, and its position in the chain (its draws'
            stream).
        flip: The flip right after it and its position, or None.
    """

    __slots__ = ("crop", "crop_at", "flip", "flip_at", "rest", "crop_stream", "flip_stream",
                 "draw_args", "call_args")

    def __init__(self, crop: tuple[int, RandomResizedCrop],
                 flip: tuple[int, RandomHorizontalFlip] | None,
                 rest: Sequence[tuple[int, Transform]] = ()) -> None:
        self.crop_at, self.crop = crop
        self.flip_at, self.flip = flip if flip is not None else (-1, None)
        #: The chain's in-place steps after these, run by :meth:`finish`.
        self.rest = list(rest)
        # For JpegDecoder.fused, whose extension call spells out
        # SampleRNG(key, at)'s first mix (of key + stream) and RandomResizedCrop's
        # draws (as its rrc_draws, which RandomResizedCrop.params calls).
        self.crop_stream = (self.crop_at + 1) * _GOLDEN & _MASK
        self.flip_stream = (self.flip_at + 1) * _GOLDEN & _MASK
        t = self.crop
        lo, hi = t.scale
        log_lo, log_hi = math.log(t.ratio[0]), math.log(t.ratio[1])
        self.draw_args = (lo, hi - lo, log_lo, log_hi - log_lo)
        #: The extension's fused arguments these steps decide, in its order: the
        #: streams, the flip's p (-1: none), the draws' terms, the output's
        #: (height, width) and whether it is antialiased.
        self.call_args = (self.crop_stream, self.flip_stream, -1.0 if self.flip is None else self.flip.p,
                          *self.draw_args, *t.output_size, t.antialias)

    @classmethod
    def of(cls, steps: list[tuple[int, Transform]],
           tail: list[tuple[int, Transform]]) -> "FusedCrop | None":
        """The fused steps of a chain whose compiled ``steps`` start with a bilinear
        RandomResizedCrop that writes the slot, ``tail`` the in-place steps after
        it; None when they do not."""
        if not steps or type(steps[0][1]) is not RandomResizedCrop:
            return None
        if steps[0][1]._interp != cv2.INTER_LINEAR:
            return None
        flip = tail[0] if tail and type(tail[0][1]) is RandomHorizontalFlip else None
        return cls(steps[0], flip, tail[1:] if flip is not None else tail)  # type: ignore[arg-type]

    def finish(self, key: int, out: np.ndarray) -> tuple[int, int]:
        """The rest of the chain on ``out``, which holds what the fused steps
        wrote, in place; returns its (height, width), as ``Chain.run``."""
        t = None
        try:
            for i, t in self.rest:
                t.apply(out, SampleRNG(key, i), out, None)
        except Exception as exc:
            name_transform(exc, t)
            raise
        return out.shape[0], out.shape[1]

    def spec(self, ctx: SampleContext, shape: tuple[int, int],
             key: int) -> tuple[tuple[int, int, int, int], bool, bool] | None:
        """For the sample of ``key`` whose region, of ``shape`` (height, width),
        ``ctx`` describes (``origin``, ``scaled_size``, ``scale`` and the crop's
        ``plan``): the box in the region to resize, whether to flip it and
        whether the resize is the antialiased shrink; None when the crop takes
        another path (cv2's resize)."""
        found = self.crop.fused_box(shape, SampleRNG(key, self.crop_at), ctx)
        if found is None:
            return None
        box, area = found
        flip = self.flip
        return box, flip is not None and SampleRNG(key, self.flip_at).random() < flip.p, area

def _kept(resized: int, crop: int) -> tuple[int, int, int]:
    """Along one axis of a centre crop of a ``resized``-long image: (first resized
    pixel kept, pixels kept, offset in the crop). A crop longer than the image keeps
    it all, zero-padded (the larger half of the padding after it, as CenterCrop)."""
    if resized >= crop:
        return int(round((resized - crop) / 2.0)), crop, 0
    return 0, resized, (crop - resized) // 2


# Source pixels read beyond a window's edge: the widest kernel (Lanczos-4)
# reaches 4 pixels out, so a window this much larger than the pixels it maps to
# never sees its own edge, only the image's (replicated, as cv2.resize does).
_MARGIN = 5
# cv2.warpAffine keeps source coordinates as int16.
_WARP_LIMIT = 32000


def _span(a: int, n: int, f: float, length: int) -> tuple[int, int]:
    """Source pixels cv2.resize reads for resized pixels [a, a + n) at ``f`` source
    pixels per resized pixel (it samples resized pixel j at (j + 0.5) * f - 0.5)."""
    lo = math.floor((a + 0.5) * f - 0.5) - _MARGIN
    hi = math.ceil((a + n - 0.5) * f - 0.5) + _MARGIN + 1
    return max(0, lo), min(length, hi)


def _window_spans(target: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int],
                  interpolation: int, size: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The rows and columns of a ``size`` image that :func:`_resize_window` reads, or None
    when it needs the whole image (an area shrink, a window too long for warpAffine)."""
    H, W = size
    th, tw = target
    (ay, ny), (ax, nx) = rows, cols
    fy, fx = H / th, W / tw
    if interpolation == cv2.INTER_AREA and th <= H and tw <= W:
        return None
    if interpolation in (cv2.INTER_NEAREST, cv2.INTER_AREA):
        # Nearest and the area upscale read around floor(j * f), within the margin.
        def wide(a: int, n: int, f: float, length: int) -> tuple[int, int]:
            return (max(0, math.floor(a * f) - _MARGIN - 1),
                    min(length, math.ceil((a + n) * f) + _MARGIN + 2))
        return wide(ay, ny, fy, H), wide(ax, nx, fx, W)
    (y0, y1), (x0, x1) = _span(ay, ny, fy, H), _span(ax, nx, fx, W)
    if max(y1 - y0, x1 - x0) >= _WARP_LIMIT:
        return None
    return (y0, y1), (x0, x1)


def _resize_window(img: np.ndarray, target: tuple[int, int], rows: tuple[int, int],
                   cols: tuple[int, int], interpolation: int, full: tuple[int, int] | None = None,
                   origin: tuple[int, int] = (0, 0), dst: np.ndarray | None = None) -> np.ndarray:
    """Pixels ``rows`` x ``cols`` ((first, count) each) of ``img`` resized to
    ``target``, computed without the rest of the resized image.

    ``full`` and ``origin``: ``img`` is only the window at ``origin`` (y, x) of a
    ``full``-sized image (a region decode), holding at least what
    :func:`_window_spans` names; the result is the same as from the whole image.
    ``dst``: a uint8 array of the result's shape that the usual (bilinear or
    bicubic) path writes into, to spare a copy into the batch; the caller checks
    whether the result is ``dst``."""
    whole = full is None
    H, W = img.shape[:2] if whole else full
    oy, ox = origin
    th, tw = target
    (ay, ny), (ax, nx) = rows, cols
    if interpolation == cv2.INTER_AREA and th <= H and tw <= W:
        # A shrink: the whole resized image is smaller than the decoded one, so
        # computing it costs less than decoding did, and is exact.
        _need_whole(whole)
        return cv2.resize(img, (tw, th), interpolation=interpolation)[ay:ay + ny, ax:ax + nx]
    if interpolation == cv2.INTER_NEAREST:
        # The resize's nearest neighbour (see base.nearest_rows), over the window.
        ys = nearest_rows(th, H)[ay:ay + ny]
        xs = nearest_rows(tw, W)[ax:ax + nx]
        return img[(ys - oy)[:, None], (xs - ox)[None, :]]
    if interpolation == cv2.INTER_AREA:
        return _area_upscale_window(img, target, rows, cols, (H, W), origin)
    fy, fx = H / th, W / tw  # source pixels per resized pixel
    y0, y1 = _span(ay, ny, fy, H)
    x0, x1 = _span(ax, nx, fx, W)
    if max(y1 - y0, x1 - x0) >= _WARP_LIMIT:
        # A window too long for warpAffine (a large shrink without antialiasing):
        # resizing the whole image costs no more than decoding it did.
        _need_whole(whole)
        return cv2.resize(img, (tw, th), interpolation=interpolation)[ay:ay + ny, ax:ax + nx]
    # The same sampling positions as cv2.resize, over the window only.
    m = np.array([[fx, 0.0, (ax + 0.5) * fx - 0.5 - x0],
                  [0.0, fy, (ay + 0.5) * fy - 0.5 - y0]])
    src = img[y0 - oy:y1 - oy, x0 - ox:x1 - ox]
    if dst is not None and dst.shape == (ny, nx) + src.shape[2:] and dst.dtype == src.dtype:
        return cv2.warpAffine(src, m, (nx, ny), dst=dst, flags=interpolation | cv2.WARP_INVERSE_MAP,
                              borderMode=cv2.BORDER_REPLICATE)
    return cv2.warpAffine(src, m, (nx, ny), flags=interpolation | cv2.WARP_INVERSE_MAP,
                          borderMode=cv2.BORDER_REPLICATE)


def _need_whole(whole: bool) -> None:
    if not whole:  # _window_spans said None: the decoder was asked for the whole image
        raise RuntimeError("a resize window needs the whole image but got a region (a bug in feeder)")


def _area_upscale_window(img: np.ndarray, target: tuple[int, int], rows: tuple[int, int],
                         cols: tuple[int, int], full: tuple[int, int],
                         origin: tuple[int, int]) -> np.ndarray:
    """As :func:`_resize_window` for INTER_AREA when not shrinking both sides:
    cv2.resize then blends two source pixels with weights of its own, reproduced
    here as sampling positions for cv2.remap."""

    def coords(a: int, n: int, total: int, length: int) -> tuple[np.ndarray, int, int]:
        inv = total / length
        j = np.arange(a, a + n, dtype=np.float64)
        sx = np.floor(j * (1.0 / inv))
        frac = (j + 1) - (sx + 1) * inv
        frac = np.where(frac <= 0, 0.0, frac - np.floor(frac))
        lo = max(0, int(sx[0]) - _MARGIN)
        hi = min(length, int(sx[-1]) + _MARGIN + 2)
        return (sx + frac - lo).astype(np.float32), lo, hi

    H, W = full
    oy, ox = origin
    ys, y0, y1 = coords(rows[0], rows[1], target[0], H)
    xs, x0, x1 = coords(cols[0], cols[1], target[1], W)
    map_x = np.broadcast_to(xs[None, :], (rows[1], cols[1]))
    map_y = np.broadcast_to(ys[:, None], (rows[1], cols[1]))
    return cv2.remap(img[y0 - oy:y1 - oy, x0 - ox:x1 - ox], np.ascontiguousarray(map_x), np.ascontiguousarray(map_y),
                     cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)


class ResizeCenterCrop(Transform):
    """``Resize(int)`` then ``CenterCrop``, computing only the pixels the crop keeps.

    The feeder's chain uses it in place of that pair: resizing the shorter side of
    a very elongated image first would build an image far larger than the crop
    (a 2x60000 image resized to a 256 shorter side has 2 billion pixels). The
    result equals the pair's up to the rounding of interpolation weights.

    Args:
        resize: A :class:`Resize` with an int size (shorter side).
        crop: The :class:`CenterCrop` applied after it.
    """

    def __init__(self, resize: Resize, crop: CenterCrop) -> None:
        if resize.shorter is None:
            raise ValueError("ResizeCenterCrop: the Resize must have an int size (shorter side)")
        self.resize = resize
        self.crop = crop
        self.output_size = crop.output_size

    def decode_hint(self, height, width, rng, ctx=None):
        return self.resize.decode_hint(height, width, rng, ctx)

    def decode_box(self, height, width, ctx):
        # What the resize window reads, at the scale the decoder will pick for
        # this target (dct_denom), in full-size pixels.
        target = self.resize.target(height, width)
        d = dct_denom(height, width, target)
        size = (-(-height // d), -(-width // d))
        interp = _choose(self.resize._interp, self.resize.antialias, size, target)
        (ay, ny, _), (ax, nx, _) = (_kept(t, c) for t, c in zip(target, self.output_size))
        spans = _window_spans(target, (ay, ny), (ax, nx), interp, size)
        if spans is None:
            return 0, 0, height, width
        (y0, y1), (x0, x1) = spans
        return y0 * d, x0 * d, min(height, y1 * d) - y0 * d, min(width, x1 * d) - x0 * d

    def apply(self, img, rng, out=None, ctx=None):
        windowed = ctx is not None and ctx.origin is not None
        H, W = ctx.scaled_size if windowed else img.shape[:2]
        target = self.resize.planned_size(H, W, ctx)
        interp = _choose(self.resize._interp, self.resize.antialias, (H, W), target)
        (ay, ny, oy), (ax, nx, ox) = (_kept(t, c) for t, c in zip(target, self.output_size))
        h, w = self.output_size
        if out is None or out.shape != (h, w, 3) or out.dtype != np.uint8:
            out = np.empty((h, w, 3), np.uint8)
        if (ny, nx) != (h, w):
            out[...] = 0  # the padding of a crop larger than the resized image
        # The window is resampled straight into its place in ``out`` (the batch
        # slot) where the path allows, else copied there.
        dst = out[oy:oy + ny, ox:ox + nx]
        if windowed and img.shape[:2] != (H, W):
            window = _resize_window(img, target, (ay, ny), (ax, nx), interp, (H, W), ctx.origin, dst)
        else:
            window = _resize_window(img, target, (ay, ny), (ax, nx), interp, dst=dst)
        if window is not dst:
            np.copyto(dst, window)
        return out

    def apply_geometry(self, img, rng, out=None, ctx=None):
        windowed = ctx is not None and ctx.origin is not None
        H, W = ctx.scaled_size if windowed else img.shape[:2]
        th, tw = target = self.resize.planned_size(H, W, ctx)
        (ay, _, oy), (ax, _, ox) = (_kept(t, c) for t, c in zip(target, self.output_size))
        h, w = self.output_size
        return (self.apply(img, rng, out, ctx),
                Geometry(th / H, float(oy - ay), tw / W, float(ox - ax), h, w))

    def __repr__(self) -> str:
        return f"{self.resize!r} + {self.crop!r}"
