"""Batch transforms: whole ``[B, 3, H, W]`` batches on the device, after the dtype
conversion (``Feeder(batch_transforms=[...])``)."""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import numpy as np
import torch

from ..sample.rng import SampleRNG
from .base import check_number, check_range


class _Mixing:
    """Shared by :class:`MixUp` and :class:`CutMix`: arguments, lam and soft targets.

    Every draw uses the generator on the batch's device, so nothing waits for the
    device (no ``.item()``): the transfer thread keeps queuing work on its stream.

    On dict batches the feeder calls :meth:`check_fields` with the batch's field
    kinds before the first batch, and :meth:`apply_with_masks` with its masks: a field whose
    pixels the transform moves must move with them, or the batch is refused.
    """

    batch_transform = True  # it takes whole batches (see base.foreign_transform)

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
                ``"instance masks"``, ``"keypoints"``, ``"numeric"``, ``"object"``)
                of the batch's fields besides the image.

        Raises:
            ValueError: naming the fields and what to do instead.
        """
        name = type(self).__name__
        masks = sorted(k for k, kind in kinds.items() if kind == "mask")
        boxes = sorted(k for k, kind in kinds.items()
                       if kind in ("boxes", "per-box", "instance masks", "keypoints"))
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

    def check_variable_size(self) -> None:
        """Refuse variable-size batches (``max_image_size``): each image lies in the
        region its ``"size"`` names, and mixing it with a partner of another size
        puts the partner's pixels in its padding and its padding over the
        partner's pixels, under labels mixed as if both were whole.

        Raises:
            ValueError: naming the transform.
        """
        raise ValueError(f"{type(self).__name__} mixes images of different sizes in a "
                         f"variable-size batch (max_image_size): each image's padding would be "
                         f"blended or pasted over its partner's pixels, outside the region its "
                         f"\"size\" names; use fixed-size batches (image_size= or a fixed-size "
                         f"transform last) with {type(self).__name__}")

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
        alpha = check_number(alpha, "alpha", name, 0.0, low_open=True)
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"{name}: num_classes must be a positive int, got {num_classes!r}")
        label_smoothing = check_number(label_smoothing, "label_smoothing", name, 0.0, 1.0,
                                       high_open=True)
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


class RandomErasing:
    """Random erasing (Zhong et al., 2020), torchvision's ``RandomErasing``, as a batch
    transform on the device: each sample, with probability ``p``, gets one
    rectangle of area ``scale`` x its area and aspect ratio ``ratio`` (drawn
    log-uniformly) set to ``value``; after 10 draws that do not fit, the sample is
    left as it is.

    The draws come from each sample's own random stream (seed, epoch, index), so
    a sample is erased the same way whichever batch or thread it comes through.
    It runs after the dtype conversion and ``normalize``: ``value=0`` is the mean
    colour, as in torchvision's recipes. Masks and boxes are left alone, and the
    input batch is never written (torchvision's default ``inplace=False``).

    Args:
        p: Probability that a sample is erased.
        scale: Range of the erased area as a fraction of the image's.
        ratio: Range of the rectangle's aspect ratio (height / width).
        value: A number, a per-channel sequence, or ``"random"`` (standard normal
            noise per pixel, torchvision's ``value="random"`` and timm's "pixel" mode).

    Raises:
        ValueError: bad parameters, with the value.
    """

    batch_transform = True  # it takes whole batches (see base.foreign_transform)

    #: Leaves labels alone: runs on batches without a "label" field too.
    uses_labels = False

    def __init__(self, p: float = 0.5, scale: tuple[float, float] = (0.02, 0.33),
                 ratio: tuple[float, float] = (0.3, 3.3), value: float | str | tuple = 0.0) -> None:
        p = check_number(p, "p", "RandomErasing", 0.0, 1.0)
        scale = check_range(scale, "scale", "RandomErasing", 0.0, 1.0, low_open=True)
        ratio = check_range(ratio, "ratio", "RandomErasing", 0.0, low_open=True)
        if isinstance(value, str):
            if value != "random":
                raise ValueError(f"RandomErasing: value must be a number, a per-channel sequence or "
                                 f"'random', got {value!r}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value = check_number(value, "value", "RandomErasing")
        else:
            try:
                values = tuple(value)  # type: ignore[arg-type]
            except TypeError:
                raise ValueError(f"RandomErasing: value must be a number, a per-channel sequence or "
                                 f"'random', got {value!r}") from None
            value = tuple(check_number(v, f"value {value!r}: each", "RandomErasing") for v in values)
        self.p, self.value = float(p), value
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))

    def params(self, height: int, width: int, rng: SampleRNG) -> tuple[int, int, int, int] | None:
        """(top, left, h, w) of one sample's rectangle, or None when it is not erased
        (torchvision's ``get_params``, after the ``p`` draw)."""
        if not rng.random() < self.p:
            return None
        area = height * width
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            erase = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(lo, hi))
            h = int(round(math.sqrt(erase * aspect)))
            w = int(round(math.sqrt(erase / aspect)))
            if h < height and w < width:
                return rng.integers(0, height - h + 1), rng.integers(0, width - w + 1), h, w
        return None

    def apply_keyed(self, images: torch.Tensor, labels: torch.Tensor, rngs: list[SampleRNG],
                    sizes: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Erase ``images`` ``[B, C, H, W]`` with one :class:`~feeder.sample.rng.SampleRNG`
        per sample (what the feeder calls). ``sizes``: each image's valid
        ``(height, width)`` in a batch padded to its largest image
        (``max_image_size``); the rectangle is drawn within the image, as
        torchvision draws it on the unpadded image."""
        if images.dim() != 4 or len(rngs) != images.shape[0]:
            raise ValueError(f"RandomErasing: expected [B, C, H, W] images and B random streams, "
                             f"got {tuple(images.shape)} and {len(rngs)}")
        if not images.is_floating_point() and self.value == "random":
            raise ValueError("RandomErasing: value='random' needs floating images")
        if not images.is_floating_point() and self.value != "random":
            # torch writes a value an integer dtype cannot hold wrapped or
            # truncated (-1 as 255, 0.5 as 0): the erased pixels would be wrong.
            info = torch.iinfo(images.dtype)
            values = self.value if isinstance(self.value, tuple) else (self.value,)
            if any(v != int(v) or not info.min <= v <= info.max for v in values):
                raise ValueError(f"RandomErasing: value={self.value!r} does not fit {images.dtype} "
                                 f"images (whole numbers in [{info.min}, {info.max}]); a value for "
                                 f"normalized images needs dtype= or normalize= on the feeder")
        C, H, W = images.shape[1:]
        if isinstance(self.value, tuple) and len(self.value) not in (1, C):
            raise ValueError(f"RandomErasing: value has {len(self.value)} entries for {C} channels")
        # (top, left, height, width) per sample; an empty rectangle where none is erased.
        boxes = np.zeros((len(rngs), 4), np.int64)
        erased = []
        for b, rng in enumerate(rngs):
            box = self.params(H, W, rng) if sizes is None else self.params(int(sizes[b][0]),
                                                                           int(sizes[b][1]), rng)
            if box is not None:
                boxes[b] = box
                erased.append((b, box, rng))
        if not erased:
            return images, labels  # torchvision's inplace=False: nothing to copy
        device = images.device
        if self.value == "random":
            # Each sample's noise is its own stream's (seeded from it), as before:
            # the values cannot come from one draw for the batch without depending
            # on the batch's other samples.
            out = images.clone()
            gen = _generator(device)
            for b, (top, left, h, w), rng in erased:
                gen.manual_seed(rng.integers(0, 1 << 63))
                out[b, :, top:top + h, left:left + w].copy_(
                    torch.randn((C, h, w), generator=gen, device=device, dtype=torch.float32))
            return out, labels
        # One mask for the batch, built on the device from the rectangles (copied
        # from pinned memory: a pageable copy would wait for the stream).
        rects = torch.from_numpy(boxes)
        if device.type == "cuda":
            rects = rects.pin_memory().to(device, non_blocking=True)
        top, left, h, w = rects.t().reshape(4, -1, 1, 1, 1).unbind(0)
        rows = torch.arange(H, device=device).view(1, 1, H, 1)
        cols = torch.arange(W, device=device).view(1, 1, 1, W)
        mask = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
        value = self.value if isinstance(self.value, tuple) else (self.value,)
        fill = _constant(value, images.dtype, device)
        out = torch.empty_like(images)  # the input's memory format
        torch.where(mask, fill, images, out=out)
        return out, labels

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Called outside a feeder: the per-sample streams come from the generator's seed."""
        seed = generator.initial_seed()
        return self.apply_keyed(images, labels, [SampleRNG(seed, i) for i in range(images.shape[0])])

    def __repr__(self) -> str:
        return f"RandomErasing(p={self.p}, scale={self.scale}, ratio={self.ratio}, value={self.value!r})"


@functools.lru_cache(maxsize=64)
def _constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``[len(values), 1, 1]`` tensor on ``device``, made once per
    (values, dtype, device): a copy from pageable memory waits for the stream.
    Never freed, so no stream can see its memory reused."""
    return torch.tensor(values, dtype=dtype).view(-1, 1, 1).to(device)


_generators = threading.local()


def _generator(device: torch.device) -> torch.Generator:
    """This thread's generator on ``device``, made once and reseeded per sample
    (reseeding is a host-side step; making a device generator is not free)."""
    found = getattr(_generators, "by_device", None)
    if found is None:
        found = _generators.by_device = {}
    gen = found.get(device)
    if gen is None:
        gen = found[device] = torch.Generator(device=device)
    return gen
