"""Where a sample's pixels are and where they went: :class:`SampleContext` (what
the decode tells the transforms), :class:`Geometry` (how a transform moved the
pixels) and :func:`move_fields` (the mask, boxes, per-instance masks and
keypoints moved with their image). Ops and decoding both build on these."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError
from .fields import BOXES, INSTANCE_MASKS, KEYPOINTS, MASK, per_box
from .parse import instances_fit


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


def check_mask_fill(fill: int, mask: np.ndarray, who: object = None) -> None:
    """Refuse a ``mask_fill`` the sample's mask cannot hold (300 in an 8-bit mask):
    written as it is, it would saturate to 255 or wrap. Checked on every sample,
    whether or not this one gets padding, so the first sample says it; the masks
    of a feeder all have one dtype, so it is a :class:`~feeder.ConfigError`
    (never skipped), for the ``"mask"`` field.

    Raises:
        ConfigError: naming ``who`` (the transform), the field and the value.
    """
    top = np.iinfo(mask.dtype).max
    if fill > top:
        by = "" if who is None else f"{who!r}: "
        err = ConfigError(f"{by}mask_fill={fill} does not fit the sample's {mask.dtype} mask (field "
                          f"{MASK!r}, at most {top}); use a mask_fill that does, or 16-bit masks")
        err.field = MASK
        raise err


# Added before the floor of an input coordinate: an output pixel's centre that
# falls exactly on a boundary between input pixels (a ratio of sizes) computes
# to a hair either side of it depending on the arithmetic's order; this takes
# the later pixel in every case. Centres off a boundary lie at least
# 1 / (2 * output size) from it, far above it.
TIE = 1e-7


def nearest_index(coordinate: np.ndarray) -> np.ndarray:
    """The input pixel under each of ``coordinate`` (input pixels, float): its floor,
    a boundary taking the later pixel (see :data:`TIE`)."""
    return np.floor(coordinate + TIE).astype(np.intp)


class Geometry:
    """Where a transform moved the pixels: an affine map per axis from input to
    output coordinates, ``y_out = y * sy + ty`` and ``x_out = x * sx + tx``, with
    coordinates at pixel edges (pixel ``i`` spans ``[i, i + 1)``), and the output size.

    This is how a mask and boxes follow their image: every built-in transform
    reports the geometry it applied to the image (:meth:`Transform.apply_geometry`),
    the chain composes them, and the fields are mapped once, at the end.
    """

    __slots__ = ("sy", "ty", "sx", "tx", "height", "width", "fill", "valid", "order", "unmapped")

    def __init__(self, sy: float, ty: float, sx: float, tx: float, height: int, width: int,
                 fill: int | None = None,
                 valid: tuple[float, float, float, float] | None = None) -> None:
        self.sy, self.ty, self.sx, self.tx = sy, ty, sx, tx
        self.height, self.width = height, width
        #: The mask value of output pixels outside the input (a crop's padding);
        #: None: 0. Composed geometries keep the last one given.
        self.fill = fill
        #: (y0, y1, x0, x1) of the output that still holds input pixels after every
        #: step composed so far: a step that shifts pixels out of its frame loses
        #: them, even when a later crop's window reaches where they would be. None:
        #: no step has cut anything yet.
        self.valid = valid
        #: Keypoint ``k`` of the output is keypoint ``order[k]`` of the input (a
        #: mirroring flip swaps left and right); None: each keeps its place.
        self.order: np.ndarray | None = None
        #: A flip without a ``keypoint_flip`` map took part (the transform): it
        #: cannot move keypoints, flipped or not. None: none did.
        self.unmapped: object = None

    @classmethod
    def identity(cls, height: int, width: int) -> "Geometry":
        return cls(1.0, 0.0, 1.0, 0.0, height, width)

    def then(self, other: "Geometry") -> "Geometry":
        """This geometry followed by ``other``."""
        if self.valid is None:
            y0, y1, x0, x1 = -math.inf, math.inf, -math.inf, math.inf
        else:
            y0, y1, x0, x1 = self.valid
            y0, y1 = sorted((y0 * other.sy + other.ty, y1 * other.sy + other.ty))
            x0, x1 = sorted((x0 * other.sx + other.tx, x1 * other.sx + other.tx))
        # This geometry's own frame, mapped by ``other``, bounds what ``other``
        # can show of the input; so does ``other``'s output frame.
        fy = sorted((other.ty, self.height * other.sy + other.ty))
        fx = sorted((other.tx, self.width * other.sx + other.tx))
        valid = (max(y0, fy[0], 0.0), min(y1, fy[1], float(other.height)),
                 max(x0, fx[0], 0.0), min(x1, fx[1], float(other.width)))
        out = Geometry(self.sy * other.sy, self.ty * other.sy + other.ty,
                       self.sx * other.sx, self.tx * other.sx + other.tx, other.height, other.width,
                       other.fill if other.fill is not None else self.fill, valid)
        if self.order is None or other.order is None:
            out.order = self.order if other.order is None else other.order
        else:
            out.order = self.order[other.order]
        out.unmapped = self.unmapped if self.unmapped is not None else other.unmapped
        return out

    def _sampled(self, H: int, W: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For each output row and column, the input row and column under its centre
        (clipped into the input) and whether it holds an input pixel."""
        # A centre that falls exactly on a boundary between input pixels takes the
        # later one whichever way the float rounding went (TIE: see nearest_index).
        iy = nearest_index((np.arange(self.height) + 0.5 - self.ty) / self.sy)
        ix = nearest_index((np.arange(self.width) + 0.5 - self.tx) / self.sx)
        vy, vx = (iy >= 0) & (iy < H), (ix >= 0) & (ix < W)
        if self.valid is not None:
            y0, y1, x0, x1 = self.valid
            cy, cx = np.arange(self.height) + 0.5, np.arange(self.width) + 0.5
            vy &= (cy >= y0) & (cy < y1)
            vx &= (cx >= x0) & (cx < x1)
        return np.clip(iy, 0, H - 1), np.clip(ix, 0, W - 1), vy, vx

    def mask(self, mask: np.ndarray) -> np.ndarray:
        """``mask`` (in input coordinates) resampled to the output, nearest neighbour.

        Output pixel ``j`` takes the input pixel under its centre, ``floor((j + 0.5
        - t) / s)`` (as OpenCV's ``INTER_NEAREST_EXACT`` and PIL's nearest), so
        class ids are never mixed; outside the input (a crop's padding) it is
        :attr:`fill` (0 when None).
        """
        iy, ix, vy, vx = self._sampled(*mask.shape[:2])
        out = mask[iy[:, None], ix[None, :]]
        fill = self.fill or 0
        check_mask_fill(fill, mask)  # an 8-bit mask (a palette or gray PNG) holds up to 255
        if not vy.all():
            out[~vy] = fill
        if not vx.all():
            out[:, ~vx] = fill
        return out

    def instance_masks(self, masks: np.ndarray) -> np.ndarray:
        """Per-instance ``masks`` (uint8 ``[N, H, W]``, input coordinates) resampled to
        the output as :meth:`mask` resamples a mask, but 0 outside the input (a
        crop's padding holds no instance, whatever the mask fill)."""
        iy, ix, vy, vx = self._sampled(*masks.shape[1:])
        out = np.take(np.take(masks, iy, axis=1), ix, axis=2)
        if not vy.all():
            out[:, ~vy] = 0
        if not vx.all():
            out[:, :, ~vx] = 0
        return out

    def keypoints(self, points: np.ndarray) -> np.ndarray:
        """``points`` (float ``[N, K, 3]``: x, y, visibility in input pixels) in output
        pixels, reordered by :attr:`order`; a keypoint outside the output (or
        invisible) becomes ``(0, 0, 0)``, COCO's "not labelled".

        Raises:
            ConfigError: a flip without a ``keypoint_flip`` map took part, the map
                is for another number of keypoints, or the geometry mirrors the
                image with no map at all.
        """
        K = points.shape[1]
        if self.unmapped is not None:
            err = ConfigError(f"{self.unmapped!r} flips samples with keypoints ({K} a box, field "
                              f"{KEYPOINTS!r}) but has no keypoint_flip map, so it cannot tell "
                              f"which keypoints swap left and right: give "
                              f"keypoint_flip=ops.COCO_PERSON_KEYPOINT_FLIP for COCO's 17 person "
                              f"keypoints, the map of yours, or list(range({K})) to swap none")
            err.field = KEYPOINTS
            raise err
        mirrored = (self.sx < 0) != (self.sy < 0)
        if (self.order is not None and len(self.order) != K) or (mirrored and self.order is None):
            what = ("the transforms mirror the image and none gives a keypoint_flip map"
                    if self.order is None else f"the keypoint_flip map has {len(self.order)} entries")
            err = ConfigError(f"samples have {K} keypoints a box (field {KEYPOINTS!r}) but {what}: "
                              f"give a flip keypoint_flip= with one entry per keypoint")
            err.field = KEYPOINTS
            raise err
        p = points if self.order is None else points[:, self.order]
        out = np.empty_like(p)
        x = p[..., 0] * np.float32(self.sx) + np.float32(self.tx)
        y = p[..., 1] * np.float32(self.sy) + np.float32(self.ty)
        vy0, vy1, vx0, vx1 = (0.0, self.height, 0.0, self.width) if self.valid is None else self.valid
        inside = (x >= vx0) & (x <= vx1) & (y >= vy0) & (y <= vy1) & (p[..., 2] != 0)
        out[..., 0] = np.where(inside, x, 0)
        out[..., 1] = np.where(inside, y, 0)
        out[..., 2] = np.where(inside, p[..., 2], 0)
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
        vy0, vy1, vx0, vx1 = (0.0, self.height, 0.0, self.width) if self.valid is None else self.valid
        x0, x1 = np.clip(x0, vx0, vx1), np.clip(x1, vx0, vx1)
        y0, y1 = np.clip(y0, vy0, vy1), np.clip(y1, vy0, vy1)
        out = np.stack([x0, y0, x1, y1], axis=1).astype(np.float32)
        # Decided in float32, as delivered: a sliver can round to no width at all.
        keep = (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])
        return out[keep], keep

    def __repr__(self) -> str:
        return (f"Geometry(y*{self.sy:.4g}+{self.ty:.4g}, x*{self.sx:.4g}+{self.tx:.4g}, "
                f"(height, width)=({self.height}, {self.width}))")


def move_fields(fields: dict[str, Any], geometry: Geometry,
                max_pixels: int | None = None) -> dict[str, Any]:
    """``fields`` with the mask and boxes (and their per-box fields) mapped through
    ``geometry``: the mask resampled (nearest), the boxes mapped, clipped, and
    dropped with their per-box rows when nothing of them is left; per-instance
    masks and keypoints filtered with their boxes, then moved (see
    :meth:`Geometry.instance_masks`, :meth:`Geometry.keypoints`).

    Args:
        max_pixels: The bound on one sample's per-instance masks, in bytes,
            checked before they are resampled (None: not checked).
    """
    if MASK not in fields and BOXES not in fields:
        return fields
    out = dict(fields)
    if MASK in fields:
        out[MASK] = geometry.mask(fields[MASK])
    if BOXES in fields:
        out[BOXES], keep = geometry.boxes(fields[BOXES])
        if not keep.all():
            for name, value in fields.items():
                if per_box(name):
                    out[name] = value[keep]
        if INSTANCE_MASKS in out:
            if max_pixels is not None:
                instances_fit(len(out[INSTANCE_MASKS]), (geometry.height, geometry.width), max_pixels)
            out[INSTANCE_MASKS] = geometry.instance_masks(out[INSTANCE_MASKS])
        if KEYPOINTS in out:
            out[KEYPOINTS] = geometry.keypoints(out[KEYPOINTS])
    return out


def keep_boxes(fields: dict[str, Any], boxes: np.ndarray, keep: np.ndarray) -> dict[str, Any]:
    """``fields`` with ``boxes`` in place of the boxes and every per-box field
    (per-instance masks and keypoints too) filtered by ``keep`` (a bool mask of
    the old rows)."""
    out = dict(fields)
    out[BOXES] = boxes
    if not keep.all():
        for name, value in fields.items():
            if per_box(name):
                out[name] = value[keep]
    return out
