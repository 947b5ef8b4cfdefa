"""Object detection fed by feeder: batches of images with a variable number of
boxes each, cropped and flipped with their image.

A small one-stage detector on a grid (each box is predicted by the cell that
holds its centre: objectness, class, box) shows how to consume the boxes: a
list of ``B`` float32 ``[Ni, 4]`` tensors on the device, with their labels
(``"box_labels"``) filtered alike. Without ``--data`` it first generates a
small synthetic set under ``data/detection`` (coloured rectangles of 3 classes
and their boxes). Runs on the CPU in seconds, and on CUDA when it is present.

    python examples/train_detection.py
    bash scripts/example.sh detection --epochs 5
    python examples/train_detection.py --data /path/to/set   # images/ + annotations.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from feeder import Feeder, ops
from feeder.errors import run_script
from feeder.synthetic import make_detection_set

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DetectionFiles:
    """A source of images with boxes: ``read`` returns the encoded image, its boxes
    (``[N, 4]``, x0 y0 x1 y1 in the image's pixels) and one label per box."""

    def __init__(self, records: list[dict]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def read(self, index: int) -> dict:
        r = self.records[index]
        with open(r["image"], "rb") as f:
            image = f.read()
        return {"image": image,
                "boxes": np.asarray(r["boxes"], np.float32).reshape(-1, 4),
                "box_labels": np.asarray(r["labels"], np.int64)}

    def describe(self, index: int) -> str:
        return self.records[index]["image"]


class GridDetector(nn.Module):
    """A stride-``cell`` CNN: per cell, objectness, class scores and a box."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        layers, cin = [], 3
        for cout in (16, 32, 64, 64):
            layers += [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout),
                       nn.ReLU(inplace=True)]
            cin = cout
        self.body = nn.Sequential(*layers)
        self.head = nn.Conv2d(cin, 5 + classes, 1)
        self.cell = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))  # [B, 5 + C, H / 16, W / 16]


def targets(boxes: list[torch.Tensor], labels: list[torch.Tensor], grid: tuple[int, int], cell: int,
            size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per cell: objectness [B, gh, gw], class [B, gh, gw] and box [B, 4, gh, gw]
    (centre offsets in the cell, width and height over the image size), from the
    batch's lists of boxes. The cell holding a box's centre predicts it."""
    B, (gh, gw) = len(boxes), grid
    device = boxes[0].device
    obj = torch.zeros((B, gh, gw), device=device)
    cls = torch.zeros((B, gh, gw), dtype=torch.int64, device=device)
    box = torch.zeros((B, 4, gh, gw), device=device)
    for b, (bx, lb) in enumerate(zip(boxes, labels)):
        if len(bx) == 0:
            continue
        cx, cy = (bx[:, 0] + bx[:, 2]) / 2, (bx[:, 1] + bx[:, 3]) / 2
        gx = (cx / cell).long().clamp(0, gw - 1)
        gy = (cy / cell).long().clamp(0, gh - 1)
        obj[b, gy, gx] = 1.0
        cls[b, gy, gx] = lb
        box[b, :, gy, gx] = torch.stack([cx / cell - gx, cy / cell - gy, (bx[:, 2] - bx[:, 0]) / size,
                                         (bx[:, 3] - bx[:, 1]) / size])
    return obj, cls, box, obj.bool()


def decode(out: torch.Tensor, cell: int, size: int) -> torch.Tensor:
    """Predicted boxes [B, gh, gw, 4] (x0, y0, x1, y1 in pixels)."""
    p = out[:, 1:5].sigmoid()
    gh, gw = out.shape[2:]
    gy, gx = torch.meshgrid(torch.arange(gh, device=out.device), torch.arange(gw, device=out.device),
                            indexing="ij")
    cx, cy = (gx + p[:, 0]) * cell, (gy + p[:, 1]) * cell
    w, h = p[:, 2] * size, p[:, 3] * size
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    x0, y0 = torch.maximum(a[..., 0], b[..., 0]), torch.maximum(a[..., 1], b[..., 1])
    x1, y1 = torch.minimum(a[..., 2], b[..., 2]), torch.minimum(a[..., 3], b[..., 3])
    inter = (x1 - x0).clamp(min=0) * (y1 - y0).clamp(min=0)
    area = lambda r: (r[..., 2] - r[..., 0]) * (r[..., 3] - r[..., 1])  # noqa: E731
    return inter / (area(a) + area(b) - inter).clamp(min=1e-6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="folder with annotations.json (default: generate data/detection)")
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--images", type=int, default=128, help="images to generate when --data is not given")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.epochs < 1:
        p.error(f"--epochs must be at least 1, got {args.epochs}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    root = args.data
    if root is None:
        root = os.path.join("data", "detection")
        if not os.path.isdir(root):
            print(f"generating {args.images} images with boxes under {root} ...", flush=True)
            make_detection_set(root, count=args.images, classes=args.classes, seed=0)
    with open(os.path.join(root, "annotations.json")) as f:
        source = DetectionFiles(json.load(f))
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GridDetector(args.classes).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    size = args.image_size
    print(f"{len(source)} images, {args.classes} classes, device {device}", flush=True)

    transforms = [ops.RandomResizedCrop(size, scale=(0.5, 1.0)), ops.RandomHorizontalFlip()]
    with Feeder(source, batch_size=args.batch_size, transforms=transforms, device=device,
                normalize=(MEAN, STD), shuffle=True, seed=0, drop_last=True) as feeder:
        for epoch in range(args.epochs):
            feeder.set_epoch(epoch)
            model.train()
            seen, loss_sum, found, total, t0 = 0, 0.0, 0, 0, time.perf_counter()
            for batch in feeder:
                images = batch["image"]         # float32 [B, 3, H, W] on device
                boxes = batch["boxes"]          # list of B float32 [Ni, 4], output pixels, on device
                labels = batch["box_labels"]    # list of B int64 [Ni], the boxes' own
                out = model(images)
                obj, cls, box, pos = targets(boxes, labels, out.shape[2:], model.cell, size)
                loss = F.binary_cross_entropy_with_logits(out[:, 0], obj)
                if pos.any():
                    loss = loss + F.cross_entropy(out[:, 5:].permute(0, 2, 3, 1)[pos], cls[pos])
                    loss = loss + 5 * F.l1_loss(out[:, 1:5].sigmoid().permute(0, 2, 3, 1)[pos],
                                                box.permute(0, 2, 3, 1)[pos])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                seen += images.shape[0]
                loss_sum += loss.item() * images.shape[0]
                with torch.no_grad():  # recall: a box found by its cell (IoU >= 0.5, right class)
                    pred = decode(out, model.cell, size)
                    hit = ((out[:, 0].sigmoid() > 0.5) & (out[:, 5:].argmax(1) == cls)
                           & (iou(pred, decode_targets(box, model.cell, size)) >= 0.5))
                    found += int((hit & pos).sum())
                    total += int(pos.sum())
            dt = time.perf_counter() - t0
            print(f"epoch {epoch}: {seen} images in {dt:.2f} s = {seen / dt:.0f} img/s, "
                  f"loss {loss_sum / max(1, seen):.3f}, recall@0.5 {found / max(1, total):.3f}", flush=True)
        print()
        print(feeder.stats())


def decode_targets(box: torch.Tensor, cell: int, size: int) -> torch.Tensor:
    """The target boxes of :func:`targets` back in pixels, [B, gh, gw, 4]."""
    gh, gw = box.shape[2:]
    gy, gx = torch.meshgrid(torch.arange(gh, device=box.device), torch.arange(gw, device=box.device),
                            indexing="ij")
    cx, cy = (gx + box[:, 0]) * cell, (gy + box[:, 1]) * cell
    w, h = box[:, 2] * size, box[:, 3] * size
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


if __name__ == "__main__":
    run_script(main)  # a bad argument or dataset: one line naming it, not a traceback
