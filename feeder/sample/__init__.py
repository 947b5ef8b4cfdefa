"""The per-sample vocabulary every other part builds on: field names and the
sample protocol (``fields``, checked by ``parse``, shared by ``schema``), the
per-sample random stream (``rng``), where a sample's pixels are and went
(``geometry``), and the images' sizes (``sizes``: fixed, or varying and
padded). Imports nothing of feeder's but its errors.

Import the names from here: ``from feeder.sample import MASK, Geometry``.
"""

from __future__ import annotations

from .fields import (BOX_LIST, BOX_PREFIX, BOXES, DEFAULT_MAX_PIXELS, IMAGE, INSTANCE_MASKS, INSTANCES,
                     INT_SCALAR, KEYPOINTS, LABEL, MASK, MASKS, NUMERIC, OBJECT, PER_BOX, POINTS,
                     SIZE, Spec, numeric, per_box)
from .geometry import (DCT_DENOMS, Geometry, SampleContext, check_mask_fill, dct_denom, keep_boxes,
                       move_fields)
from .parse import (check_sample, instances_fit, parse_sample, parse_value, pixels, pixels_size,
                    spec_of)
from .rng import SampleRNG
from .schema import Schema, Task

__all__ = ["BOXES", "BOX_LIST", "BOX_PREFIX", "DCT_DENOMS", "DEFAULT_MAX_PIXELS", "Geometry", "IMAGE",
           "INSTANCES", "INSTANCE_MASKS", "INT_SCALAR", "KEYPOINTS", "LABEL", "MASK", "MASKS",
           "NUMERIC", "OBJECT", "PER_BOX", "POINTS", "SIZE", "SampleContext", "SampleRNG", "Schema",
           "Spec", "Task", "check_mask_fill", "check_sample", "dct_denom", "instances_fit",
           "keep_boxes", "move_fields", "numeric", "parse_sample", "parse_value", "per_box",
           "pixels", "pixels_size", "spec_of"]
