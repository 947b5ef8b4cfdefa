"""The compiled transform chain: what the augment step runs to turn a decoded
image into its slot of the batch buffer.

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

from ..errors import ConfigError, TransformError
from ..sample import BOXES, DEFAULT_MAX_PIXELS, IMAGE, MASK, Geometry, SampleContext, SampleRNG
from ..sample import move_fields as _moved
from .base import Transform, name_transform
from .fused import FusedCrop
from .compose import (CallableStep, SampleStep, adapt, buffer_size, fixed_size, fuse, image_size_of,
                      image_size_pair, largest_output)

__all__ = ["Chain", "image_size_pair", "largest_output"]


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
        ts = adapt(transforms)
        self.transforms = ts
        #: Some transform takes whole samples: every sample goes through run_fields.
        self.takes_samples = any(isinstance(t, SampleStep) for t in ts)
        self.max_pixels = max_pixels
        steps = fuse(ts)
        size = fixed_size(steps, max_pixels)
        #: Variable-size output: (height, width) of the largest image, else None.
        self.max_image_size: tuple[int, int] | None = None
        if isinstance(max_image_size, str) and max_image_size == "auto":
            max_image_size = largest_output(ts, largest_decoded)
        if max_image_size is not None:
            self.max_image_size, size = buffer_size(max_image_size, size, ts, size_divisibility,
                                                    max_pixels)
            image_size = size
        #: (height, width) of the batch buffers' images (of every image, unless variable).
        self.image_size: tuple[int, int] = image_size_of(size, image_size, ts, max_pixels)
        self._split(steps)
        self._find_hinter(steps)
        # The context (full-size dims) is only true for transforms that see the
        # decoded image unchanged in size: up to the first size-changing step, or
        # the first callable or sample transform (which may change the size
        # without saying so: a Resize after one sizes what it returned).
        self._ctx_upto = next((i for i, t in steps if not t.preserves_size
                               or isinstance(t, (CallableStep, SampleStep))), len(ts))
        self._steps = steps
        # What run() does per step, decided here once rather than per sample:
        # (position, transform, gets the context, check its planned size, check
        # what it produced).
        self._run_head = [self._compile(i, t) for i, t in self._head]
        self._run_writer = None if self._writer is None else self._compile(*self._writer)
        #: The leading steps the region decoder can do in its own call (FusedCrop).
        self.fused = (FusedCrop.of(steps, self._tail)
                      if (self.max_image_size is None and not self.takes_samples and self._boxer
                          and not self._head and self._writer == steps[0]
                          and self._hinter == steps[0]) else None)

    def _split(self, steps: list[tuple[int, Transform]]) -> None:
        """The steps as head, writer (or placer) and in-place tail."""
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
                if (isinstance(t, Transform) and not isinstance(t, (CallableStep, SampleStep))
                        and type(t).planned_size is not Transform.planned_size):
                    self._head, self._placer = steps[:k], steps[k]
        else:
            self._head = steps[:max(k, 0)]
            self._writer = steps[k] if k >= 0 else None
            self._tail = steps[k + 1:]

    def _find_hinter(self, steps: list[tuple[int, Transform]]) -> None:
        # Reduced-scale decode is driven by the first size-changing built-in
        # transform, if nothing before it but size-preserving built-ins. A region
        # decode only when it is the very first step: a transform before it would
        # see (and flip, say) the region instead of the image.
        self._hinter: tuple[int, Transform] | None = None
        self._boxer = False
        for k, (i, t) in enumerate(steps):
            if isinstance(t, (CallableStep, SampleStep)):
                break
            if not t.preserves_size:
                hints = type(t).decode_hint is not Transform.decode_hint
                boxes = type(t).decode_box is not Transform.decode_box
                if hints or boxes:
                    self._hinter = (i, t)
                    self._boxer = boxes and k == 0
                break

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
        builtin = (module.startswith("feeder.ops.") and module != "feeder.ops.adapters"
                   and not isinstance(t, (CallableStep, SampleStep)))
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
            name_transform(exc, t)
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
        img, fields, geometry, t = self._fields_head(img, key, ctx, fields, geometry, spatial)
        if self.max_image_size is not None:
            return self._fields_placed(img, key, ctx, out, fields, geometry, spatial, t)
        fields, geometry = self._fields_written(img, key, ctx, out, fields, geometry, spatial, t)
        return _moved(fields, geometry, self.max_pixels), (out.shape[0], out.shape[1])

    def _fields_head(self, img: np.ndarray, key: int, ctx: SampleContext, fields: dict[str, Any],
                     geometry: Geometry, spatial: bool) -> tuple[Any, dict[str, Any], Geometry, Any]:
        """:meth:`run_fields_sized`'s head steps; returns the image, fields, geometry
        and the last transform run."""
        upto = self._ctx_upto
        t = None
        try:
            for i, t in self._head:
                if isinstance(t, SampleStep):
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
        except Exception as exc:
            name_transform(exc, t)
            raise
        return img, fields, geometry, t

    def _fields_placed(self, img: Any, key: int, ctx: SampleContext, out: np.ndarray,
                       fields: dict[str, Any], geometry: Geometry, spatial: bool,
                       t: Any) -> tuple[dict[str, Any], tuple[int, int]]:
        """Variable sizes, :meth:`run_fields_sized` after the head: as in :meth:`run`,
        the in-place steps write into the image's region of the slot."""
        upto = self._ctx_upto
        try:
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
        except Exception as exc:
            name_transform(exc, t)
            raise

    def _fields_written(self, img: Any, key: int, ctx: SampleContext, out: np.ndarray,
                        fields: dict[str, Any], geometry: Geometry, spatial: bool,
                        t: Any) -> tuple[dict[str, Any], Geometry]:
        """Fixed size, :meth:`run_fields_sized` after the head: the writer into
        ``out``, then the in-place tail there."""
        try:
            if self._writer is not None:
                i, t = self._writer
                if isinstance(t, SampleStep):
                    img, fields, geometry = self._sample_step(t, img, fields, geometry, key, i)
                    self._store(img, out, t)
                else:
                    c = ctx if i <= self._ctx_upto else None
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
            name_transform(exc, t)
            raise
        return fields, geometry

    def _sample_step(self, t: "SampleStep", img: np.ndarray, fields: dict[str, Any],
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


