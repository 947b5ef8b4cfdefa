"""Samples with per-instance masks and keypoints, and a numpy re-implementation of
torchvision's detection reference transforms (``references/detection/transforms.py``)
for a given draw, to compare feeder's fields with what the reference computes."""

from __future__ import annotations

import cv2
import numpy as np

#: The reference's ``_flip_coco_person_keypoints`` map (COCO's 17 person keypoints).
COCO_FLIP = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]


def instance_sample(seed: int, size: tuple[int, int] = (120, 160), count: tuple[int, int] = (1, 6),
                    keypoints: int = 17) -> dict:
    """An image (a horizontal ramp in red: a flip shows), ``count`` instances drawn as
    filled ellipses (their masks), the boxes around them, labels and ``keypoints``
    points per instance inside its box (visibility 0, 1 or 2; ``(0, 0, 0)`` when 0)."""
    rng = np.random.default_rng(seed)
    h, w = size
    img = np.zeros((h, w, 3), np.uint8)
    img[..., 0] = np.linspace(0, 255, w).astype(np.uint8)[None, :]
    img[..., 1] = rng.integers(0, 255, (h, w), dtype=np.uint8) // 4
    n = int(rng.integers(count[0], count[1] + 1))
    masks = np.zeros((n, h, w), np.uint8)
    boxes = np.zeros((n, 4), np.float32)
    points = np.zeros((n, keypoints, 3), np.float32)
    for k in range(n):
        while True:
            cy, cx = rng.uniform(0.1, 0.9) * h, rng.uniform(0.1, 0.9) * w
            ay, ax = rng.uniform(0.05, 0.3) * h, rng.uniform(0.05, 0.3) * w
            cv2.ellipse(masks[k], (int(cx), int(cy)), (int(ax), int(ay)), float(rng.uniform(0, 180)),
                        0, 360, 1, -1)
            ys, xs = np.nonzero(masks[k])
            if len(ys):
                break
        boxes[k] = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
        px = rng.uniform(boxes[k, 0], boxes[k, 2], keypoints)
        py = rng.uniform(boxes[k, 1], boxes[k, 3], keypoints)
        vis = rng.integers(0, 3, keypoints).astype(np.float32)
        points[k] = np.stack([px * (vis > 0), py * (vis > 0), vis], -1)
    return {"image": img, "boxes": boxes, "box_labels": rng.integers(1, 4, n), "masks": masks,
            "keypoints": points, "image_id": seed}


def flipped(image_chw) -> bool:
    """Whether a delivered image of :func:`instance_sample` was mirrored (its red ramp falls)."""
    red = np.asarray(image_chw[0], np.float64)
    return bool(red[:, 0].mean() > red[:, -1].mean())


def ref_resize(target: dict, orig: tuple[int, int], new: tuple[int, int]) -> dict:
    """The reference's ``RandomShortestSize``/``ScaleJitter`` on a target, to ``new``
    (height, width): boxes scaled, masks by ``F.resize(..., NEAREST)`` on tensors
    (``torch.nn.functional.interpolate``'s ``"nearest"``: source index
    ``floor(j * in / out)`` in float32). The reference leaves keypoints alone here;
    this scales them as it scales the boxes (what its model's own resize does)."""
    (H, W), (h, w) = orig, new
    out = dict(target)
    boxes = target["boxes"].astype(np.float32).copy()
    boxes[:, 0::2] *= np.float32(w / W)
    boxes[:, 1::2] *= np.float32(h / H)
    out["boxes"] = boxes

    def index(o: int, i: int) -> np.ndarray:
        if o == i:
            return np.arange(o)
        scale = np.float32(i) / np.float32(o)
        return np.minimum(np.floor(np.arange(o, dtype=np.float32) * scale).astype(np.intp), i - 1)

    m = target["masks"]
    out["masks"] = m[:, index(h, H)][:, :, index(w, W)]
    if "keypoints" in target:
        kp = target["keypoints"].copy()
        kp[..., 0] *= np.float32(w / W)
        kp[..., 1] *= np.float32(h / H)
        out["keypoints"] = kp
    return out


def ref_hflip(target: dict, width: int, flip_inds: list[int] = COCO_FLIP) -> dict:
    """The reference's ``RandomHorizontalFlip`` on a target, flipped: boxes mirrored,
    masks ``flip(-1)``, keypoints reordered by ``flip_inds``, ``x = width - x``, and
    ``(0, 0, 0)`` where the visibility is 0."""
    out = dict(target)
    boxes = target["boxes"].copy()
    boxes[:, [0, 2]] = width - target["boxes"][:, [2, 0]]
    out["boxes"] = boxes
    out["masks"] = target["masks"][:, :, ::-1]
    if "keypoints" in target:
        kp = target["keypoints"][:, flip_inds].copy()
        kp[..., 0] = width - kp[..., 0]
        kp[kp[..., 2] == 0] = 0
        out["keypoints"] = kp
    return out
