"""CPU transforms on uint8 [H, W, 3] RGB arrays, and the fields that follow them.

Any plain callable ``fn(img, rng) -> img`` is a transform: ``rng`` is a
:class:`~feeder._rng.SampleRNG` drawn from (seed, epoch, sample index, position
in the chain), so results do not depend on thread counts or scheduling. A
callable that changes the image size may say so with an ``output_size``
attribute ``(height, width)``.

On samples with a mask or boxes, every built-in transform reports the
:class:`Geometry` it applied to the image and the mask and boxes are mapped
through the same geometry (nearest neighbour for masks), so they always see
the image's own crop and flip. A plain callable must then keep the geometry;
:class:`SampleTransform` wraps one that transforms whole samples.

The classes here follow torchvision's semantics and add what the engine uses
to go fast: ``output_size`` (to size the batch buffers), ``decode_hint`` (the
smallest decoded size they need, for reduced-scale JPEG decoding) and writing
the final result straight into the batch buffer (``out=``).

Batch transforms (``Feeder(batch_transforms=[...])``) run on the device, on
whole ``[B, 3, H, W]`` batches after the dtype conversion: :class:`MixUp`,
:class:`CutMix`, or any callable ``fn(images, labels, generator) -> (images,
labels)`` whose ``generator`` (a ``torch.Generator`` on the batch's device) is
seeded from (seed, epoch, batch number).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
import cv2
import numpy as np
import torch

from ._rng import SampleRNG

__all__ = ["CenterCrop", "CutMix", "Geometry", "MixUp", "RandomHorizontalFlip", "RandomResizedCrop",
           "Resize", "SampleTransform", "Transform"]

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
        box: The region (top, left, height, width) of the full-size image the
            first transform will read (from :meth:`Transform.decode_box`), for a
            decoder that can decode a region only; None: the whole image.
        origin: Set by a region decode (None otherwise): the decoded image is the
            window of the full image decoded at scale ``scale`` (of size
            ``scaled_size``) whose top-left pixel is ``origin`` (y, x).
        scaled_size: (height, width) of the whole image at ``scale``.
        scale: The decode's scale (1, 1/2, 1/4 or 1/8): pixel ``i`` of the scaled
            image covers full-size pixels ``[i / scale, (i + 1) / scale)``.
    """

    __slots__ = ("source_size", "plan", "box", "origin", "scaled_size", "scale")

    def __init__(self, source_size: tuple[int, int], plan: object = None) -> None:
        self.source_size = source_size
        self.plan = plan
        self.box: tuple[int, int, int, int] | None = None
        self.origin: tuple[int, int] | None = None
        self.scaled_size: tuple[int, int] | None = None
        self.scale = 1.0


#: JPEG DCT scale denominators used for region decoding: libjpeg-turbo's scales
#: between 1/2 and 1 (7/8, 3/4, 5/8) have no fast IDCT and cost more than a
#: full decode.
DCT_DENOMS = (8, 4, 2, 1)


def dct_denom(height: int, width: int, need: tuple[int, int] | None) -> int:
    """The largest reduction (8, 4, 2 or 1) at which a ``height`` x ``width`` JPEG,
    decoded as ``ceil(height / d)`` x ``ceil(width / d)``, still covers ``need``
    (the transforms' smallest decoded size; None: full size)."""
    if need is None:
        return 1
    nh, nw = need
    for d in DCT_DENOMS:
        if -(-height // d) >= nh and -(-width // d) >= nw:
            return d
    return 1


def _window_box(ctx: SampleContext, top: int, left: int, h: int, w: int, shape: tuple[int, int],
                who: object) -> tuple[int, int]:
    """(top, left) of the box (top, left, h, w), given in the scaled image's pixels, in
    a region-decoded image of ``shape`` (height, width); the decoder widened the
    region so that the box lies inside."""
    oy, ox = ctx.origin  # type: ignore[misc]
    t, l = top - oy, left - ox
    if t < 0 or l < 0 or t + h > shape[0] or l + w > shape[1]:
        raise RuntimeError(f"{who!r}: box {(top, left, h, w)} is outside the decoded region at "
                           f"{ctx.origin} of {shape} (a bug in feeder's region decode)")
    return t, l


class Geometry:
    """Where a transform moved the pixels: an affine map per axis from input to
    output coordinates, ``y_out = y * sy + ty`` and ``x_out = x * sx + tx``, with
    coordinates at pixel edges (pixel ``i`` spans ``[i, i + 1)``), and the output size.

    This is how a mask and boxes follow their image: every built-in transform
    reports the geometry it applied to the image (:meth:`Transform.apply_geometry`),
    the chain composes them, and the fields are mapped once, at the end.
    """

    __slots__ = ("sy", "ty", "sx", "tx", "height", "width")

    def __init__(self, sy: float, ty: float, sx: float, tx: float, height: int, width: int) -> None:
        self.sy, self.ty, self.sx, self.tx = sy, ty, sx, tx
        self.height, self.width = height, width

    @classmethod
    def identity(cls, height: int, width: int) -> "Geometry":
        return cls(1.0, 0.0, 1.0, 0.0, height, width)

    def then(self, other: "Geometry") -> "Geometry":
        """This geometry followed by ``other``."""
        return Geometry(self.sy * other.sy, self.ty * other.sy + other.ty,
                        self.sx * other.sx, self.tx * other.sx + other.tx, other.height, other.width)

    def mask(self, mask: np.ndarray) -> np.ndarray:
        """``mask`` (in input coordinates) resampled to the output, nearest neighbour.

        Output pixel ``j`` takes the input pixel under its centre, ``floor((j + 0.5
        - t) / s)`` (as OpenCV's ``INTER_NEAREST_EXACT`` and PIL's nearest), so
        class ids are never mixed; outside the input (a crop's padding) it is 0.
        """
        H, W = mask.shape[:2]
        iy = np.floor((np.arange(self.height) + 0.5 - self.ty) / self.sy).astype(np.intp)
        ix = np.floor((np.arange(self.width) + 0.5 - self.tx) / self.sx).astype(np.intp)
        vy, vx = (iy >= 0) & (iy < H), (ix >= 0) & (ix < W)
        out = mask[np.clip(iy, 0, H - 1)[:, None], np.clip(ix, 0, W - 1)[None, :]]
        if not vy.all():
            out[~vy] = 0
        if not vx.all():
            out[:, ~vx] = 0
        return out

    def boxes(self, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``boxes`` (float ``[N, 4]``, x0 y0 x1 y1 in input pixels) in output pixels,
        clipped to the output; returns them as float32 with the keep mask of the
        input rows: a box left with no area inside the output is dropped."""
        b = boxes.astype(np.float64)
        x0, x1 = b[:, 0] * self.sx + self.tx, b[:, 2] * self.sx + self.tx
        y0, y1 = b[:, 1] * self.sy + self.ty, b[:, 3] * self.sy + self.ty
        if self.sx < 0:
            x0, x1 = x1, x0
        if self.sy < 0:
            y0, y1 = y1, y0
        x0, x1 = np.clip(x0, 0, self.width), np.clip(x1, 0, self.width)
        y0, y1 = np.clip(y0, 0, self.height), np.clip(y1, 0, self.height)
        out = np.stack([x0, y0, x1, y1], axis=1).astype(np.float32)
        # Decided in float32, as delivered: a sliver can round to no width at all.
        keep = (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])
        return out[keep], keep

    def __repr__(self) -> str:
        return (f"Geometry(y*{self.sy:.4g}+{self.ty:.4g}, x*{self.sx:.4g}+{self.tx:.4g}, "
                f"{self.height}x{self.width})")


def _crop_resize(top: float, left: float, h: float, w: float, oh: int, ow: int) -> Geometry:
    """The geometry of cropping the box (top, left, h, w) and resizing it to (oh, ow)."""
    return Geometry(oh / h, -top * oh / h, ow / w, -left * ow / w, oh, ow)


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

    def apply_geometry(self, img: np.ndarray, rng: SampleRNG, out: np.ndarray | None = None,
                       ctx: SampleContext | None = None) -> tuple[np.ndarray, Geometry | None]:
        """:meth:`apply`, and the :class:`Geometry` it applied to ``img`` (what a mask
        and boxes must follow); for a region-decoded ``img`` (``ctx.origin`` set),
        from the pixels of the whole image at the decode's scale. The built-ins say; for any other transform the
        result is None, meaning "unknown": it is then accepted only when the image
        keeps its size, taken as geometry left alone (a colour change, a blur)."""
        return self.apply(img, rng, out, ctx), None

    def decode_hint(self, height: int, width: int, rng: SampleRNG,
                    ctx: SampleContext | None = None) -> tuple[int, int] | None:
        """Smallest (height, width) of the decoded image this transform needs, given the
        full size; ``rng`` is the same stream ``apply`` will get, and ``ctx`` the one
        ``apply`` will get (``ctx.plan`` may keep what was drawn). None: the full size."""
        return None

    def decode_box(self, height: int, width: int, ctx: SampleContext) -> tuple[int, int, int, int] | None:
        """The region (top, left, height, width) of a ``height`` x ``width`` image this
        transform reads, called after :meth:`decode_hint` with the same ``ctx``; None:
        all of it. A transform that returns a box must handle a region-decoded
        image in ``apply`` (``ctx.origin`` set: see :class:`SampleContext`)."""
        return None

    def planned_size(self, height: int, width: int,
                     ctx: SampleContext | None = None) -> tuple[int, int] | None:
        """(height, width) that ``apply`` will produce for an input of this size (and this
        ``ctx``), known before computing it; None when only running it can tell."""
        if self.output_size is not None:
            return self.output_size
        return (height, width) if self.preserves_size else None


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
        # cv2.resize's nearest neighbour: source pixel floor(j / (T / L)), clamped.
        ys = np.minimum(np.floor(np.arange(ay, ay + ny) * (1.0 / (th / H))).astype(np.intp), H - 1)
        xs = np.minimum(np.floor(np.arange(ax, ax + nx) * (1.0 / (tw / W))).astype(np.intp), W - 1)
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


class _ResizeCenterCrop(Transform):
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


class SampleTransform:
    """A transform of whole samples: ``fn(sample, rng) -> sample``.

    A plain callable in ``transforms`` sees the image alone (``fn(img, rng) ->
    img``) and, on samples with a mask or boxes, must keep the image's size
    (a size change is a :class:`~feeder.ConfigError` naming it; a same-size
    callable is taken to leave the geometry alone). Wrap a callable in
    ``SampleTransform`` (or decorate it with ``@ops.SampleTransform``) to have it
    see and return the whole sample instead, to move a mask and boxes itself:

    ``sample`` is a dict with the fields of the source's sample, as they stand
    at that point of the chain: ``"image"`` uint8 ``[H, W, 3]`` RGB, ``"mask"``
    uint8/uint16 ``[H, W]`` (in step with the image), ``"boxes"`` float32 ``[N,
    4]`` in the image's pixels, per-box arrays filtered with them, numbers as
    numpy arrays, other values as read (a pair's label is under ``"label"``).
    Return a dict with the same keys; a numeric field keeps its shape and
    dtype, a mask stays the image's size.

    Args:
        fn: The function.
        output_size: (height, width) of every image it returns, when fixed (as a
            plain callable's ``output_size`` attribute).
    """

    def __init__(self, fn: Callable[[dict, SampleRNG], dict],
                 output_size: tuple[int, int] | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"SampleTransform: {fn!r} is not callable")
        self.fn = fn
        size = output_size if output_size is not None else getattr(fn, "output_size", None)
        self.output_size = None if size is None else _size2(size, "SampleTransform")

    def __call__(self, sample: dict, rng: SampleRNG) -> dict:
        return self.fn(sample, rng)

    def __repr__(self) -> str:
        return f"SampleTransform({getattr(self.fn, '__qualname__', None) or self.fn!r})"


# -- batch transforms ------------------------------------------------------------


class _Mixing:
    """Shared by :class:`MixUp` and :class:`CutMix`: arguments, lam and soft targets.

    Every draw uses the generator on the batch's device, so nothing waits for the
    device (no ``.item()``): the transfer thread keeps queuing work on its stream.

    On dict batches the feeder calls :meth:`check_fields` with the batch's field
    kinds before the first batch, and :meth:`apply_with_masks` with its masks: a field whose
    pixels the transform moves must move with them, or the batch is refused.
    """

    #: Blending uint8 pixels would truncate: the feeder refuses it at construction.
    needs_float = True
    #: Whether the transform can carry a class-id mask along (CutMix pastes it;
    #: MixUp's blend has no class id to give a mixed pixel).
    moves_masks = False

    def check_fields(self, kinds: dict[str, str]) -> None:
        """Refuse a batch with fields this transform would leave out of step with the
        images it mixes.

        Args:
            kinds: Field name -> kind (``"mask"``, ``"boxes"``, ``"per-box"``,
                ``"numeric"``, ``"object"``) of the batch's fields besides the image.

        Raises:
            ValueError: naming the fields and what to do instead.
        """
        name = type(self).__name__
        masks = sorted(k for k, kind in kinds.items() if kind == "mask")
        boxes = sorted(k for k, kind in kinds.items() if kind in ("boxes", "per-box"))
        if masks and not self.moves_masks:
            raise ValueError(
                f"{name} cannot mix the mask field(s) {masks}: blending two images has no class id "
                f"to give a blended pixel, and leaving the masks unmixed would pair them with the "
                f"wrong pixels; use CutMix (which pastes the mask region with the image region), or "
                f"drop the mask from the samples")
        if boxes:
            raise ValueError(
                f"{name} cannot mix the box field(s) {boxes}: mixing two images' boxes needs them "
                f"merged, clipped to the pasted region and weighted, which {name} does not do, and "
                f"leaving them unmixed would pair them with the wrong pixels; for detection, mix "
                f"in the source (its read() can load a partner sample and merge both images' "
                f"boxes), or drop the box fields from the samples")

    def apply_with_masks(self, images: torch.Tensor, labels: torch.Tensor,
                         generator: torch.Generator, masks: dict[str, torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The transform on a batch with masks (``[B, H, W]`` integer tensors, in step
        with ``images``): returns (images, labels, masks), each mask moved as its image."""
        if masks:
            self.check_fields({k: "mask" for k in masks})
        images, labels = self(images, labels, generator)
        return images, labels, masks

    def __init__(self, alpha: float, num_classes: int, label_smoothing: float = 0.0) -> None:
        name = type(self).__name__
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
            raise ValueError(f"{name}: alpha must be a positive number, got {alpha!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"{name}: num_classes must be a positive int, got {num_classes!r}")
        if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float))
                or not 0.0 <= label_smoothing < 1.0):
            raise ValueError(f"{name}: label_smoothing must be in [0, 1), got {label_smoothing!r}")
        self.alpha = float(alpha)
        self.num_classes = num_classes
        self.label_smoothing = float(label_smoothing)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(alpha={self.alpha}, num_classes={self.num_classes}, "
                f"label_smoothing={self.label_smoothing})")

    def draw_lam(self, generator: torch.Generator) -> torch.Tensor:
        """lam ~ Beta(alpha, alpha), a float64 0-d tensor on the generator's device.

        Beta(a, a) is G1 / (G1 + G2) for two Gamma(a) draws; torch's public Beta
        takes no generator, ``_standard_gamma`` does.
        """
        conc = torch.full((2,), self.alpha, dtype=torch.float64, device=generator.device)
        g = torch._standard_gamma(conc, generator=generator)
        return g[0] / g.sum()

    def targets(self, labels: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """``lam * one_hot(labels) + (1 - lam) * one_hot(labels.flip(0))``, float32 ``[B, num_classes]``,
        with label smoothing (off = smoothing / num_classes, on = 1 - smoothing + off).

        Soft ``[B, num_classes]`` labels (from an earlier mixing transform) are
        mixed as they are, so two of these can be chained."""
        if labels.dim() == 2:
            if labels.shape[1] != self.num_classes:
                raise ValueError(f"{self!r}: soft labels have {labels.shape[1]} classes, "
                                 f"expected {self.num_classes}")
            one_hot = labels.to(torch.float32)
        else:
            off = self.label_smoothing / self.num_classes
            on = 1.0 - self.label_smoothing + off
            one_hot = torch.full((labels.shape[0], self.num_classes), off, dtype=torch.float32,
                                 device=labels.device)
            one_hot.scatter_(1, labels.long().view(-1, 1), on)
        lam = lam.to(torch.float32)
        return one_hot * lam + one_hot.flip(0) * (1.0 - lam)


class MixUp(_Mixing):
    """MixUp (Zhang et al., 2018; timm's batch mode): ``x = lam * x + (1 - lam) * x.flip(0)``
    with ``lam ~ Beta(alpha, alpha)`` drawn once per batch; labels become soft
    targets mixed with the same ``lam``. A batch with a mask or boxes is refused
    (see :meth:`check_fields`): a blended pixel has no class id.

    Args:
        alpha: Beta distribution parameter (> 0).
        num_classes: Number of classes of the soft targets (labels must be in [0, num_classes)).
        label_smoothing: Smoothing of the one-hot targets before mixing, in [0, 1).
    """

    def params(self, shape: torch.Size, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The draws for one batch of ``shape``: ``{"lam": ...}``."""
        return {"lam": self.draw_lam(generator)}

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        lam = self.params(images.shape, generator)["lam"]
        mixed = images * lam + images.flip(0) * (1.0 - lam)
        return mixed, self.targets(labels, lam)


class CutMix(_Mixing):
    """CutMix (Yun et al., 2019; timm's batch mode): a box of area about ``1 - lam``
    (``lam ~ Beta(alpha, alpha)``) is pasted from ``x.flip(0)``; ``lam`` is then
    corrected to the box's actual area (clipped at the borders) and mixes the
    soft targets. Each mask field of a dict batch gets the same box pasted from
    its partner's mask; a batch with boxes is refused (see :meth:`check_fields`).

    The box is timm's ``rand_bbox``: ``cut = int(side * sqrt(1 - lam))`` per side,
    a centre drawn uniformly in ``[0, H)`` then ``[0, W)``, and edges
    ``clip(centre -/+ cut // 2, 0, side)``.

    Args:
        alpha: Beta distribution parameter (> 0).
        num_classes: Number of classes of the soft targets (labels must be in [0, num_classes)).
        label_smoothing: Smoothing of the one-hot targets before mixing, in [0, 1).
    """

    def params(self, shape: torch.Size, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The draws for one batch of ``shape``: the box edges ``y0, y1, x0, x1``
        (int64 0-d tensors) and ``lam``, corrected to the box's area."""
        h, w = int(shape[-2]), int(shape[-1])
        dev = generator.device
        ratio = torch.sqrt(1.0 - self.draw_lam(generator))
        cut_h = (h * ratio).floor().long()
        cut_w = (w * ratio).floor().long()
        cy = torch.randint(0, h, (), generator=generator, device=dev)
        cx = torch.randint(0, w, (), generator=generator, device=dev)
        y0, y1 = (cy - cut_h // 2).clamp(0, h), (cy + cut_h // 2).clamp(0, h)
        x0, x1 = (cx - cut_w // 2).clamp(0, w), (cx + cut_w // 2).clamp(0, w)
        lam = 1.0 - ((y1 - y0) * (x1 - x0)).to(torch.float64) / float(h * w)
        return {"lam": lam, "y0": y0, "y1": y1, "x0": x0, "x1": x1}

    moves_masks = True

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels, _ = self.apply_with_masks(images, labels, generator, {})
        return images, labels

    def apply_with_masks(self, images, labels, generator, masks):
        """The transform on a batch with masks: each mask gets the same box pasted from
        its partner's mask (``mask.flip(0)``) as its image, so every pixel keeps the
        class id of the image it came from."""
        p = self.params(images.shape, generator)
        h, w = images.shape[-2], images.shape[-1]
        # A mask built on the device from the drawn edges: slicing by them would
        # need their values on the host, a wait for the device per batch.
        rows = torch.arange(h, device=images.device)
        cols = torch.arange(w, device=images.device)
        box = (((rows >= p["y0"]) & (rows < p["y1"])).view(h, 1)
               & ((cols >= p["x0"]) & (cols < p["x1"])).view(1, w))
        moved = {}
        for name, mask in masks.items():
            if mask.shape[-2:] != (h, w):
                raise ValueError(f"CutMix: mask field {name!r} is {tuple(mask.shape[-2:])}, "
                                 f"the images are {(h, w)}")
            moved[name] = torch.where(box, mask.flip(0), mask)
        return torch.where(box, images.flip(0), images), self.targets(labels, p["lam"]), moved
