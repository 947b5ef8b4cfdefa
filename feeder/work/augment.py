"""The compiled transform chain: what the augment step (``_work.py``) runs to
turn a decoded image into its slot of the batch buffer.

The chain is split once, at construction, into a *head* (applied normally), a
*writer* (the last size-changing transform, given the buffer slot as ``out=``)
and an in-place *tail* (flips) applied to the slot itself, so the usual
``RandomResizedCrop + RandomHorizontalFlip`` costs no copy at all.

:meth:`Chain.run` transforms an image alone. :meth:`Chain.run_fields` does the
same for a sample with other fields: every transform reports the
:class:`~feeder.ops.Geometry` it applied, and the mask and boxes are mapped
once through their composition, at the end (or before a
:class:`~feeder.ops.SampleTransform`, which gets them in step with the image).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..sample.rng import SampleRNG
from ..sample import (BOXES, DEFAULT_MAX_PIXELS, IMAGE, INSTANCE_MASKS, MASK, parse_value, per_box,
                     spec_of)
from ..errors import ConfigError, FieldError, TransformError
from ..ops import CenterCrop, Geometry, Resize, SampleContext, SampleTransform, Transform
from ..ops.fused import ResizeCenterCrop
from ..ops.base import foreign_transform, move_fields as _moved

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


class _SampleStep(Transform):
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
            steps.append((i, ResizeCenterCrop(t, ts[i + 1])))
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
        max_image_size: (height, width) of the largest output image, for
            transforms whose output size depends on the input: every image is
            then placed at the top left of its slot, and :meth:`run` returns its
            size; ``"auto"``: the transforms' :func:`largest_output` (a chain of
            fixed output size gives that size). None: one fixed size
            (``image_size`` or the transforms').
        size_divisibility: The batch buffers' sides are ``max_image_size``
            rounded up to a multiple of it (a batch is padded to such a multiple).
        largest_decoded: For ``max_image_size="auto"`` over transforms that keep
            the decoded size: the data's largest decoded (height, width) (see
            :func:`largest_output`).

    Raises:
        ValueError: ``image_size`` is not two positive ints, the output size cannot
            be inferred, contradicts ``image_size`` or exceeds ``max_pixels``; or
            ``max_image_size`` is given for transforms of another fixed output size.
        ConfigError: ``max_image_size="auto"`` and the transforms cannot bound
            their output (the message names the one that cannot).
    """

    def __init__(self, transforms: Sequence[Any], image_size: tuple[int, int] | None,
                 max_pixels: int = DEFAULT_MAX_PIXELS,
                 max_image_size: tuple[int, int] | str | None = None,
                 size_divisibility: int = 1,
                 largest_decoded: Callable[[], tuple[int, int] | None] | None = None) -> None:
        if image_size is not None:
            image_size = image_size_pair(image_size)
        ts: list[Transform] = []
        for t in transforms:
            foreign = foreign_transform(t, "transforms")
            if foreign is not None:
                raise TypeError(foreign)
            if isinstance(t, Transform):
                ts.append(t)
            elif isinstance(t, SampleTransform):
                ts.append(_SampleStep(t))
            elif callable(t):
                ts.append(_Callable(t))
            else:
                raise TypeError(f"transforms: {t!r} is neither a feeder transform nor callable; use "
                                f"the feeder.ops transforms, a function fn(img, rng) -> img, "
                                f"ops.SampleTransform(fn) or ops.Albumentations(A.Compose([...]))")
        self.transforms = ts
        #: Some transform takes whole samples: every sample goes through run_fields.
        self.takes_samples = any(isinstance(t, _SampleStep) for t in ts)
        self.max_pixels = max_pixels
        steps = _fuse(ts)
        size: Any = None
        for _, t in steps:
            if t.output_size is not None:
                size = t.output_size
                if size[0] * size[1] > max_pixels:
                    raise ValueError(f"transform {t!r} produces ({size[0]}, {size[1]}) images "
                                     f"(height, width), above max_pixels={max_pixels}")
            elif not t.preserves_size:
                size = _VARIABLE
        #: Variable-size output: (height, width) of the largest image, else None.
        self.max_image_size: tuple[int, int] | None = None
        if isinstance(max_image_size, str) and max_image_size == "auto":
            max_image_size = largest_output(ts, largest_decoded)
        if max_image_size is not None:
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
            self.max_image_size = max_image_size
            size = image_size = buffer
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
        #: (height, width) of the batch buffers' images (of every image, unless variable).
        self.image_size: tuple[int, int] = size
        k = len(steps) - 1
        while k >= 0 and steps[k][1].inplace:
            k -= 1
        if self.max_image_size is not None:
            # Sizes vary: the size-changing steps run on their own outputs; the
            # first in-place step (a flip) then writes the result to the top left
            # of the slot and the others work there, so placing the image costs
            # no pass of its own (without one, the result is copied there).
            self._head, self._writer, self._tail = steps[:k + 1], None, steps[k + 1:]
            # The last size-changing step, when it is a built-in that can say its
            # output size before computing (``planned_size``, from the context's
            # draws): it then writes straight into its region of the slot, as the
            # writer of a fixed size does, and an oversize image is refused
            # before it is computed.
            self._placer = None
            if k >= 0:
                i, t = steps[k]
                if (isinstance(t, Transform) and not isinstance(t, (_Callable, _SampleStep))
                        and type(t).planned_size is not Transform.planned_size):
                    self._head, self._placer = steps[:k], steps[k]
        else:
            self._head = steps[:max(k, 0)]
            self._writer = steps[k] if k >= 0 else None
            self._tail = steps[k + 1:]
        # Reduced-scale decode is driven by the first size-changing built-in
        # transform, if nothing before it but size-preserving built-ins. A region
        # decode only when it is the very first step: a transform before it would
        # see (and flip, say) the region instead of the image.
        self._hinter: tuple[int, Transform] | None = None
        self._boxer = False
        for k, (i, t) in enumerate(steps):
            if isinstance(t, (_Callable, _SampleStep)):
                break
            if not t.preserves_size:
                hints = type(t).decode_hint is not Transform.decode_hint
                boxes = type(t).decode_box is not Transform.decode_box
                if hints or boxes:
                    self._hinter = (i, t)
                    self._boxer = boxes and k == 0
                break
        # The context (full-size dims) is only true for transforms that see the
        # decoded image unchanged in size: up to the first size-changing step, or
        # the first callable or sample transform (which may change the size
        # without saying so: a Resize after one sizes what it returned).
        self._ctx_upto = next((i for i, t in steps if not t.preserves_size
                               or isinstance(t, (_Callable, _SampleStep))), len(ts))
        self._steps = steps
        # What run() does per step, decided here once rather than per sample:
        # (position, transform, gets the context, check its planned size, check
        # what it produced).
        self._run_head = [self._compile(i, t) for i, t in self._head]
        self._run_writer = None if self._writer is None else self._compile(*self._writer)

    def _compile(self, i: int, t: Transform) -> tuple[int, Transform, bool, bool, bool]:
        # Every image entering a step is within max_pixels (the decoder checks it,
        # and each step's output is checked or known). A step whose planned size
        # is its fixed output size (checked against max_pixels in __init__) or its
        # input's size therefore needs no per-sample plan check, and a built-in of
        # that kind makes exactly that size, so needs no check of what it produced
        # either; a callable or a sample transform may produce anything.
        known = (type(t).planned_size is Transform.planned_size
                 and (t.output_size is not None or t.preserves_size))
        # feeder's own transforms make exactly their planned size; the adapters run
        # other libraries' code, which is checked like a callable.
        module = type(t).__module__
        builtin = module.startswith("feeder.ops.") and module != "feeder.ops.adapters"
        return i, t, i <= self._ctx_upto, not known, not (known and builtin)

    @property
    def plan(self) -> Callable[[int, int, int], tuple[tuple[int, int] | None, SampleContext]] | None:
        """``plan(height, width, key) -> (need, ctx)`` for the decoder, or None when no
        transform can use a smaller decode.

        ``need`` is the smallest (height, width) the transforms need from a
        (height, width) image, and ``ctx`` the :class:`~feeder.ops.SampleContext` to
        pass to :meth:`run`, holding what the transform drew to compute ``need``
        and, when the first transform reads only part of the image, that part
        (``ctx.box``, for a region decode). All are functions of the arguments alone."""
        if self._hinter is None:
            return None
        i, t = self._hinter
        if self._boxer:
            def plan(height: int, width: int, key: int) -> tuple[tuple[int, int] | None, SampleContext]:
                ctx = SampleContext((height, width))
                need = t.decode_hint(height, width, SampleRNG(key, i), ctx)
                ctx.box = t.decode_box(height, width, ctx)
                return need, ctx
            return plan

        def plan(height: int, width: int, key: int) -> tuple[tuple[int, int] | None, SampleContext]:
            ctx = SampleContext((height, width))
            return t.decode_hint(height, width, SampleRNG(key, i), ctx), ctx

        return plan

    def planned_output_size(self, height: int, width: int, key: int) -> tuple[int, int] | None:
        """The (height, width) the chain will produce from a ``height`` x ``width``
        image (its header's size) for the sample of ``key``, before decoding it; None
        when some size-changing step cannot say (a callable, a crop that depends on
        the boxes).

        Each step plans from a fresh copy of the stream it will draw from, after the
        decode-hinting step's ``decode_hint`` (as :attr:`plan` does for the decoder),
        so a drawn size is the one the sample gets. A reduced-scale decode hands the
        first step a slightly different size, so a size computed from its input may
        differ by a pixel or so: this is for grouping samples of similar sizes
        (``Feeder(group_by_aspect_ratio=...)``), not for sizing buffers."""
        plan = self.plan
        ctx = plan(height, width, key)[1] if plan is not None else SampleContext((height, width))
        h, w = height, width
        for i, t in self._steps:
            if t.preserves_size:
                continue
            size = t.planned_size_for(h, w, SampleRNG(key, i), ctx if i <= self._ctx_upto else None)
            if size is None:
                return None
            h, w = int(size[0]), int(size[1])
        return h, w

    def run(self, img: np.ndarray, key: int, ctx: SampleContext,
            out: np.ndarray) -> tuple[int, int]:
        """Apply the chain to ``img`` and leave the result in ``out`` ([H, W, 3] uint8;
        with ``max_image_size``, in its top left corner).

        Returns:
            The (height, width) of the result.

        Raises:
            TransformError: a transform would produce (or produced) more than
                ``max_pixels`` pixels, or returned something that is not an image.
            ConfigError: the result does not have the batch buffer's size.
        """
        t = None
        try:
            for i, t, with_ctx, check_plan, check_out in self._run_head:
                c = ctx if with_ctx else None
                if check_plan:
                    self._check_plan(t, img, c, key, i)
                img = t.apply(img, SampleRNG(key, i), None, c)
                if check_out:
                    self._check_pixels(t, img.shape[0], img.shape[1], "produced")
            if self._run_writer is not None:
                i, t, with_ctx, check_plan, _ = self._run_writer
                c = ctx if with_ctx else None
                if check_plan:
                    self._check_plan(t, img, c, key, i)
                result = t.apply(img, SampleRNG(key, i), out, c)
                if result is not out:
                    self._store(result, out, t)
            elif self.max_image_size is not None:
                img, region, t = self._run_placer(img, key, ctx, out, t)
                for n, (i, t) in enumerate(self._tail):
                    result = t.apply(img if n == 0 else region, SampleRNG(key, i), region, None)
                    if result is not region:
                        np.copyto(region, result)
                if not self._tail and img is not region:
                    np.copyto(region, img)
                return region.shape[0], region.shape[1]
            else:
                self._store(img, out, None)
            for i, t in self._tail:
                t.apply(out, SampleRNG(key, i), out, None)
        except Exception as exc:
            if t is not None and not isinstance(exc, TransformError):
                exc.add_note(f"in transform {t!r}")
            raise
        return out.shape[0], out.shape[1]

    def run_fields(self, img: np.ndarray, key: int, ctx: SampleContext, out: np.ndarray,
                   fields: dict[str, Any], geometry: Geometry) -> dict[str, Any]:
        """:meth:`run_fields_sized` without the size."""
        return self.run_fields_sized(img, key, ctx, out, fields, geometry)[0]

    def run_fields_sized(self, img: np.ndarray, key: int, ctx: SampleContext, out: np.ndarray,
                         fields: dict[str, Any], geometry: Geometry
                         ) -> tuple[dict[str, Any], tuple[int, int]]:
        """:meth:`run` for a sample with other fields: the image goes into ``out`` and
        the fields come back moved with it (the mask resampled to the image's size,
        the boxes mapped, clipped and filtered, with their per-box fields), with
        the (height, width) of the image.

        Args:
            geometry: From the fields' coordinates (the full-size image's pixels)
                to ``img``'s (smaller when decoded at a reduced scale).

        Raises:
            ConfigError: a transform that cannot say how it moves pixels changed
                the size of a sample with a mask or boxes, or a sample transform
                changed a field's shape or dtype; and as :meth:`run`.
        """
        spatial = MASK in fields or BOXES in fields
        upto = self._ctx_upto
        t = None
        try:
            for i, t in self._head:
                if isinstance(t, _SampleStep):
                    img, fields, geometry = self._sample_step(t, img, fields, geometry, key, i)
                    self._check_pixels(t, img.shape[0], img.shape[1], "produced")
                    continue
                c = ctx if i <= upto else None
                self._check_plan(t, img, c, key, i)
                if t.moves_fields:
                    img, fields, geometry = t.apply_fields(img, SampleRNG(key, i), fields, geometry,
                                                           None, c)
                    self._check_pixels(t, img.shape[0], img.shape[1], "produced")
                    continue
                result, moved = t.apply_geometry(img, SampleRNG(key, i), None, c)
                geometry = self._follow(t, geometry, moved, img, result, spatial)
                img = result
                self._check_pixels(t, img.shape[0], img.shape[1], "produced")
            size = (out.shape[0], out.shape[1])
            if self.max_image_size is not None:
                # As in run(): the in-place steps write into the image's region of the slot.
                if self._placer is not None:
                    i, t = self._placer
                    c = ctx if i <= upto else None
                    region = self._planned_region(t, img, c, out)
                    self._check_plan(t, img, c, key, i)
                    result, moved = t.apply_geometry(img, SampleRNG(key, i), region, c)
                    geometry = self._follow(t, geometry, moved, img, result, spatial)
                    img = self._settle(result, region, out, t)
                if not (self._placer is not None and img is region):
                    region = self._region(img, out, t)
                for n, (i, t) in enumerate(self._tail):
                    source = img if n == 0 else region
                    result, moved = t.apply_geometry(source, SampleRNG(key, i), region, None)
                    geometry = self._follow(t, geometry, moved, source, result, spatial)
                    if result is not region:
                        np.copyto(region, result)
                if not self._tail and img is not region:
                    np.copyto(region, img)
                return _moved(fields, geometry, self.max_pixels), region.shape[:2]
            if self._writer is not None:
                i, t = self._writer
                if isinstance(t, _SampleStep):
                    img, fields, geometry = self._sample_step(t, img, fields, geometry, key, i)
                    self._store(img, out, t)
                else:
                    c = ctx if i <= upto else None
                    self._check_plan(t, img, c, key, i)
                    if t.moves_fields:
                        result, fields, geometry = t.apply_fields(img, SampleRNG(key, i), fields,
                                                                  geometry, out, c)
                    else:
                        result, moved = t.apply_geometry(img, SampleRNG(key, i), out, c)
                        geometry = self._follow(t, geometry, moved, img, result, spatial)
                    if result is not out:
                        self._store(result, out, t)
            else:
                self._store(img, out, None)
            for i, t in self._tail:
                _, moved = t.apply_geometry(out, SampleRNG(key, i), out, None)
                geometry = self._follow(t, geometry, moved, out, out, spatial)
        except Exception as exc:
            if t is not None and not isinstance(exc, TransformError):
                exc.add_note(f"in transform {t!r}")
            raise
        return _moved(fields, geometry, self.max_pixels), size

    def _sample_step(self, t: "_SampleStep", img: np.ndarray, fields: dict[str, Any],
                     geometry: Geometry, key: int, i: int) -> tuple[np.ndarray, dict[str, Any], Geometry]:
        sample = {IMAGE: img, **_moved(fields, geometry, self.max_pixels)}
        result = t.run(sample, SampleRNG(key, i))
        img = result.pop(IMAGE)
        return img, result, Geometry.identity(img.shape[0], img.shape[1])

    @staticmethod
    def _follow(t: Transform, geometry: Geometry, moved: Geometry | None, before: np.ndarray,
                after: np.ndarray, spatial: bool) -> Geometry:
        if moved is not None:
            return geometry.then(moved)
        if spatial and after.shape[:2] != before.shape[:2]:
            raise ConfigError(
                f"transform {t!r} changed the image from {before.shape[:2]} to "
                f"{after.shape[:2]} (height, width) on a sample with a mask or "
                f"boxes, and cannot say where it moved their pixels: use the built-in transforms "
                f"for crops and resizes, or wrap it in ops.SampleTransform to move the mask and "
                f"boxes itself")
        return geometry

    def _check_plan(self, t: Transform, img: np.ndarray, ctx: SampleContext | None, key: int,
                    i: int) -> None:
        # Before computing: a Resize of an elongated image by its shorter side
        # would allocate gigabytes before any check after it could run. A
        # transform whose size is drawn plans from a fresh copy of the stream it
        # will draw from (SampleRNG is counter-based: the same draws again).
        planned = t.planned_size_for(img.shape[0], img.shape[1], SampleRNG(key, i), ctx)
        if planned is not None:
            self._check_pixels(t, planned[0], planned[1], "would produce")

    def _check_pixels(self, t: Transform, height: int, width: int, verb: str) -> None:
        if height * width > self.max_pixels:
            raise TransformError(f"transform {t!r} {verb} a ({height}, {width}) image (height, "
                                 f"width) = {width * height} pixels, above "
                                 f"max_pixels={self.max_pixels}")

    def _run_placer(self, img: np.ndarray, key: int, ctx: SampleContext, out: np.ndarray,
                    t: Transform | None) -> tuple[np.ndarray, np.ndarray, Transform | None]:
        """Variable sizes, :meth:`run`: the placer step (if any) into its region of
        the slot; returns the image, its region of the slot and the last step run."""
        if self._placer is not None:
            i, t = self._placer
            c = ctx if i <= self._ctx_upto else None
            region = self._planned_region(t, img, c, out)
            self._check_plan(t, img, c, key, i)
            img = self._settle(t.apply(img, SampleRNG(key, i), region, c), region, out, t)
            if img is region:
                return img, region, t
        return img, self._region(img, out, t), t

    def _planned_region(self, t: Transform, img: np.ndarray, ctx: SampleContext | None,
                        out: np.ndarray) -> np.ndarray | None:
        """The region of the slot ``t`` will fill (None when it cannot say); an
        image larger than ``max_image_size`` is refused here, before it is computed."""
        planned = t.planned_size(img.shape[0], img.shape[1], ctx)
        if planned is None:
            return None
        return self._region(_Shape(planned), out, t)

    def _settle(self, result: Any, region: np.ndarray | None, out: np.ndarray,
                t: Transform) -> Any:
        """What a placer returned: its region (written in place), else its own
        array, checked and left for :meth:`_region` to place."""
        if region is not None and result is not region:
            if isinstance(result, np.ndarray) and result.shape != region.shape:
                raise TransformError(f"transform {t!r} planned a {region.shape[:2]} image but "
                                     f"produced {result.shape[:2]} (height, width)")
        return result if region is None or result is not region else region

    def _region(self, img: Any, out: np.ndarray, by: Transform | None) -> np.ndarray:
        """Variable sizes: the top left of the slot ``out`` that ``img`` goes to."""
        who = f"transform {by!r}" if by is not None else "the decoder (no transforms)"
        if isinstance(img, _Shape):
            who = f"transform {by!r} would produce"
        elif not (isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3
                  and img.shape[2] == 3):
            raise TransformError(f"{who} produced {type(img).__name__} "
                                 f"{getattr(img, 'shape', '')}, not a uint8 [H, W, 3] image")
        h, w = img.shape[:2]
        H, W = self.max_image_size
        if h > H or w > W:
            # One image's fault (its size), not the configuration's: skippable.
            verb = "" if isinstance(img, _Shape) else " produced"
            raise TransformError(f"{who}{verb} a ({h}, {w}) image (height, width), larger than "
                                 f"max_image_size=({H}, {W}): cap the size in the "
                                 f"transforms (a resize with a max_size) or raise max_image_size")
        return out[:h, :w]

    @staticmethod
    def _store(img: np.ndarray, out: np.ndarray, by: Transform | None) -> None:
        who = f"transform {by!r}" if by is not None else "the decoder (no transforms)"
        if (isinstance(img, np.ndarray) and img.ndim == 3 and img.shape[2] == out.shape[2]
                and img.shape[:2] != out.shape[:2]):
            # Not one bad file: every image of another size fails the same way.
            raise ConfigError(
                f"image_size={out.shape[:2]} but {who} produced {img.shape[:2]} (height, width; "
                f"shape {img.shape}, the batch buffer holds {out.shape}): add a "
                f"Resize or crop that ends at image_size, or set image_size")
        if img.shape != out.shape or img.dtype != out.dtype:
            raise TransformError(
                f"{who} produced an image of shape {img.shape} and dtype {img.dtype}, but the "
                f"batch buffer holds {out.shape} {out.dtype}; make the transforms end at "
                f"image_size={out.shape[:2]}")
        np.copyto(out, img)


class _Shape:
    """A planned image size, checked as an image would be (see ``Chain._region``)."""

    __slots__ = ("shape",)

    def __init__(self, size: tuple[int, int]) -> None:
        self.shape = (int(size[0]), int(size[1]), 3)
