"""CPU transforms on uint8 [H, W, 3] RGB arrays, and the fields that follow them.

Any plain callable ``fn(img, rng) -> img`` is a transform: ``rng`` is a
:class:`~feeder.sample.rng.SampleRNG` drawn from (seed, epoch, sample index, position
in the chain), so results do not depend on thread counts or scheduling. A
callable that changes the image size may say so with an ``output_size``
attribute ``(height, width)``.

On samples with a mask or boxes, every built-in transform reports the
:class:`Geometry` it applied to the image and the mask and boxes are mapped
through the same geometry (nearest neighbour for masks), so they always see
the image's own crop and flip; per-instance masks and keypoints too (a flip
swaps left and right keypoints by its ``keypoint_flip`` map). A plain callable must then keep the geometry;
:class:`SampleTransform` wraps one that transforms whole samples.

Batch transforms (``Feeder(batch_transforms=[...])``) run on the device, on
whole ``[B, 3, H, W]`` batches after the dtype conversion. What the built-in
classes add for the engine, and which of them the reference recipes use: the
[feeder.ops](../api/ops.md) page.
"""

from __future__ import annotations

from .adapters import Albumentations, Kornia
from .autoaugment import RandAugment, TrivialAugmentWide
from .base import DCT_DENOMS, Geometry, SampleContext, SampleTransform, Transform, dct_denom
from .batch import CutMix, MixUp, RandomErasing
from .color import ColorJitter
from .detection import (RandomIoUCrop, RandomPhotometricDistort, RandomShortestSize, RandomZoomOut,
                        ScaleJitter)
from .geometry import (COCO_PERSON_KEYPOINT_FLIP, CenterCrop, RandomCrop, RandomHorizontalFlip,
                       RandomResize, RandomResizedCrop, Resize)

__all__ = ["COCO_PERSON_KEYPOINT_FLIP", "Albumentations", "CenterCrop", "ColorJitter", "CutMix", "Geometry", "Kornia", "MixUp",
           "RandAugment", "RandomCrop", "RandomErasing", "RandomHorizontalFlip", "RandomIoUCrop",
           "RandomPhotometricDistort", "RandomResize", "RandomResizedCrop", "RandomShortestSize",
           "RandomZoomOut", "Resize", "SampleTransform", "ScaleJitter", "TrivialAugmentWide",
           "Transform"]
