"""What travels between the stages for one sample, the sample protocol every
source speaks, and the limits every stage shares.

A source's ``read(index)`` returns ``(image, label)``, or a dict with the image
under ``"image"`` and any of ``"mask"``, ``"boxes"``, ``"box_<name>"``,
``"masks"``, ``"keypoints"`` and other keys (numbers and arrays are stacked,
anything else passed through); batches are then dicts with the same keys. An
image is encoded bytes or an image already decoded (:func:`pixels`). The forms
each field takes: docs/guides/segmentation.md ("Fields of a sample"); the
decoded images: docs/guides/classification.md ("Images already decoded").

:func:`check_sample` validates one such value, for any source's own tests;
the engine runs the same checks (:func:`parse_sample`, :class:`Schema`) on
every sample it reads. This module imports nothing of feeder's but its errors.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


# Default ceiling on decoded pixels (width * height): a decompression bomb is
# rejected from its header before any pixel memory is allocated. 2**28 pixels
# is 768 MiB of RGB, far beyond any training image.
DEFAULT_MAX_PIXELS = 1 << 28

IMAGE, MASK, BOXES, LABEL = "image", "mask", "boxes", "label"
BOX_PREFIX = "box_"
#: Per-instance fields (one entry per box, under torchvision's names).
INSTANCE_MASKS, KEYPOINTS = "masks", "keypoints"

# Field kinds.
NUMERIC = "numeric"    # stacked into a [B, ...] tensor of one shape and dtype
MASKS = "mask"         # [B, H, W] integer tensor, moved with the image
BOX_LIST = "boxes"     # a list of B float32 [Ni, 4] tensors
PER_BOX = "per-box"    # a list of B [Ni, ...] tensors, filtered with the boxes
OBJECT = "object"      # a list of B values, as read
INSTANCES = "instance masks"  # a list of B uint8 [Ni, H, W] tensors, moved with the image
POINTS = "keypoints"   # a list of B float32 [Ni, K, 3] tensors, moved with the image

#: The field of variable-size batches holding each image's valid (height, width).
SIZE = "size"

_BYTES = (bytes, bytearray, memoryview)


class Spec(NamedTuple):
    """What every sample's value of one field must look like.

    Attributes:
        kind: One of the kinds above.
        dtype: The delivered numpy dtype (numeric and per-box fields), else None.
        shape: The shape of one sample's value (numeric), of one box's entry
            (per-box), else None.
    """

    kind: str
    dtype: Any = None
    shape: tuple[int, ...] | None = None

    def describe(self) -> str:
        if self.kind == NUMERIC:
            return f"{np.dtype(self.dtype).name} of shape {self.shape}"
        if self.kind == PER_BOX:
            return f"per-box {np.dtype(self.dtype).name} of shape {('N', *self.shape)}".replace("'N'", "N")
        if self.kind == POINTS:
            return f"keypoints of shape (N, {self.shape[0]}, 3)"
        return {MASKS: "a mask", BOX_LIST: "boxes", OBJECT: "a passed-through value",
                INSTANCES: "per-instance masks"}[self.kind]


INT_SCALAR = Spec(NUMERIC, np.dtype(np.int64), ())


def numeric(value: Any) -> np.ndarray | None:
    """``value`` as the array it is delivered as, or None when it is not numeric.

    Python ints and every numpy integer dtype become int64, floats keep their
    dtype (a Python float is float64, as ``default_collate`` makes it), bools
    stay bool. Lists and tuples of numbers and CPU tensors count as arrays.

    Raises:
        OverflowError: an integer outside int64.
    """
    if isinstance(value, (bool, np.bool_)):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise OverflowError(f"{value} does not fit in int64")
        return np.asarray(value, dtype=np.int64)
    if isinstance(value, float):
        return np.asarray(value, dtype=np.float64)
    if type(value).__module__ == "torch" and hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
    elif isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):  # ragged or mixed: not a fixed-shape array
            return None
    else:
        return None
    kind = arr.dtype.kind
    if kind in "iu":
        if kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) >= 1 << 63:
            raise OverflowError(f"uint64 value {int(arr.max())} does not fit in int64")
        return arr.astype(np.int64, copy=False)
    if kind in "fb":
        return arr
    return None


def per_box(name: str) -> bool:
    """Whether field ``name`` holds one entry per box (filtered with the boxes)."""
    return name.startswith(BOX_PREFIX) or name in (INSTANCE_MASKS, KEYPOINTS)
