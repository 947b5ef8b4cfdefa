"""Crops on uint8 [H, W, 3] images: :class:`CenterCrop` and :class:`RandomCrop`,
each reporting the :class:`~feeder.ops.Geometry` it applied."""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np

from ..sample.rng import SampleRNG
from .base import Geometry, Transform, _size2, _window_box


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
            else:  # OpenCV's fill: numpy broadcasting a 3-tuple is much slower
                cv2.rectangle(out, (0, 0), (w - 1, h - 1), self.fill, -1)
        if y1 > y0 and x1 > x0:
            out[y0 - top:y1 - top, x0 - left:x1 - left] = inside
        return out, Geometry(1.0, float(-top), 1.0, float(-left), h, w, self.mask_fill)

    def __repr__(self) -> str:
        return (f"RandomCrop({self.output_size}, padding={self.padding}, pad_if_needed="
                f"{self.pad_if_needed}, fill={self.fill}, mask_fill={self.mask_fill}, pad_at={self.pad_at!r})")
