"""torchvision's object detection reference (``references/detection``), its data
pipeline ported to feeder.

What the reference's ``train.py`` and ``presets.py`` do, and where it is here:

* training: ``RandomHorizontalFlip(0.5)`` of the image and its boxes (preset
  ``"hflip"``), ``ToDtype(float32, scale=True)``; ``GroupedBatchSampler`` over a
  random sampler with ``create_aspect_ratio_groups(k=3)``
  (``--aspect-ratio-group-factor 3``); ``collate_fn=lambda b: tuple(zip(*b))``:
  a tuple of images at their own size and a tuple of target dicts. The model's
  ``GeneralizedRCNNTransform`` then resizes (shorter side 800, longer at most
  1333), normalizes and pads the batch to a multiple of 32. Here: the built-in
  flip moves the boxes with the image, ``group_by_aspect_ratio=3``, ``dtype``
  for the scaling, and ``max_image_size`` with ``size_divisibility=32``: each
  batch arrives padded to its largest image, rounded to 32, with every image's
  size, from which the ``(images, targets)`` lists the model takes are views.
* evaluation: no augmentation, ``batch_size=1``, in order, each image at its
  own size: the same, with ``batch_size=1`` and no flip.

The model's own resize stays in the model, as in the reference (a resize in the
loader would need ``ops.Resize(800, max_size=1333)``). Runs on generated data
(``feeder.synthetic.make_detection_set``) without ``--data``, on the CPU in
seconds, a few steps of each loader, handing the batches to a stand-in for a
torchvision detection model's forward (it takes and checks the same inputs).

    python examples/reference_detection.py --steps 3
    python examples/reference_detection.py --data /path/to/set   # images/ + annotations.json
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from feeder import Feeder, ops
from feeder.synthetic import make_detection_set


class DetectionFiles:
    """``annotations.json``: ``[{"image": path, "boxes": [[x0, y0, x1, y1], ...], "labels": [...]}]``."""

    def __init__(self, root: str) -> None:
        with open(os.path.join(root, "annotations.json")) as f:
            self.records = json.load(f)

    def __len__(self) -> int:
        return len(self.records)

    def read(self, index: int) -> dict:
        r = self.records[index]
        with open(r["image"], "rb") as f:
            return {"image": f.read(),
                    "boxes": np.asarray(r["boxes"], np.float32).reshape(-1, 4),
                    "box_labels": np.asarray(r["labels"], np.int64),
                    "image_id": index}

    def describe(self, index: int) -> str:
        return self.records[index]["image"]


def detection_model_inputs(images: list[torch.Tensor], targets: list[dict] | None) -> int:
    """Stand-in for ``model(images, targets)`` of a torchvision detection model: the
    checks its ``GeneralizedRCNNTransform`` makes on its inputs. Returns the boxes seen."""
    seen = 0
    for k, img in enumerate(images):
        assert img.dim() == 3 and img.shape[0] == 3 and img.is_floating_point()
        assert 0.0 <= float(img.min()) and float(img.max()) <= 1.0
        if targets is not None:
            boxes = targets[k]["boxes"]
            assert boxes.shape[-1] == 4 and len(boxes) == len(targets[k]["labels"])
            assert (boxes[:, 2] <= img.shape[2]).all() and (boxes[:, 3] <= img.shape[1]).all()
            seen += len(boxes)
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="images/ + annotations.json (default: generate data/reference-detection)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="batches of each loader")
    p.add_argument("--max-side", type=int, default=160, help="the largest image side in the data")
    p.add_argument("--aspect-ratio-group-factor", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    root = args.data or "data/reference-detection"
    if not args.data and not os.path.isfile(os.path.join(root, "annotations.json")):
        make_detection_set(root, count=32, size_range=(64, 160), seed=0)
    source = DetectionFiles(root)
    common = dict(dtype=torch.float32, device=args.device, size_divisibility=32,
                  max_image_size=(args.max_side, args.max_side))
    group = args.aspect_ratio_group_factor if args.aspect_ratio_group_factor >= 0 else False
    train = Feeder(source, args.batch_size, [ops.RandomHorizontalFlip(0.5)], shuffle=True,
                   drop_last=group is False, group_by_aspect_ratio=group, **common)
    val = Feeder(source, 1, [], shuffle=False, **common)
    with train, val:
        for step, batch in zip(range(args.steps), train):
            images, targets = batch.images_and_targets(rename={"box_labels": "labels"})
            boxes = detection_model_inputs(images, targets)
            shapes = [tuple(i.shape[1:]) for i in images]
            print(f"train step {step}: padded {tuple(batch['image'].shape)}, images {shapes}, "
                  f"{boxes} boxes")
        for step, batch in zip(range(args.steps), val):
            images, targets = batch.images_and_targets(rename={"box_labels": "labels"})
            detection_model_inputs(images, None)
            h, w = batch["size"][0].tolist()
            print(f"eval step {step}: native size {h}x{w}, padded {tuple(batch['image'].shape[2:])}")
        print("feeder:", train.stats())


if __name__ == "__main__":
    main()
