"""Geometric transforms on uint8 [H, W, 3] images: crops, resizes and flips,
each reporting the :class:`~feeder.ops.Geometry` it applied (masks and boxes follow it).

They live in :mod:`feeder.ops.resize`, :mod:`feeder.ops.crop` and
:mod:`feeder.ops.flip`; this module names them all, as it did before they were apart."""

from __future__ import annotations

from .crop import CenterCrop, RandomCrop
from .flip import COCO_PERSON_KEYPOINT_FLIP, RandomHorizontalFlip
from .resize import RandomResize, RandomResizedCrop, Resize

__all__ = ["COCO_PERSON_KEYPOINT_FLIP", "CenterCrop", "RandomCrop", "RandomHorizontalFlip",
           "RandomResize", "RandomResizedCrop", "Resize"]
