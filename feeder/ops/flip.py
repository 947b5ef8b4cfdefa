"""The left-right flip on uint8 [H, W, 3] images, which masks, boxes and keypoints
follow (keypoints by a map of which ones swap places)."""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np

from .base import Geometry, Transform, check_number


#: The left/right map of COCO's 17 person keypoints (nose, eyes, ears, shoulders,
#: elbows, wrists, hips, knees, ankles: each left one swaps with its right one),
#: for ``RandomHorizontalFlip(keypoint_flip=...)``; torchvision's detection
#: reference flips them so.
COCO_PERSON_KEYPOINT_FLIP = (0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15)


def _flip_map(value: Sequence[int] | None) -> np.ndarray | None:
    if value is None:
        return None
    what = "RandomHorizontalFlip"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{what}: keypoint_flip must be a sequence of keypoint indices, got "
                         f"{value!r}")
    items = tuple(value)
    k = len(items)
    if (not k or not all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))
                         for i in items) or sorted(int(i) for i in items) != list(range(k))):
        raise ValueError(f"{what}: keypoint_flip must hold each of 0..K-1 once (entry k: the "
                         f"keypoint that takes keypoint k's place when flipped), got {value!r}")
    order = np.asarray(items, np.intp)
    if (order[order] != np.arange(k)).any():
        k0 = int(np.flatnonzero(order[order] != np.arange(k))[0])
        raise ValueError(f"{what}: keypoint_flip must swap keypoints in pairs (flipping twice "
                         f"gives them back), but {k0} goes to {int(order[k0])}, which goes to "
                         f"{int(order[order[k0]])}: got {value!r}")
    return order


class RandomHorizontalFlip(Transform):
    """Mirror left-right with probability ``p``. Works in place.

    Boxes, masks and per-instance masks follow the image. Keypoints (the
    ``"keypoints"`` field) also need to know which of them swap places, the
    left eye becoming the right one: ``keypoint_flip`` says it, and a sample
    with keypoints through a flip without it is a :class:`~feeder.ConfigError`
    (feeder does not guess a map from the number of keypoints).

    Args:
        p: Probability of a flip.
        keypoint_flip: For samples with keypoints ``[N, K, 3]``: entry ``k`` is
            the keypoint that takes keypoint ``k``'s place in a flipped sample
            (each of ``0..K-1`` once, in pairs: :data:`COCO_PERSON_KEYPOINT_FLIP`
            for COCO's person keypoints, ``list(range(K))`` to swap none).

    Raises:
        ValueError: ``p`` not in [0, 1], ``keypoint_flip`` not such a map.
    """

    preserves_size = True
    inplace = True

    def __init__(self, p: float = 0.5, keypoint_flip: Sequence[int] | None = None) -> None:
        self.p = check_number(p, "p", "RandomHorizontalFlip", 0.0, 1.0)
        self.keypoint_flip = _flip_map(keypoint_flip)

    def apply(self, img, rng, out=None, ctx=None):
        flip = rng.random() < self.p
        if out is None:
            return cv2.flip(img, 1) if flip else img
        if flip:
            cv2.flip(img, 1, dst=out)  # OpenCV's horizontal flip is safe in place
        elif out is not img:
            np.copyto(out, img)
        return out

    def apply_geometry(self, img, rng, out=None, ctx=None):
        H, W = img.shape[:2]
        flipped = rng.random() < self.p
        if out is None:
            result = cv2.flip(img, 1) if flipped else img
        else:
            if flipped:
                cv2.flip(img, 1, dst=out)
            elif out is not img:
                np.copyto(out, img)
            result = out
        geometry = Geometry(1.0, 0.0, -1.0, float(W), H, W) if flipped else Geometry.identity(H, W)
        if self.keypoint_flip is None:
            geometry.unmapped = self
        elif flipped:
            geometry.order = self.keypoint_flip
        return result, geometry

    def __repr__(self) -> str:
        extra = "" if self.keypoint_flip is None else f", keypoint_flip={self.keypoint_flip.tolist()}"
        return f"RandomHorizontalFlip(p={self.p}{extra})"
