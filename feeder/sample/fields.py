"""What travels between the stages for one sample, the sample protocol every
source speaks, and the limits every stage shares.

A source's ``read(index)`` returns one of:

* ``(image, label)``: the classic pair; batches are ``(images, labels)``.
* a dict with an ``"image"`` key holding the image, and any of:

  ``"mask"``
      a single-channel PNG (8- or 16-bit gray, or palette: its indices), a
      uint8/uint16 ``[H, W]`` array or tensor, or a PIL image of mode ``L``,
      ``P`` (its indices), ``1`` or ``I;16``, the image's full size. Moved with the
      image by every geometric transform (nearest neighbour, never mixing ids).
  ``"boxes"``
      float ``[N, 4]``, ``(x0, y0, x1, y1)`` in the image's pixels.
  ``"box_<name>"``
      a per-box array ``[N, ...]`` (``"box_labels"``...), filtered with the boxes.
  ``"masks"``
      per-instance masks, one per box: a uint8 or bool ``[N, H, W]`` array or
      tensor of the image's full size (torchvision's ``target["masks"]``).
      Moved with the image by every geometric transform (nearest neighbour,
      0 outside the image), filtered with the boxes; batched as a list of
      uint8 ``[N_i, H, W]`` tensors.
  ``"keypoints"``
      per-instance keypoints, one set per box: float ``[N, K, 3]``, ``(x, y,
      visibility)`` in the image's pixels (torchvision's
      ``target["keypoints"]``). Moved with the image, filtered with the boxes;
      a keypoint leaving the image becomes ``(0, 0, 0)``; a mirroring flip
      swaps left and right by its ``keypoint_flip`` map.
  any other key
      a number or fixed-shape numeric array (stacked into ``[B, ...]``), or
      anything else (str, bytes, dict, None: passed through as a list).

  Batches are then dicts with the same keys.

An image is encoded bytes (decoded by the decode step) or an image already
decoded (:func:`pixels`): a uint8 numpy array ``[H, W, 3]`` (HWC, RGB),
``[H, W]``, ``[H, W, 1]`` or ``[H, W, 4]`` (RGBA: the alpha is dropped, as for
an RGBA file); a uint8 torch tensor, ``[C, H, W]`` (torchvision's layout) when
its first dimension is 1, 3 or 4, else ``[H, W, C]``; or a PIL image.

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
