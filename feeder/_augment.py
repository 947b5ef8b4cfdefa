"""The compiled transform chain: what the augment step (``_work.py``) runs to
turn a decoded image into its slot of the batch buffer.

The chain is split once, at construction, into a *head* (applied normally), a
*writer* (the last size-changing transform, given the buffer slot as ``out=``)
and an in-place *tail* (flips) applied to the slot itself, so the usual
``RandomResizedCrop + RandomHorizontalFlip`` costs no copy at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._rng import SampleRNG
from ._sample import DEFAULT_MAX_PIXELS
from .errors import ConfigError, TransformError
from .ops import CenterCrop, Resize, SampleContext, Transform, _ResizeCenterCrop

_VARIABLE = object()  # the output size depends on the input


class _Callable(Transform):
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


def _fuse(ts: list[Transform]) -> list[tuple[int, Transform]]:
    """The transforms with their positions in the user's list (each draws from the
    stream of its position), a ``Resize(int)`` followed by a ``CenterCrop`` made one
    step that computes only the pixels the crop keeps."""
    steps: list[tuple[int, Transform]] = []
    i = 0
    while i < len(ts):
        t = ts[i]
        if (type(t) is Resize and t.shorter is not None and i + 1 < len(ts)
                and type(ts[i + 1]) is CenterCrop):
            steps.append((i, _ResizeCenterCrop(t, ts[i + 1])))
            i += 2
        else:
            steps.append((i, t))
            i += 1
    return steps


class Chain:
    """The compiled transform list of a feeder.

    Args:
        transforms: Transforms or plain callables, applied in order.
        image_size: (height, width) of the batch buffers; inferred from the
            transforms when None.
        max_pixels: Largest image (height * width) any transform may produce.

    Raises:
        ValueError: ``image_size`` is not two positive ints, the output size cannot
            be inferred, contradicts ``image_size`` or exceeds ``max_pixels``.
    """

    def __init__(self, transforms: Sequence[Any], image_size: tuple[int, int] | None,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        if image_size is not None:
            image_size = image_size_pair(image_size)
        ts: list[Transform] = []
        for t in transforms:
            if isinstance(t, Transform):
                ts.append(t)
            elif callable(t):
                ts.append(_Callable(t))
            else:
                raise TypeError(f"transforms: {t!r} is neither a feeder transform nor callable")
        self.transforms = ts
        self.max_pixels = max_pixels
        steps = _fuse(ts)
        size: Any = None
        for _, t in steps:
            if t.output_size is not None:
                size = t.output_size
                if size[0] * size[1] > max_pixels:
                    raise ValueError(f"transform {t!r} produces {size[1]}x{size[0]} images, above "
                                     f"max_pixels={max_pixels}")
            elif not t.preserves_size:
                size = _VARIABLE
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
                "CenterCrop, Resize((h, w))) or pass image_size=(height, width)")
        self.image_size: tuple[int, int] = size
        k = len(steps) - 1
        while k >= 0 and steps[k][1].inplace:
            k -= 1
        self._head = steps[:max(k, 0)]
        self._writer = steps[k] if k >= 0 else None
        self._tail = steps[k + 1:]
        # Reduced-scale decode is driven by the first size-changing built-in
        # transform, if nothing before it but size-preserving built-ins.
        self._hinter: tuple[int, Transform] | None = None
        for i, t in steps:
            if isinstance(t, _Callable):
                break
            if not t.preserves_size:
                if type(t).decode_hint is not Transform.decode_hint:
                    self._hinter = (i, t)
                break
        # The context (full-size dims) is only true for transforms that see the
        # decoded image unchanged in size.
        self._ctx_upto = next((i for i, t in steps if not t.preserves_size), len(ts))

    @property
    def plan(self) -> Callable[[int, int, int], tuple[tuple[int, int] | None, SampleContext]] | None:
        """``plan(height, width, key) -> (need, ctx)`` for the decoder, or None when no
        transform can use a smaller decode.

        ``need`` is the smallest (height, width) the transforms need from a
        (height, width) image, and ``ctx`` the :class:`~feeder.ops.SampleContext` to
        pass to :meth:`run`, holding what the transform drew to compute ``need``.
        Both are functions of the arguments alone."""
        if self._hinter is None:
            return None
        i, t = self._hinter

        def plan(height: int, width: int, key: int) -> tuple[tuple[int, int] | None, SampleContext]:
            ctx = SampleContext((height, width))
            return t.decode_hint(height, width, SampleRNG(key, i), ctx), ctx

        return plan

    def run(self, img: np.ndarray, key: int, ctx: SampleContext, out: np.ndarray) -> None:
        """Apply the chain to ``img`` and leave the result in ``out`` ([H, W, 3] uint8).

        Raises:
            TransformError: a transform would produce (or produced) more than
                ``max_pixels`` pixels, or returned something that is not an image.
            ConfigError: the result does not have the batch buffer's size.
        """
        upto = self._ctx_upto
        t = None
        try:
            for i, t in self._head:
                c = ctx if i <= upto else None
                self._check_plan(t, img, c)
                img = t.apply(img, SampleRNG(key, i), None, c)
                self._check_pixels(t, img.shape[0], img.shape[1], "produced")
            if self._writer is not None:
                i, t = self._writer
                c = ctx if i <= upto else None
                self._check_plan(t, img, c)
                result = t.apply(img, SampleRNG(key, i), out, c)
                if result is not out:
                    self._store(result, out, t)
            else:
                self._store(img, out, None)
            for i, t in self._tail:
                t.apply(out, SampleRNG(key, i), out, None)
        except Exception as exc:
            if t is not None and not isinstance(exc, TransformError):
                exc.add_note(f"in transform {t!r}")
            raise

    def _check_plan(self, t: Transform, img: np.ndarray, ctx: SampleContext | None) -> None:
        # Before computing: a Resize of an elongated image by its shorter side
        # would allocate gigabytes before any check after it could run.
        planned = t.planned_size(img.shape[0], img.shape[1], ctx)
        if planned is not None:
            self._check_pixels(t, planned[0], planned[1], "would produce")

    def _check_pixels(self, t: Transform, height: int, width: int, verb: str) -> None:
        if height * width > self.max_pixels:
            raise TransformError(f"transform {t!r} {verb} a {width}x{height} image (width x height) "
                                 f"= {width * height} pixels, above max_pixels={self.max_pixels}")

    @staticmethod
    def _store(img: np.ndarray, out: np.ndarray, by: Transform | None) -> None:
        who = f"transform {by!r}" if by is not None else "the decoder (no transforms)"
        if (isinstance(img, np.ndarray) and img.ndim == 3 and img.shape[2] == out.shape[2]
                and img.shape[:2] != out.shape[:2]):
            # Not one bad file: every image of another size fails the same way.
            raise ConfigError(
                f"image_size={out.shape[:2]} but {who} produced {img.shape[1]}x{img.shape[0]} "
                f"(width x height, shape {img.shape}; the batch buffer holds {out.shape}): add a "
                f"Resize or crop that ends at image_size, or set image_size")
        if img.shape != out.shape or img.dtype != out.dtype:
            raise TransformError(
                f"{who} produced an image of shape {img.shape} and dtype {img.dtype}, but the "
                f"batch buffer holds {out.shape} {out.dtype}; make the transforms end at "
                f"image_size={out.shape[:2]}")
        np.copyto(out, img)
