"""torchvision's detection reference (``references/detection``) for
``maskrcnn_resnet50_fpn`` and ``keypointrcnn_resnet50_fpn``, its data pipeline
ported to feeder: per-instance masks and keypoints.

What the reference does, and where it is here:

* the dataset: COCO annotations (``ConvertCocoPolysToMask``): boxes from
  ``bbox`` (x, y, w, h) to (x0, y0, x1, y1), clipped to the image, degenerate
  ones dropped; one mask ``[H, W]`` per instance rasterized from its polygons
  (``masks``, uint8 ``[N, H, W]``); ``keypoints`` ``[N, 17, 3]``. Here the
  source does the same (with OpenCV's ``fillPoly`` in place of pycocotools)
  and returns ``{"image", "boxes", "box_labels", "masks", "keypoints",
  "image_id"}``.
* training, ``--data-augmentation hflip``: ``RandomHorizontalFlip(0.5)``, which
  flips masks and swaps left/right keypoints (``_flip_coco_person_keypoints``);
  ``multiscale``: ``RandomShortestSize((480, 512, ..., 800), 1333)`` then the
  flip. Here: the same built-ins, the flip given COCO's keypoint map
  (``ops.COCO_PERSON_KEYPOINT_FLIP``), masks moved with the image (nearest) and
  filtered with their boxes. ``GroupedBatchSampler`` (factor 3):
  ``group_by_aspect_ratio=3``; the ``collate_fn`` and the lists the model
  takes: ``max_image_size`` with ``size_divisibility=32`` and
  ``batch.images_and_targets()``, whose targets hold ``masks`` uint8
  ``[N, h, w]`` (each cut to its image) and ``keypoints`` ``[N, 17, 3]``.
* evaluation: no augmentation, ``batch_size=1``, each image at its own size.

Runs on generated data (ellipse "people" with polygons and 17 keypoints each,
written as a COCO-style ``annotations.json``) without ``--data``, on the CPU
in seconds, a few steps of each loader, handing the batches to a stand-in for
the model's forward that checks what Mask R-CNN / Keypoint R-CNN take.

    python examples/reference_instances.py --model maskrcnn_resnet50_fpn --steps 3
    python examples/reference_instances.py --model keypointrcnn_resnet50_fpn --data-augmentation multiscale
"""

from __future__ import annotations

import argparse
import json
import os

import cv2
import numpy as np
import torch

from feeder import Feeder, ops

MULTISCALE = (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)


def make_instance_set(root: str, count: int = 24, seed: int = 0) -> None:
    """``root/images/*.png`` and a COCO-style ``root/annotations.json``."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    images, annotations = [], []
    for i in range(count):
        h, w = (int(v) for v in rng.integers(64, 161, 2))
        img = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
        for _ in range(int(rng.integers(1, 5))):
            cx, cy = rng.uniform(0.2, 0.8) * w, rng.uniform(0.2, 0.8) * h
            ax, ay = rng.uniform(0.08, 0.2) * w, rng.uniform(0.1, 0.3) * h
            t = np.linspace(0, 2 * np.pi, 24, endpoint=False)
            poly = np.stack([cx + ax * np.cos(t), cy + ay * np.sin(t)], 1)
            cv2.fillPoly(img, [np.round(poly).astype(np.int32)], tuple(int(c) for c in rng.integers(120, 256, 3)))
            x0, y0 = poly.min(0)
            x1, y1 = poly.max(0)
            # 17 keypoints: the nose, then left/right pairs, left on the image's left.
            kp = np.zeros((17, 3))
            kp[0] = (cx, cy - 0.8 * ay, 2)
            for k in range(1, 17, 2):
                y = cy + ay * (-0.7 + 1.5 * k / 17)
                kp[k] = (cx - 0.5 * ax, y, 2)      # left
                kp[k + 1] = (cx + 0.5 * ax, y, 1)  # right
            annotations.append({"id": len(annotations), "image_id": i, "category_id": 1, "iscrowd": 0,
                                "bbox": [x0, y0, x1 - x0, y1 - y0], "area": float(ax * ay * np.pi),
                                "segmentation": [poly.ravel().round(2).tolist()],
                                "keypoints": kp.ravel().round(2).tolist(), "num_keypoints": 17})
        name = f"{i:05d}.png"
        cv2.imwrite(os.path.join(root, "images", name), img[..., ::-1])
        images.append({"id": i, "file_name": name, "height": h, "width": w})
    with open(os.path.join(root, "annotations.json"), "w") as f:
        json.dump({"images": images, "annotations": annotations,
                   "categories": [{"id": 1, "name": "person"}]}, f)


class CocoInstances:
    """A COCO-style set as the reference's ``CocoDetection`` + ``ConvertCocoPolysToMask``
    make its targets: boxes, labels, per-instance masks, keypoints."""

    def __init__(self, root: str) -> None:
        self.root = root
        with open(os.path.join(root, "annotations.json")) as f:
            coco = json.load(f)
        self.images = coco["images"]
        self.anns: dict[int, list] = {im["id"]: [] for im in self.images}
        for a in coco["annotations"]:
            self.anns[a["image_id"]].append(a)

    def __len__(self) -> int:
        return len(self.images)

    def describe(self, index: int) -> str:
        return self.images[index]["file_name"]

    def read(self, index: int) -> dict:
        info = self.images[index]
        h, w = info["height"], info["width"]
        anns = [a for a in self.anns[info["id"]] if not a.get("iscrowd", 0)]
        boxes = np.asarray([a["bbox"] for a in anns], np.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2] = boxes[:, 0::2].clip(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clip(0, h)
        masks = np.zeros((len(anns), h, w), np.uint8)
        for k, a in enumerate(anns):
            polys = [np.round(np.asarray(p).reshape(-1, 2)).astype(np.int32) for p in a["segmentation"]]
            cv2.fillPoly(masks[k], polys, 1)
        keypoints = np.asarray([a["keypoints"] for a in anns], np.float32).reshape(len(anns), -1, 3)
        keep = (boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])
        with open(os.path.join(self.root, "images", info["file_name"]), "rb") as f:
            data = f.read()
        return {"image": data, "boxes": boxes[keep],
                "box_labels": np.asarray([a["category_id"] for a in anns], np.int64)[keep],
                "masks": masks[keep], "keypoints": keypoints[keep], "image_id": info["id"]}


def model_inputs(images: list[torch.Tensor], targets: list[dict], model: str) -> int:
    """Stand-in for ``model(images, targets)`` of Mask R-CNN / Keypoint R-CNN: the checks
    its ``GeneralizedRCNNTransform`` and ROI heads make on what they take. Returns the
    instances seen."""
    seen = 0
    for img, t in zip(images, targets):
        assert img.dim() == 3 and img.shape[0] == 3 and img.is_floating_point()
        h, w = img.shape[1:]
        boxes, n = t["boxes"], len(t["boxes"])
        assert boxes.shape == (n, 4) and t["labels"].shape == (n,)
        assert (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()
        if model.startswith("maskrcnn"):
            masks = t["masks"]
            assert masks.shape == (n, h, w) and masks.dtype == torch.uint8
            for box, mask in zip(boxes, masks):  # each mask in its box (but rasterizing's edge)
                x0, y0, x1, y1 = box.floor().int().tolist()
                assert mask[y0:y1 + 1, x0:x1 + 1].sum() >= 0.9 * mask.sum()
        else:
            kp = t["keypoints"]
            assert kp.shape == (n, 17, 3) and kp.dtype == torch.float32
            seen_kp = kp[..., 2] > 0
            assert (kp[..., 0][seen_kp] <= w).all() and (kp[..., 1][seen_kp] <= h).all()
        seen += n
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="images/ + COCO-style annotations.json (default: generated)")
    p.add_argument("--model", default="maskrcnn_resnet50_fpn",
                   choices=("maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn"))
    p.add_argument("--data-augmentation", default="hflip", choices=("hflip", "multiscale"))
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="batches of each loader")
    p.add_argument("--aspect-ratio-group-factor", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    root = args.data or "data/reference-instances"
    if not args.data and not os.path.isfile(os.path.join(root, "annotations.json")):
        make_instance_set(root)
    source = CocoInstances(root)
    flip = ops.RandomHorizontalFlip(0.5, keypoint_flip=ops.COCO_PERSON_KEYPOINT_FLIP)
    if args.data_augmentation == "hflip":
        transforms, largest = [flip], 1333  # images at their own size (the model resizes them)
    else:
        transforms, largest = [ops.RandomShortestSize(MULTISCALE, 1333), flip], 1333
    common = dict(dtype=torch.float32, device=args.device, size_divisibility=32,
                  max_image_size=(largest, largest))
    group = args.aspect_ratio_group_factor if args.aspect_ratio_group_factor >= 0 else False
    train = Feeder(source, args.batch_size, transforms, shuffle=True, drop_last=group is False,
                   group_by_aspect_ratio=group, **common)
    val = Feeder(source, 1, [], shuffle=False, **common)
    rename = {"box_labels": "labels"}
    with train, val:
        for step, batch in zip(range(args.steps), train):
            images, targets = batch.images_and_targets(rename=rename)
            n = model_inputs(images, targets, args.model)
            shapes = [tuple(i.shape[1:]) for i in images]
            print(f"train step {step}: padded {tuple(batch['image'].shape)}, images {shapes}, "
                  f"{n} instances")
        for step, batch in zip(range(args.steps), val):
            images, targets = batch.images_and_targets(rename=rename)
            model_inputs(images, targets, args.model)
            h, w = batch["size"][0].tolist()
            print(f"eval step {step}: native size {h}x{w}, {len(targets[0]['boxes'])} instances")
        print("feeder:", train.stats())


if __name__ == "__main__":
    main()
