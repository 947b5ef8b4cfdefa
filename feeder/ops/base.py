"""The transform protocol: :class:`Transform`, :class:`SampleTransform`, and the
helpers every transform module shares. :class:`Geometry` (how a mask and boxes
follow an image) and :class:`SampleContext` live in :mod:`feeder.sample` and
are re-exported here for the transform modules."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import cv2
import numpy as np

from ..errors import TransformError
from ..sample.geometry import (DCT_DENOMS, Geometry, SampleContext, check_mask_fill, dct_denom,
                               keep_boxes, move_fields, nearest_index)
from ..sample.rng import SampleRNG

_INTERPOLATION = {
    "nearest": cv2.INTER_NEAREST,
    "bilinear": cv2.INTER_LINEAR,
    "bicubic": cv2.INTER_CUBIC,
    "area": cv2.INTER_AREA,
    "lanczos": cv2.INTER_LANCZOS4,
}


def _whole(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _size2(size: int | Sequence[int], what: str) -> tuple[int, int]:
    # Whole numbers only: int(224.7) would truncate silently, int(inf) raises an
    # OverflowError that names nothing.
    if _whole(size):
        pair: tuple[Any, ...] = (size, size)
    elif isinstance(size, (str, bytes)) or not hasattr(size, "__iter__"):
        raise ValueError(f"{what}: size must be an int or (height, width), got {size!r}")
    else:
        pair = tuple(size)  # type: ignore[arg-type]
        if len(pair) != 2 or not all(_whole(s) for s in pair):
            raise ValueError(f"{what}: size must be an int or (height, width), got {size!r}")
    if min(pair) <= 0:
        raise ValueError(f"{what}: size must be positive, got {size!r}")
    return int(pair[0]), int(pair[1])


def _real(value: object) -> float | None:
    """``value`` as a finite float, or None when it is not a finite real number (a
    bool, a string, inf, NaN)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
    return f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_number(value: object, name: str, what: str, low: float = -math.inf,
                 high: float = math.inf, low_open: bool = False, high_open: bool = False) -> float:
    """A configuration number: finite, within ``low``..``high`` (open ends where asked).

    Raises:
        ValueError: naming ``what``, ``name`` and the value.
    """
    v = _real(value)
    if (v is None or v < low or v > high or (low_open and v == low)
            or (high_open and v == high)):
        raise ValueError(f"{what}: {name} must be in {_interval(low, high, low_open, high_open)} "
                         f"and finite, got {value!r}")
    return v


def check_range(value: object, name: str, what: str, low: float = -math.inf,
                high: float = math.inf, low_open: bool = False) -> tuple[float, float]:
    """A configuration range ``(min, max)``: two finite numbers, ``min <= max``, both
    within ``low``..``high`` (``low`` excluded with ``low_open``). An infinite bound
    would pass here and fail on every sample, a configuration typo that
    ``on_error="skip"`` would turn into an empty epoch.

    Raises:
        ValueError: naming ``what``, ``name`` and the value.
    """
    bounds = f"within {_interval(low, high, low_open, False)}"
    items: tuple[Any, ...] | None = None
    if not isinstance(value, (str, bytes)) and hasattr(value, "__iter__"):
        items = tuple(value)  # type: ignore[arg-type]
    if items is None or len(items) != 2 or any(_real(v) is None for v in items):
        raise ValueError(f"{what}: {name} must be (min, max), two finite numbers {bounds}, "
                         f"got {value!r}")
    a, b = float(items[0]), float(items[1])
    if a > b:
        raise ValueError(f"{what}: {name} must be (min, max) with min <= max, got {value!r}")
    if a < low or b > high or (low_open and a == low):
        raise ValueError(f"{what}: {name} must be (min, max) {bounds}, got {value!r}")
    return a, b


def check_flag(value: object, name: str, what: str) -> bool:
    """A configuration switch: True or False only (a string such as ``"False"``
    is truthy and would silently turn the switch on).

    Raises:
        ValueError: naming ``what``, ``name`` and the value.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{what}: {name} must be True or False, got {value!r}")
    return value


def _interp(name: str, what: str) -> int:
    try:
        return _INTERPOLATION[name]
    except KeyError:
        raise ValueError(f"{what}: interpolation must be one of {sorted(_INTERPOLATION)}, "
                         f"got {name!r}") from None


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
    #: The transform moves a mask and boxes itself (:meth:`apply_fields`), for
    #: moves a :class:`Geometry` cannot say (a rotation, a shear).
    moves_fields = False

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

    def apply_fields(self, img: np.ndarray, rng: SampleRNG, fields: dict[str, Any],
                     geometry: Geometry, out: np.ndarray | None = None,
                     ctx: SampleContext | None = None
                     ) -> tuple[np.ndarray, dict[str, Any], Geometry]:
        """For a transform with ``moves_fields``: :meth:`apply` on a sample with a
        mask or boxes. ``fields`` are in the coordinates of the input of
        ``geometry`` (the chain maps them lazily); returns the image, the fields and
        the geometry still to apply to them (the transform may map the fields
        itself with :func:`move_fields` and return an identity geometry)."""
        result, moved = self.apply_geometry(img, rng, out, ctx)
        if moved is None:
            return result, fields, geometry
        return result, fields, geometry.then(moved)

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

    def planned_size_for(self, height: int, width: int, rng: SampleRNG,
                         ctx: SampleContext | None = None) -> tuple[int, int] | None:
        """:meth:`planned_size` for this sample: ``rng`` is a fresh copy of the stream
        ``apply`` will draw from, so a transform whose output size is drawn (a
        random resize, a zoom-out) can say it before allocating anything."""
        return self.planned_size(height, width, ctx)

    def planned_size(self, height: int, width: int,
                     ctx: SampleContext | None = None) -> tuple[int, int] | None:
        """(height, width) that ``apply`` will produce for an input of this size (and this
        ``ctx``), known before computing it; None when only running it can tell."""
        if self.output_size is not None:
            return self.output_size
        return (height, width) if self.preserves_size else None

    def largest_output(self, largest_input: tuple[int, int] | None) -> tuple[int, int] | None:
        """The largest (height, width) this transform can produce from inputs of at most
        ``largest_input`` (None: of any size), each side bounded on its own; None
        when it cannot say (what ``Feeder(max_image_size="auto")`` asks of a chain)."""
        if self.output_size is not None:
            return self.output_size
        return largest_input if self.preserves_size else None


def _resize_into(img: np.ndarray, size: tuple[int, int], interpolation: int,
                 out: np.ndarray | None) -> np.ndarray:
    h, w = size
    if interpolation == cv2.INTER_NEAREST:
        return _nearest_into(img, size, out)
    # Only an input of the slot's own type can be resized into it: for anything
    # else cv2 silently allocates a new array and leaves ``out`` stale.
    if (out is not None and out.shape == (h, w, 3) and out.dtype == np.uint8
            and img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3):
        cv2.resize(img, (w, h), dst=out, interpolation=interpolation)
        return out
    return cv2.resize(img, (w, h), interpolation=interpolation)


def nearest_rows(n: int, length: int) -> np.ndarray:
    """The input pixels a nearest-neighbour resize of ``length`` pixels to ``n``
    takes along one axis: the pixel under each output pixel's centre, computed
    as :meth:`Geometry.mask` computes a mask's (cv2's INTER_NEAREST takes
    ``floor(j * length / n)``, half an input pixel off the boxes and masks)."""
    return np.minimum(nearest_index((np.arange(n) + 0.5) / (n / length)), length - 1)


def _nearest_into(img: np.ndarray, size: tuple[int, int], out: np.ndarray | None) -> np.ndarray:
    h, w = size
    result = img[nearest_rows(h, img.shape[0])[:, None], nearest_rows(w, img.shape[1])[None, :]]
    if out is not None and out.shape == result.shape and out.dtype == result.dtype:
        np.copyto(out, result)
        return out
    return result


def _resize_with_geometry(img: np.ndarray, size: tuple[int, int], interpolation: int,
                          antialias: bool, out: np.ndarray | None) -> tuple[np.ndarray, "Geometry"]:
    """Resize the whole image to ``size`` (into ``out`` when it fits) and the
    geometry that maps the input's coordinates onto the result."""
    H, W = img.shape[:2]
    result = _resize_into(img, size, _choose(interpolation, antialias, (H, W), size), out)
    return result, _crop_resize(0, 0, H, W, size[0], size[1])


def _into(img: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``img``, written into ``out`` when the caller offered a slot of its shape."""
    if out is not None and out.shape == img.shape and out is not img:
        np.copyto(out, img)
        return out
    return img


class Photometric(Transform):
    """Base of the transforms that change pixel values only: the geometry is the
    identity and the size is kept."""

    def apply_geometry(self, img, rng, out=None, ctx=None):
        return self.apply(img, rng, out, ctx), Geometry.identity(img.shape[0], img.shape[1])


def _choose(interpolation: int, antialias: bool, src: tuple[int, int], dst: tuple[int, int]) -> int:
    # Bilinear sampling aliases when shrinking by more than 2x; area averaging is
    # OpenCV's anti-aliased shrink (torchvision antialiases by default too).
    if antialias and interpolation == cv2.INTER_LINEAR and (src[0] > 2 * dst[0] or src[1] > 2 * dst[1]):
        return cv2.INTER_AREA
    return interpolation


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
    4]`` in the image's pixels, per-box arrays filtered with them (per-instance
    ``"masks"`` uint8 ``[N, H, W]`` and ``"keypoints"`` float32 ``[N, K, 3]``
    too, in step with the image), numbers as numpy arrays, other values as
    read (a pair's label is under ``"label"``). Return a dict with the same
    keys; a numeric field keeps its shape and dtype, a mask and per-instance
    masks stay the image's size.

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


# torchvision transforms with a feeder equivalent, by class name.
_TORCHVISION_EQUIVALENT = {
    **{n: f"ops.{n}" for n in ("RandomResizedCrop", "Resize", "CenterCrop", "RandomHorizontalFlip",
                               "RandomCrop", "RandomResize", "ColorJitter", "TrivialAugmentWide",
                               "RandAugment", "RandomPhotometricDistort", "RandomZoomOut",
                               "RandomIoUCrop", "ScaleJitter", "RandomShortestSize")},
    "Normalize": "Feeder(normalize=(mean, std)) (done on the device, after the batch is made)",
    "ToTensor": "nothing: feeder delivers tensors (choose the type with Feeder(dtype=...))",
    "PILToTensor": "nothing: feeder delivers tensors",
    "ToImage": "nothing: feeder delivers tensors",
    "ToDtype": "Feeder(dtype=...)",
    "ConvertImageDtype": "Feeder(dtype=...)",
    "Compose": "the list of its transforms, each replaced by its feeder equivalent",
    "RandomErasing": "Feeder(batch_transforms=[ops.RandomErasing(...)])",
    "MixUp": "Feeder(batch_transforms=[ops.MixUp(...)])",
    "CutMix": "Feeder(batch_transforms=[ops.CutMix(...)])",
}


def foreign_transform(t: Any, where: str, batch: bool = False) -> str | None:
    """The error message for ``t`` when it does not belong in ``where``, else None:
    a torchvision transform (recognised by its module name; torchvision is never
    imported), an albumentations transform not wrapped in ``ops.Albumentations``,
    or a feeder op in the wrong list (``batch``: ``where`` is ``batch_transforms``).
    Each of these would otherwise fail only at the first batch, with a
    ``TypeError`` about a missing argument."""
    if isinstance(t, type):
        # A class is callable: taken for fn(img, rng) it would be constructed with
        # the image as its first argument, failing at the first batch.
        return (f"{where}: {t.__name__} is a class, not a transform: write {t.__name__}(...), "
                f"an instance with its arguments")
    module = type(t).__module__ or ""
    if module.startswith("albumentations"):
        return (f"{where}: {t!r} is an albumentations transform; wrap its pipeline as "
                f"ops.Albumentations(A.Compose([...])) in transforms (it calls the pipeline with "
                f"named arguments and seeds it per sample)")
    # Batch transforms (MixUp, CutMix, RandomErasing, Kornia) say so by a class
    # attribute: this module cannot import theirs, which import it.
    if not batch and getattr(type(t), "batch_transform", False):
        return (f"{where}: {t!r} is a batch transform (it takes whole batches on the device); "
                f"pass it in Feeder(batch_transforms=[...])")
    if batch and isinstance(t, (Transform, SampleTransform)):
        return (f"{where}: {t!r} is a per-sample transform (it takes one numpy image); "
                f"pass it in Feeder(transforms=[...])")
    if not module.startswith("torchvision.transforms"):
        return None
    name = type(t).__name__
    fix = _TORCHVISION_EQUIVALENT.get(name)
    advice = (f"use {fix}" if fix is not None else
              "use the albumentations equivalent through ops.Albumentations(A.Compose([...])), or "
              "wrap a function of your own in ops.SampleTransform (it gets the sample as numpy "
              "HWC uint8 arrays)")
    return (f"{where}: {t!r} is a torchvision transform ({module}.{name}); feeder's transforms work "
            f"on numpy uint8 [H, W, 3] images with per-sample random streams, not on PIL images or "
            f"tensors with torch's global generator: {advice}")


def name_transform(exc: Exception, t: Any) -> None:
    """Note on ``exc`` the transform it came from (a TransformError names it already)."""
    if t is not None and not isinstance(exc, TransformError):
        exc.add_note(f"in transform {t!r}")
