"""Semantic segmentation fed by feeder: image + mask batches, one random crop and
flip for both.

Without ``--data`` it first generates a small synthetic set under
``data/segmentation`` (objects of 3 classes in their own colours on a gray
photograph-like background, and their masks). Runs on the CPU in seconds, and
on CUDA when it is present.

    python examples/train_segmentation.py
    bash scripts/example.sh segmentation --epochs 5
    python examples/train_segmentation.py --data /path/to/set   # images/*.jpg + masks/*.png, same stems
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
from torch import nn
from torch.nn import functional as F

from feeder import Feeder, ops
from feeder.errors import run_script
from feeder.synthetic import make_segmentation_set

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class SegmentationFiles:
    """A source of (image, mask) file pairs: ``read`` returns the sample as a dict of
    encoded bytes; feeder decodes both and moves the mask with every crop and flip."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def read(self, index: int) -> dict:
        image_path, mask_path = self.pairs[index]
        with open(image_path, "rb") as f:
            image = f.read()
        with open(mask_path, "rb") as f:
            mask = f.read()
        return {"image": image, "mask": mask}

    def describe(self, index: int) -> str:
        return self.pairs[index][0]


def pairs_in(root: str) -> list[tuple[str, str]]:
    """``root/images/<stem>.*`` with ``root/masks/<stem>.png``."""
    masks = {os.path.splitext(n)[0]: os.path.join(root, "masks", n) for n in os.listdir(os.path.join(root, "masks"))}
    pairs = []
    for name in sorted(os.listdir(os.path.join(root, "images"))):
        stem = os.path.splitext(name)[0]
        if stem in masks:
            pairs.append((os.path.join(root, "images", name), masks[stem]))
    if not pairs:
        raise SystemExit(f"no image with a mask of the same name under {root}/images and {root}/masks")
    return pairs


class SmallSegNet(nn.Module):
    """Three stride-2 stages down, bilinear upsampling back, a skip at 1/2 scale."""

    def __init__(self, classes: int) -> None:
        super().__init__()

        def block(cin: int, cout: int, stride: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))
        self.down1 = block(3, 16, 2)
        self.down2 = block(16, 32, 2)
        self.down3 = block(32, 64, 2)
        self.up = block(64 + 16, 32, 1)
        self.head = nn.Conv2d(32, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d3 = self.down3(self.down2(d1))
        u = F.interpolate(d3, size=d1.shape[2:], mode="bilinear", align_corners=False)
        u = self.up(torch.cat([u, d1], dim=1))
        return F.interpolate(self.head(u), size=x.shape[2:], mode="bilinear", align_corners=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="folder with images/ and masks/ (default: generate data/segmentation)")
    p.add_argument("--classes", type=int, default=4, help="classes, background included")
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
        root = os.path.join("data", "segmentation")
        if not os.path.isdir(root):
            print(f"generating {args.images} images and masks under {root} ...", flush=True)
            make_segmentation_set(root, count=args.images, classes=args.classes, seed=0)
    source = SegmentationFiles(pairs_in(root))
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = SmallSegNet(args.classes).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    print(f"{len(source)} images, {args.classes} classes, device {device}", flush=True)

    transforms = [ops.RandomResizedCrop(args.image_size, scale=(0.3, 1.0)), ops.RandomHorizontalFlip()]
    with Feeder(source, batch_size=args.batch_size, transforms=transforms, device=device,
                normalize=(MEAN, STD), shuffle=True, seed=0, drop_last=True) as feeder:
        for epoch in range(args.epochs):
            feeder.set_epoch(epoch)
            model.train()
            seen, loss_sum, t0 = 0, 0.0, time.perf_counter()
            hits = torch.zeros((), device=device)
            inter = torch.zeros(args.classes, device=device)
            union = torch.zeros(args.classes, device=device)
            for batch in feeder:
                images = batch["image"]       # float32 [B, 3, H, W], normalized, on device
                masks = batch["mask"].long()  # uint8 [B, H, W] class ids -> int64 for the loss
                logits = model(images)
                loss = F.cross_entropy(logits, masks)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                seen += images.shape[0]
                loss_sum += loss.item() * images.shape[0]
                with torch.no_grad():
                    pred = logits.argmax(1)
                    hits += (pred == masks).sum()
                    for c in range(args.classes):
                        inter[c] += ((pred == c) & (masks == c)).sum()
                        union[c] += ((pred == c) | (masks == c)).sum()
            dt = time.perf_counter() - t0
            pixels = seen * args.image_size * args.image_size
            miou = (inter / union.clamp(min=1)).mean().item()
            print(f"epoch {epoch}: {seen} images in {dt:.2f} s = {seen / dt:.0f} img/s, "
                  f"loss {loss_sum / max(1, seen):.3f}, pixel accuracy {hits.item() / max(1, pixels):.3f}, "
                  f"mIoU {miou:.3f}", flush=True)
        print()
        print(feeder.stats())


if __name__ == "__main__":
    run_script(main)  # a bad argument or dataset: one line naming it, not a traceback
