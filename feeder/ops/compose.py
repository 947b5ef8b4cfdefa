"""What the transform chain is compiled from: plain callables and sample
transforms adapted to the :class:`~feeder.ops.Transform` interface
(:func:`adapt`), a ``Resize`` + ``CenterCrop`` fused into one step (:func:`fuse`),
and the output size the transforms give (:func:`fixed_size`,
:func:`largest_output`). :class:`~feeder.ops.chain.Chain` runs the result."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError, FieldError, TransformError
from ..sample import BOXES, IMAGE, INSTANCE_MASKS, MASK, SampleRNG, parse_value, per_box, spec_of
from .base import SampleTransform, Transform, foreign_transform
from .fused import ResizeCenterCrop
from .crop import CenterCrop
from .resize import Resize

VARIABLE = object()  # the output size depends on the input


class CallableStep(Transform):
    """Adapts a plain ``fn(img, rng) -> img`` to the Transform interface."""

    def __init__(self, fn: Callable[[np.ndarray, SampleRNG], np.ndarray]) -> None:
        self.fn = fn
        size = getattr(fn, "output_size", None)
        self.output_size = None if size is None else (int(size[0]), int(size[1]))
        # An undeclared callable is assumed to keep the size; a wrong guess is
        # reported at the buffer with the transform named.
        self.preserves_size = size is None

    def apply(self, img, rng, out=None, ctx=None):
        result = self.fn(img, rng)
        # Transforms hand uint8 [H, W, 3] RGB to each other; say who broke that
        # here, not in whichever transform trips over it next.
        if not isinstance(result, np.ndarray):
            raise TransformError(f"transform {self!r} returned {type(result).__name__}, not a numpy array")
        if result.dtype != np.uint8 or result.ndim != 3 or result.shape[2] != 3:
            raise TransformError(f"transform {self!r} returned an array of shape {result.shape} and "
                                 f"dtype {result.dtype}; transforms must return uint8 [H, W, 3] RGB")
        return result

    def __repr__(self) -> str:
        return getattr(self.fn, "__qualname__", None) or repr(self.fn)


class SampleStep(Transform):
    """Adapts an :class:`~feeder.ops.SampleTransform` to the chain: it gets the
    sample as a dict and returns one, checked here."""

    def __init__(self, t: SampleTransform) -> None:
        self.t = t
        self.output_size = t.output_size
        self.preserves_size = t.output_size is None

    def apply(self, img, rng, out=None, ctx=None):
        # A chain with sample transforms runs them through run_fields only.
        raise TypeError(f"{self.t!r} transforms whole samples")

    def run(self, sample: dict[str, Any], rng: SampleRNG) -> dict[str, Any]:
        result = self.t(sample, rng)
        if not isinstance(result, dict):
            raise TransformError(f"transform {self!r} returned {type(result).__name__}, not the sample dict")
        if result.keys() != sample.keys():
            raise ConfigError(f"transform {self!r} returned the fields {sorted(result)}, not "
                              f"{sorted(sample)}; a sample transform keeps the sample's fields")
        img = result[IMAGE]
        if not (isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3
                and img.shape[2] == 3):
            raise TransformError(f"transform {self!r} returned an \"image\" that is not a uint8 "
                                 f"[H, W, 3] array")
        checked: dict[str, Any] = {IMAGE: img}
        for name, value in result.items():
            if name == IMAGE:
                continue
            if name == MASK:
                if not (isinstance(value, np.ndarray) and value.ndim == 2
                        and value.dtype in (np.uint8, np.uint16) and value.shape == img.shape[:2]):
                    raise FieldError(MASK, f"returned by {self!r} is not a uint8/uint16 array of the "
                                           f"image's size {img.shape[:2]}")
                checked[name] = value
                continue
            new = parse_value(name, value)
            if spec_of(name, new) != spec_of(name, sample[name]):
                err = ConfigError(f"transform {self!r} changed field {name!r} from "
                                  f"{spec_of(name, sample[name]).describe()} to "
                                  f"{spec_of(name, new).describe()}")
                err.field = name
                raise err
            if name == INSTANCE_MASKS and new.shape[1:] != img.shape[:2]:
                raise FieldError(name, f"returned by {self!r} are {new.shape[1:]} (height, width), "
                                       f"not the image's size {img.shape[:2]}")
            checked[name] = new
        if BOXES in checked:
            n = len(checked[BOXES])
            for name, value in checked.items():
                if per_box(name) and value.shape[0] != n:
                    raise FieldError(name, f"returned by {self!r} has {value.shape[0]} rows for {n} boxes")
        return checked

    def __repr__(self) -> str:
        return repr(self.t)


def image_size_pair(value: Any) -> tuple[int, int]:
    """``image_size`` as (height, width), two positive ints.

    Raises:
        ValueError: anything else, with the value.
    """
    def whole(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(whole(v) and v > 0 for v in value)):
        raise ValueError(f"image_size must be (height, width), two positive ints; got {value!r}")
    return int(value[0]), int(value[1])


# The option that caps the longer side of a transform that resizes by the shorter one.
_CAPS = {"Resize": "max_size", "RandomShortestSize": "max_size", "RandomResize": "max_long"}


def _bound(transforms: Sequence[Transform], decoded: tuple[int, int] | None
           ) -> tuple[tuple[int, int] | None, Transform | None]:
    """The largest output of ``transforms`` from decoded images of at most ``decoded``
    (None: any size), and the size-changing transform to blame when there is none:
    the first that cannot say for any input, else the first that scales an
    unbounded input."""
    bound = decoded
    blind: Transform | None = None
    scaler: Transform | None = None
    for t in transforms:
        new = t.largest_output(bound)
        if new is None and not t.preserves_size:
            if t.largest_output((1, 1)) is None:
                blind = blind or t
            else:
                scaler = scaler or t
        bound = new
    return bound, blind or scaler


def largest_output(transforms: Sequence[Transform],
                   largest_decoded: Callable[[], tuple[int, int] | None] | None = None
                   ) -> tuple[int, int]:
    """(height, width) of the largest image ``transforms`` can produce, for
    ``max_image_size="auto"``: each transform's
    :meth:`~feeder.ops.Transform.largest_output` of the one before's.

    Args:
        largest_decoded: Called only when the transforms keep the decoded size
            or scale it (no transform at all: native-size evaluation): the
            largest decoded (height, width) of the data, or None when unknown.

    Raises:
        ConfigError: some transform cannot bound its output; the message names it.
    """
    bound, culprit = _bound(transforms, None)
    if bound is not None:
        return bound
    if culprit is None or culprit.largest_output((1, 1)) is not None:
        decoded = largest_decoded() if largest_decoded is not None else None
        if decoded is not None:
            bound, culprit = _bound(transforms, decoded)
            if bound is not None:
                return bound
    advice = ("give max_image_size=(height, width), or end the transforms with one that "
              "bounds the size (Resize(800, max_size=1333), RandomShortestSize(sizes, "
              "max_size=...), ScaleJitter, RandomResizedCrop, CenterCrop, Resize((h, w)))")
    if culprit is None:
        raise ConfigError(f"max_image_size='auto': the transforms ({list(transforms) or 'none'}) "
                          f"keep the images' decoded size, and no sample's size could be "
                          f"read; {advice}")
    name = type(getattr(culprit, "t", culprit)).__name__
    if name in _CAPS:
        why = f"has no cap on the longer side (give it {_CAPS[name]}=...)"
    elif culprit.largest_output((1, 1)) is not None:
        why = "scales its input, whose size no transform before it bounds, nor the data's"
    else:
        why = "cannot say the largest image it produces"
    raise ConfigError(f"max_image_size='auto': {culprit!r} {why}; {advice}")


def fuse(ts: list[Transform]) -> list[tuple[int, Transform]]:
    """The transforms with their positions in the user's list (each draws from the
    stream of its position), a ``Resize(int)`` followed by a ``CenterCrop`` made one
    step that computes only the pixels the crop keeps."""
    steps: list[tuple[int, Transform]] = []
    i = 0
    while i < len(ts):
        t = ts[i]
        if (type(t) is Resize and t.shorter is not None and i + 1 < len(ts)
                and type(ts[i + 1]) is CenterCrop):
            steps.append((i, ResizeCenterCrop(t, ts[i + 1])))
            i += 2
        else:
            steps.append((i, t))
            i += 1
    return steps


def transform_list(transforms: Any, name: str = "transforms") -> list[Any]:
    """``transforms`` as a list, refusing one transform where a list belongs.

    Raises:
        TypeError: ``transforms`` is not an iterable of transforms (one transform,
            one function, a string).
    """
    foreign = foreign_transform(transforms, name)
    if foreign is not None:  # a torchvision Compose, say: the fix is another transform
        raise TypeError(foreign)
    if (isinstance(transforms, (str, bytes, Transform, SampleTransform))
            or not hasattr(transforms, "__iter__")):
        raise TypeError(f"{name} must be a list of transforms, got {transforms!r}: for one "
                        f"transform, write [{transforms!r}]")
    return list(transforms)


def adapt(transforms: Sequence[Any]) -> list[Transform]:
    """``transforms`` as :class:`~feeder.ops.Transform` objects: feeder's as they
    are, a :class:`~feeder.ops.SampleTransform` or a plain callable adapted.

    Raises:
        TypeError: a torchvision transform (naming the replacement), or neither
            a transform nor callable.
    """
    ts: list[Transform] = []
    for t in transforms:
        foreign = foreign_transform(t, "transforms")
        if foreign is not None:
            raise TypeError(foreign)
        if isinstance(t, Transform):
            ts.append(t)
        elif isinstance(t, SampleTransform):
            ts.append(SampleStep(t))
        elif callable(t):
            ts.append(CallableStep(t))
        else:
            raise TypeError(f"transforms: {t!r} is neither a feeder transform nor callable; use "
                            f"the feeder.ops transforms, a function fn(img, rng) -> img, "
                            f"ops.SampleTransform(fn) or ops.Albumentations(A.Compose([...]))")
    return ts


def fixed_size(steps: list[tuple[int, Transform]], max_pixels: int) -> Any:
    """The (height, width) the last fixed-size step gives, :data:`VARIABLE` when a
    step after it changes the size by its input, None when no step changes it.

    Raises:
        ValueError: a fixed size above ``max_pixels``.
    """
    size: Any = None
    for _, t in steps:
        if t.output_size is not None:
            size = t.output_size
            if size[0] * size[1] > max_pixels:
                raise ValueError(f"transform {t!r} produces ({size[0]}, {size[1]}) images "
                                 f"(height, width), above max_pixels={max_pixels}")
        elif not t.preserves_size:
            size = VARIABLE
    return size


def buffer_size(max_image_size: Any, size: Any, ts: list[Transform], size_divisibility: int,
                max_pixels: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``max_image_size`` checked against the transforms' ``size`` (from
    :func:`fixed_size`), and the batch buffers' (height, width): it rounded up to
    a multiple of ``size_divisibility``.

    Raises:
        ValueError: not two positive ints, transforms of another fixed size, or
            buffers above ``max_pixels``.
    """
    max_image_size = image_size_pair(max_image_size)
    # The fixed size itself is no mistake: batches of the dict form, as
    # "auto" gives for such a chain, whose images are all that size.
    if isinstance(size, tuple) and size != max_image_size:
        raise ValueError(f"max_image_size={max_image_size} is for transforms whose output "
                         f"size varies, but these ({ts}) always produce "
                         f"({size[0]}, {size[1]}) (height, width): drop max_image_size")
    d = size_divisibility
    buffer = (-(-max_image_size[0] // d) * d, -(-max_image_size[1] // d) * d)
    if buffer[0] * buffer[1] > max_pixels:
        raise ValueError(f"max_image_size={max_image_size} (batch buffers of {buffer} "
                         f"(height, width) with size_divisibility={d}) is above "
                         f"max_pixels={max_pixels}")
    return max_image_size, buffer


def image_size_of(size: Any, image_size: tuple[int, int] | None, ts: list[Transform],
                  max_pixels: int) -> tuple[int, int]:
    """The batch buffers' image (height, width): ``image_size`` when given (checked
    against the transforms' ``size``), else the transforms' fixed size.

    Raises:
        ValueError: the two disagree, the size is above ``max_pixels``, or it
            cannot be told.
    """
    if image_size is not None:
        if isinstance(size, tuple) and size != image_size:
            raise ValueError(f"image_size={image_size} but the transforms produce {size}")
        if image_size[0] * image_size[1] > max_pixels:
            raise ValueError(f"image_size={image_size} is above max_pixels={max_pixels}")
        size = image_size
    if not isinstance(size, tuple):
        raise ValueError(
            "cannot tell the output image size from the transforms "
            f"({ts or 'none'}); end them with a fixed-size transform (RandomResizedCrop, "
            "CenterCrop, Resize((h, w))), pass image_size=(height, width), or, for "
            "batches of images of different sizes (padded to the largest of each batch), "
            "max_image_size=(height, width)"
            + ("; an ops.Albumentations whose pipeline ends at a fixed size declares it with "
               "output_size=(h, w)" if any(type(t).__name__ == "Albumentations" for t in ts) else ""))
    return size
