"""What the transfer stage does to a batch on the device, after the copy: the
conversion to the output dtype and layout (:class:`Converter`), then the batch
transforms (``Feeder(batch_transforms=...)``, :class:`BatchTransforms`), whose
draws depend only on (seed, epoch, batch number), never on thread timing.
:class:`OutputOptions` are the options that decide both."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch

from .buffers import BatchBuffer
from ..sample.rng import SampleRNG, batch_generator, epoch_key, index_key
from ..sample import INT_SCALAR, LABEL, NUMERIC, Schema
from ..errors import StageError


@dataclasses.dataclass(frozen=True)
class OutputOptions:
    """The feeder options that decide what a batch is once delivered (see
    ``Feeder``'s arguments of the same names): ``dtype`` resolved (None: uint8),
    ``device`` resolved to an index once a pass starts (CUDA)."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype | None = None
    normalize: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None
    memory_format: str = "channels_last"
    batch_transforms: tuple[Any, ...] = ()


@functools.lru_cache(maxsize=64)
def _affine(mean: tuple[float, ...], std: tuple[float, ...], dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[1, 3, 1, 1]`` scale and shift of ``(x / 255 - mean) / std`` on ``device``,
    made once per (mean, std, dtype, device), not per pass: the copy from pageable
    memory waits for the device. Never freed, so no stream sees their memory reused."""
    mean_t = torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
    return ((1.0 / (255.0 * std_t)).to(device=device, dtype=dtype),
            (-mean_t / std_t).to(device=device, dtype=dtype))


class Converter:
    """uint8 [B,3,H,W] -> ``dtype``, scaled to [0, 1] and optionally normalized,
    in the requested memory layout.

    The batch buffers are ``[B,H,W,3]``, so their NCHW view is channels_last.
    ``memory_format="contiguous"`` makes a contiguous NCHW copy instead (what
    ``x.view(B, -1)`` and code that assumes contiguous inputs need); with a
    floating ``dtype`` that copy is the conversion's own output, not a second pass.

    ``(x / 255 - mean) / std`` is computed as ``x * scale + shift`` with per-channel
    constants, so it is one multiply and one add over the batch. Both run in
    float32 (float64 for a float64 output) and the result is rounded to ``dtype``
    once: in float16 or bfloat16 the constants and the intermediate product would
    each be rounded too (bfloat16 has 8 significant bits), several times the error
    of the final rounding alone.
    """

    def __init__(self, dtype: torch.dtype | None, normalize, device: torch.device,
                 memory_format: str = "channels_last") -> None:
        self.dtype = dtype
        self.contiguous = memory_format == "contiguous"
        self.layout = torch.contiguous_format if self.contiguous else torch.preserve_format
        self.scale = self.shift = None
        #: Pixel value 0 does not stay 0 (see Transfer's zero_padding).
        self.normalized = normalize is not None and dtype is not None
        if dtype is None or not dtype.is_floating_point:
            return
        if normalize is None:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        else:
            mean, std = normalize
        self.compute = torch.float64 if dtype == torch.float64 else torch.float32
        self.scale, self.shift = _affine(tuple(map(float, mean)), tuple(map(float, std)),
                                         self.compute, device)

    @property
    def keeps_buffer_layout(self) -> bool:
        """The output is the uint8 buffer itself, as laid out (a CPU batch can be lent);
        otherwise it is always memory of its own."""
        return self.dtype is None and not self.contiguous

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self.dtype is None:
            # A clone, not .contiguous(): that returns the input itself when it is
            # already contiguous (a 1x1 image), and the caller then returns the
            # buffer under it to the pool while the batch is still in use.
            return images.clone(memory_format=torch.contiguous_format) if self.contiguous else images
        out = images.to(self.compute, memory_format=self.layout)
        out.mul_(self.scale).add_(self.shift)
        return out.to(self.dtype)  # a no-op for float32 and float64; keeps the strides


# SampleRNG streams of the batch transforms' per-sample draws: far from the
# CPU transforms' streams (their positions in ``transforms``).
_KEYED_STREAM = 1 << 32


class BatchTransforms:
    """The feeder's ``batch_transforms`` for one pass, applied to whole batches on the device.

    Each transform gets a generator seeded from (seed, epoch, batch number, its
    position in the list), so its draws do not depend on thread counts or timing.

    Args:
        transforms: Callables ``fn(images, labels, generator) -> (images, labels)``.
        seed: The feeder's seed.
        epoch: The pass's epoch.
        device: Where batches are transformed (the generators' device).
        dtype: The images' dtype, which every transform must keep (the feeder's
            ``dtype``, ``torch.uint8`` for None); None: not checked.
        variable: The batches hold images of different sizes (``max_image_size``).
    """

    def __init__(self, transforms: tuple[Any, ...], seed: int, epoch: int,
                 device: torch.device, dtype: torch.dtype | None = None,
                 variable: bool = False) -> None:
        self.variable = variable
        self.transforms = transforms
        self.seed = seed
        self.epoch = epoch
        self.device = device
        self.dtype = dtype
        # Transforms with a class count take labels in [0, num_classes).
        self.bounds = [(t, t.num_classes) for t in transforms
                       if isinstance(getattr(t, "num_classes", None), int)]
        self.fields_checked = False  # the fields are fixed by the first sample: checked once
        # Transforms that say they leave labels alone (RandomErasing, Kornia) run on
        # batches with any "label" field or none (segmentation, detection, images only).
        self.label_free = all(getattr(t, "uses_labels", True) is False for t in transforms)

    def check_labels(self, labels: np.ndarray, indices: np.ndarray, number: int) -> None:
        """Raise :class:`StageError` naming the batch, sample and label when a label
        is outside a transform's classes. Checked on the host copy of the labels:
        on the device the check would make this thread wait for the copy."""
        for t, num_classes in self.bounds:
            bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
            if bad.size:
                i = int(bad[0])
                raise StageError("transfer", f"batch {number} of epoch {self.epoch}: label "
                                 f"{int(labels[i])} of sample {int(indices[i])} is out of range "
                                 f"[0, {num_classes}) of batch transform {t!r}")

    def check_label_field(self, buf: BatchBuffer, n: int, schema: Schema, indices: np.ndarray,
                          number: int) -> None:
        """:meth:`check_labels` for a batch of samples with fields: the ``"label"``
        field must be int class labels (checked as pairs' are) or soft ``[C]`` targets."""
        if self.label_free:
            return
        spec = schema.specs.get(LABEL)
        if spec == INT_SCALAR:
            self.check_labels(buf.labels[:n], indices, number)
        elif spec is None or spec.kind != NUMERIC or len(spec.shape) != 1 or spec.dtype.kind != "f":
            what = "no \"label\" field" if spec is None else f"a \"label\" field of {spec.describe()}"
            raise StageError("transfer", f"batch transforms {list(self.transforms)!r} take int class "
                             f"labels or float [num_classes] targets under \"label\"; the samples "
                             f"have {what}")

    def check_fields(self, schema: Schema, number: int) -> None:
        """Raise :class:`StageError` when a transform that says which fields it can
        move with the images (``check_fields``, as MixUp and CutMix do) would leave
        one of the batch's fields (a mask, boxes) paired with pixels that are no
        longer its own. A plain callable sees images and labels only, and says nothing."""
        if self.fields_checked:
            return
        kinds = {name: spec.kind for name, spec in schema.specs.items() if name != LABEL}
        for t in self.transforms:
            check = getattr(t, "check_fields", None)
            # Checked at construction too; again here, for a module changed since.
            size_check = getattr(t, "check_variable_size", None) if self.variable else None
            try:
                if check is not None:
                    check(kinds)
                if size_check is not None:
                    size_check()
            except ValueError as exc:
                raise StageError("transfer", f"batch transform {t!r} refused batch {number} of "
                                 f"epoch {self.epoch}: {exc}") from exc
        self.fields_checked = True

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, number: int,
                 masks: dict[str, torch.Tensor] | None = None, indices: np.ndarray | None = None,
                 sizes: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the transforms to one batch; ``masks`` (field name -> ``[B, H, W]``),
        when given, are replaced in it by the masks as the transforms moved them.
        ``indices`` are the batch's source indices: a transform with ``apply_keyed``
        (per-sample draws, e.g. RandomErasing) gets one SampleRNG per sample from them,
        and, for a batch of images of different sizes, ``sizes`` (each image's valid
        ``(height, width)``, host int64 ``[B, 2]``), so it draws within the image
        rather than over its padding."""
        shape, device = tuple(images.shape), images.device
        label_rows = labels.shape[0] if isinstance(labels, torch.Tensor) and labels.dim() else None
        mask_shapes = {name: tuple(m.shape) for name, m in (masks or {}).items()}
        for position, t in enumerate(self.transforms):
            try:
                if indices is not None and hasattr(t, "apply_keyed"):
                    # Per-sample streams, distinct from the CPU transforms' (which
                    # use the positions in ``transforms``): a sample is erased the
                    # same way whichever batch it lands in.
                    ek = epoch_key(self.seed, self.epoch)
                    rngs = [SampleRNG(index_key(ek, int(i)), _KEYED_STREAM + position) for i in indices]
                    if sizes is None:
                        images, labels = t.apply_keyed(images, labels, rngs)
                    else:
                        images, labels = t.apply_keyed(images, labels, rngs, sizes=sizes)
                elif masks and hasattr(t, "apply_with_masks"):
                    gen = batch_generator(self.seed, self.epoch, number, position, self.device)
                    images, labels, moved = t.apply_with_masks(images, labels, gen, dict(masks))
                    masks.update(moved)
                else:
                    gen = batch_generator(self.seed, self.epoch, number, position, self.device)
                    images, labels = t(images, labels, gen)
            except Exception as exc:
                raise StageError("transfer", f"batch transform {t!r} failed on batch {number} of "
                                 f"epoch {self.epoch}: {type(exc).__name__}: {exc}") from exc
            if not (isinstance(images, torch.Tensor)
                    and (isinstance(labels, torch.Tensor) or labels is None and self.label_free)):
                raise StageError("transfer", f"batch transform {t!r} must return (images, labels) "
                                 f"tensors; got ({type(images).__name__}, "
                                 f"{type(labels).__name__}) on batch {number}")
            self._check_output(t, number, shape, device, label_rows, mask_shapes, images, labels,
                               masks)
        return images, labels

    def _check_output(self, t: Any, number: int, shape: tuple[int, ...], device: torch.device,
                      label_rows: int | None, mask_shapes: dict[str, tuple[int, ...]],
                      images: torch.Tensor, labels: Any, masks: dict[str, torch.Tensor] | None
                      ) -> None:
        """Refuse what a transform returned that the batch cannot be: delivered as it
        is, 3 images for 4 labels, a 3-D tensor or another dtype would surface far
        away in the training loop, and a tensor on another device in the CUDA
        stream bookkeeping (``record_stream``) or not at all."""
        problems = []
        if images.dim() != len(shape) or images.shape[0] != shape[0] or images.shape[1] != shape[1]:
            problems.append(f"images of shape {tuple(images.shape)} for a batch of shape {shape} "
                            f"(the batch size and channels must stay)")
        if self.dtype is not None and images.dtype != self.dtype:
            problems.append(f"{images.dtype} images, not {self.dtype} (the feeder's dtype)")
        if images.device != device:
            problems.append(f"images on {images.device}, not on the batch's device {device}")
        if isinstance(labels, torch.Tensor):
            rows = labels.shape[0] if labels.dim() else None
            if label_rows is not None and rows != shape[0]:
                problems.append(f"{rows} labels for {shape[0]} images")
            if labels.device != device:
                problems.append(f"labels on {labels.device}, not on the batch's device {device}")
        for name, mask in (masks or {}).items():
            if name in mask_shapes and tuple(mask.shape) != mask_shapes[name]:
                problems.append(f"mask field {name!r} of shape {tuple(mask.shape)}, not "
                                f"{mask_shapes[name]}")
            if mask.device != device:
                problems.append(f"mask field {name!r} on {mask.device}, not on {device}")
        if problems:
            raise StageError("transfer", f"batch transform {t!r} returned {'; '.join(problems)} "
                                         f"on batch {number} of epoch {self.epoch}")
