"""Adapters to the augmentation libraries users already have: albumentations on
the CPU, per sample (:class:`Albumentations`), and kornia on the device, per batch
(:class:`Kornia`). Neither library is a dependency of feeder: both are
duck-typed and installed with the ``albumentations`` / ``kornia`` extras.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..sample.rng import SampleRNG
from ..sample import BOX_PREFIX, BOXES, INSTANCE_MASKS, KEYPOINTS, MASK
from .base import Geometry, Transform, _size2, move_fields


def _image_only(compose: Any) -> bool:
    """Every transform of the Compose is an albumentations ``ImageOnlyTransform``
    (pixels change, geometry does not), judged by class names."""
    ts = getattr(compose, "transforms", None)
    if not ts:
        return False
    for t in ts:
        names = {k.__name__ for k in type(t).__mro__}
        if "ImageOnlyTransform" not in names:
            return False
    return True


class Albumentations(Transform):
    """Run an albumentations pipeline (``A.Compose([...])``) on each sample: the image
    as numpy HWC uint8 RGB, the mask as ``mask``, the boxes as ``bboxes``.

    Deterministic across thread counts: before each sample the pipeline is seeded
    (``set_random_seed``) from the sample's own stream (seed, epoch, index). A
    ``Compose`` keeps per-call state, so each decode thread gets its own copy
    (``copy.deepcopy``, made on that thread's first sample). Duck-typed on the
    ``Compose`` call and ``set_random_seed``: works with albumentations 2.0.x and
    its successor AlbumentationsX. A transform inside that draws from a global
    generator of its own (not the Compose's) would not be reproducible; the
    built-in albumentations transforms all draw from the Compose's.

    Boxes: the Compose needs ``bbox_params=A.BboxParams(format="pascal_voc")``
    (feeder's boxes are x0, y0, x1, y1 in pixels); feeder passes each box's row
    number as an extra column, so every ``box_*`` field follows the boxes
    albumentations keeps. Boxes of no area are dropped before the call
    (albumentations rejects them). A ``label_fields`` name must be a field of the
    samples; it is passed along.

    Args:
        compose: The albumentations pipeline.
        output_size: (height, width) of every image it returns, when fixed (a
            Compose ending with a fixed-size crop). None: the image keeps its size
            when every transform is an ``ImageOnlyTransform``, else the size varies
            (follow it with a fixed-size transform).

    Raises:
        TypeError: ``compose`` is not callable or cannot be seeded.
    """

    moves_fields = True

    def __init__(self, compose: Any, output_size: int | Sequence[int] | None = None) -> None:
        if not callable(compose):
            raise TypeError(f"Albumentations: {compose!r} is not callable; pass an A.Compose([...])")
        if not callable(getattr(compose, "set_random_seed", None)):
            raise TypeError(f"Albumentations: {type(compose).__name__} has no set_random_seed(), so it "
                            f"cannot be seeded per sample (results would depend on the thread "
                            f"schedule); pass an A.Compose from albumentations >= 2.0 or AlbumentationsX")
        self.compose = compose
        self.output_size = None if output_size is None else _size2(output_size, "Albumentations")
        self.preserves_size = self.output_size is None and _image_only(compose)
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        # For the worker process of isolation="process": the per-thread copies stay behind.
        state = self.__dict__.copy()
        del state["_local"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _run(self, rng: SampleRNG, **data: Any) -> dict[str, Any]:
        compose = getattr(self._local, "compose", None)
        if compose is None:
            compose = self._local.compose = copy.deepcopy(self.compose)
        compose.set_random_seed(rng.integers(0, 1 << 32))
        result = compose(**data)
        img = result.get("image")
        if not (isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3
                and img.shape[2] == 3):
            raise TypeError(f"{self!r} returned an image that is not uint8 [H, W, 3] "
                            f"({getattr(img, 'dtype', type(img).__name__)}, "
                            f"{getattr(img, 'shape', None)})")
        return result

    def apply(self, img, rng, out=None, ctx=None):
        result = self._run(rng, image=img)["image"]
        if out is not None and out.shape == result.shape:
            np.copyto(out, result)
            return out
        return np.ascontiguousarray(result)

    def _boxes_kwargs(self, fields: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray]:
        processors = getattr(self.compose, "processors", {}) or {}
        proc = processors.get("bboxes")
        params = getattr(proc, "params", None)
        fmt = getattr(params, "format", None)
        if proc is None or fmt != "pascal_voc":
            raise ValueError(f"{self!r}: the samples have boxes; give the Compose "
                             f"bbox_params=A.BboxParams(format='pascal_voc') (feeder's boxes are "
                             f"x0, y0, x1, y1 in pixels){'' if proc is None else f', not {fmt!r}'}")
        boxes = fields[BOXES]
        valid = np.flatnonzero((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1]))
        kwargs: dict[str, Any] = {
            "bboxes": np.hstack([boxes[valid], valid[:, None].astype(np.float32)])}
        for name in getattr(params, "label_fields", None) or ():
            if name not in fields:
                raise ValueError(f"{self!r}: BboxParams names the label field {name!r}, which the "
                                 f"samples do not have (fields: {sorted(fields)})")
            kwargs[name] = np.asarray(fields[name])[valid]
        return kwargs, valid

    def apply_fields(self, img, rng, fields, geometry, out=None, ctx=None):
        for name in (INSTANCE_MASKS, KEYPOINTS):
            if name in fields:
                err = ConfigError(f"{self!r} does not move per-instance {name} (field {name!r}): "
                                   f"use the built-in transforms on such samples")
                err.field = name
                raise err
        fields = move_fields(fields, geometry)
        data: dict[str, Any] = {"image": img}
        if MASK in fields:
            data["mask"] = fields[MASK]
        if BOXES in fields:
            extra, _ = self._boxes_kwargs(fields)
            data.update(extra)
        result = self._run(rng, **data)
        new = np.ascontiguousarray(result["image"])
        fields = dict(fields)
        if MASK in fields:
            mask = np.asarray(result["mask"])
            if mask.ndim == 3 and mask.shape[2] == 1:
                mask = mask[:, :, 0]
            if mask.shape != new.shape[:2]:
                # Written as it is, the batch would crop or pad it to the image's
                # size: every pixel paired with the wrong class. The same for
                # every sample, so a configuration error, never skipped.
                err = ConfigError(
                    f"{self!r} returned a {new.shape[:2]} image (height, width) with a mask "
                    f"of shape {mask.shape} (field {MASK!r}): a transform of the "
                    f"pipeline changed the image's size but not the mask's (an ImageOnlyTransform "
                    f"or A.Lambda that resizes, say); use a DualTransform, or give A.Lambda a "
                    f"mask= function that moves the mask as the image")
                err.field = MASK
                raise err
            fields[MASK] = np.ascontiguousarray(mask.astype(fields[MASK].dtype, copy=False))
        if BOXES in fields:
            got = np.asarray(result["bboxes"], np.float64).reshape(-1, 5)
            rows = got[:, 4].astype(np.intp)
            fields[BOXES] = np.ascontiguousarray(got[:, :4], np.float32)
            for name, value in list(fields.items()):
                if name.startswith(BOX_PREFIX):
                    fields[name] = value[rows]
        if out is not None and out.shape == new.shape:
            np.copyto(out, new)
            new = out
        return new, fields, Geometry.identity(new.shape[0], new.shape[1])

    def __repr__(self) -> str:
        inner = ", ".join(type(t).__name__ for t in getattr(self.compose, "transforms", ())) or "..."
        return f"Albumentations(Compose([{inner}]))"


# Kornia draws from torch's global generators: one adapter at a time seeds them.
_GLOBAL_RNG = threading.Lock()


def _kornia_ops(module: Any, base: str) -> list[str]:
    """The class names of the kornia augmentations in ``module`` (itself and every
    submodule, as ``torch.nn.Module.modules`` walks them) that derive from a class
    whose name starts with ``base``: judged by class names, so kornia need not be
    imported here."""
    walk = getattr(module, "modules", None)
    found = []
    for m in (walk() if callable(walk) else (module,)):
        if any(k.__name__.startswith(base) for k in type(m).__mro__):
            found.append(type(m).__name__)
    return found


class Kornia:
    """Run a kornia augmentation module (``kornia.augmentation.*`` or an
    ``AugmentationSequential`` of them) on whole batches on the device, as a
    batch transform (``Feeder(batch_transforms=[ops.Kornia(...)])``).

    kornia takes no generator: it draws from torch's global one. Per batch, the
    adapter forks the global generators (``torch.random.fork_rng``: the CPU one,
    and the batch's CUDA device's), seeds them from (seed, epoch, batch number),
    runs the module and restores them, under a lock. Batches are then
    reproducible, but another thread drawing from torch's global generator during
    that call (a training step on the CPU, say) draws from the fork: prefer the
    built-in batch transforms where they exist. Images only: a batch with a mask or
    boxes is refused (the module would move the pixels without them), and so are
    geometric ops (kornia's ``GeometricAugmentationBase2D``: crops, flips,
    affine warps) on variable-size batches (``max_image_size``), which would move
    each image out of the region its ``"size"`` names. kornia's mixing ops
    (``RandomMixUpV2``, ``RandomCutMixV2``...) are refused: the adapter passes
    images only, so the labels would stay unmixed; use :class:`~feeder.ops.MixUp`
    and :class:`~feeder.ops.CutMix`. The module must return a batch like the one
    it got (batch size, channels, dtype, device): the feeder checks.

    Args:
        module: The kornia module, called as ``module(images)``; it must return a
            tensor of images (kornia's augmentations expect floats, usually in [0, 1]).

    Raises:
        TypeError: ``module`` is not callable.
        ValueError: ``module`` holds a kornia mixing op.
    """

    batch_transform = True  # it takes whole batches (see base.foreign_transform)

    needs_float = True

    #: Leaves labels alone: runs on batches without a "label" field too.
    uses_labels = False

    def __init__(self, module: Any) -> None:
        if not callable(module):
            raise TypeError(f"Kornia: {module!r} is not callable; pass a kornia augmentation module")
        mixing = _kornia_ops(module, "MixAugmentationBase")
        if mixing:
            raise ValueError(f"Kornia: {mixing} mix images across the batch, but the adapter "
                             f"passes images only and the labels would stay unmixed; use "
                             f"ops.MixUp or ops.CutMix in batch_transforms")
        self.module = module

    def check_variable_size(self) -> None:
        """Refuse variable-size batches (``max_image_size``) when the module holds a
        geometric op: each image lies in the top-left region its ``"size"`` names,
        and a crop, flip or warp of the padded batch would move it out of there.

        Raises:
            ValueError: naming the geometric ops.
        """
        geometric = _kornia_ops(self.module, "GeometricAugmentationBase")
        if geometric:
            raise ValueError(f"{self!r}: the geometric op(s) {geometric} would move each image of a "
                             f"variable-size batch (max_image_size) out of the region its \"size\" "
                             f"names; use the per-sample transforms (ops.RandomHorizontalFlip, "
                             f"ops.RandomCrop, ops.Albumentations...) for geometry, or fixed-size "
                             f"batches")

    def check_fields(self, kinds: dict[str, str]) -> None:
        moved = sorted(k for k, kind in kinds.items()
                       if kind in ("mask", "boxes", "per-box", "instance masks", "keypoints"))
        if moved:
            raise ValueError(f"Kornia moves the images only, and would leave the field(s) {moved} "
                             f"out of step with them; use the built-in transforms or "
                             f"ops.Albumentations for samples with a mask or boxes")

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        seed = generator.initial_seed()  # host-side: no wait for the device
        devices = [images.device] if images.device.type == "cuda" else []
        with _GLOBAL_RNG, torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.module(images)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{self!r} returned {type(out).__name__}, not a tensor of images")
        return out, labels

    def __repr__(self) -> str:
        return f"Kornia({self.module!r})".replace("\n", " ")
