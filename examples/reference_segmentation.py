"""torchvision's semantic segmentation reference (``references/segmentation``), its
data pipeline ported to feeder.

What the reference's ``train.py`` and ``presets.py`` do, and where it is here:

* training: ``RandomResize(0.5 * base_size, 2.0 * base_size)`` (a random shorter
  side), ``RandomHorizontalFlip(0.5)``, ``RandomCrop(crop_size)`` padding the
  image with 0 and the mask with 255 (the loss's ignore index) when it is smaller
  than the crop, ``ToDtype(float32, scale=True)``, ``Normalize``; a random
  sampler, ``drop_last=True``; ``collate_fn`` pads images with 0 and masks with
  255. Here: the same three transforms, in the same order
  (``ops.RandomResize``, ``ops.RandomHorizontalFlip``, ``ops.RandomCrop`` with
  ``pad_at="end"``, as the reference's ``pad_if_smaller``, and
  ``mask_fill=255``), ``normalize=`` for the dtype and normalization,
  ``shuffle=True, drop_last=True``.
* evaluation: ``RandomResize(base_size, base_size)`` (the shorter side to
  ``base_size``, the aspect ratio kept), ``batch_size=1``, in order. Here:
  ``ops.Resize(base_size)`` with ``max_image_size``: each image at its own size,
  exactly as resized, its mask alike.

Runs on generated data (``feeder.synthetic.make_segmentation_set``) without
``--data``, on the CPU in seconds, a few steps of each loader, with a
per-pixel classifier standing in for the reference's models and its loss
(``cross_entropy(..., ignore_index=255)``) and its confusion-matrix evaluation.

    python examples/reference_segmentation.py --steps 3
    python examples/reference_segmentation.py --data /path/to/set   # images/*.jpg + masks/*.png
"""

from __future__ import annotations

import argparse
import glob
import os

import torch
from torch import nn
from torch.nn import functional as F

from feeder import Feeder, ops
from feeder.synthetic import make_segmentation_set

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
IGNORE = 255  # the references' ignore index: the loss leaves these pixels out


class SegmentationFiles:
    """``images/NAME.jpg`` with ``masks/NAME.png`` (class ids), as the reference's datasets give them."""

    def __init__(self, root: str) -> None:
        self.images = sorted(glob.glob(os.path.join(root, "images", "*.jpg")))
        if not self.images:
            raise SystemExit(f"no images under {root}/images")

    def __len__(self) -> int:
        return len(self.images)

    def read(self, index: int) -> dict:
        path = self.images[index]
        mask = os.path.join(os.path.dirname(os.path.dirname(path)), "masks",
                            os.path.basename(path)[:-4] + ".png")
        with open(path, "rb") as image, open(mask, "rb") as m:
            return {"image": image.read(), "mask": m.read()}

    def describe(self, index: int) -> str:
        return self.images[index]


def loaders(root: str, base_size: int, crop_size: int, batch_size: int, device: str,
            max_side: int) -> tuple[Feeder, Feeder]:
    source = SegmentationFiles(root)
    train = Feeder(source, batch_size, shuffle=True, drop_last=True, device=device,
                   transforms=[ops.RandomResize(base_size // 2, base_size * 2),
                               ops.RandomHorizontalFlip(0.5),
                               # pad_if_smaller: right and bottom, the mask with 255
                               ops.RandomCrop(crop_size, pad_at="end", fill=0, mask_fill=IGNORE)],
                   normalize=(MEAN, STD))
    # Evaluation at the images' own size: one per batch, as the reference does.
    val = Feeder(source, 1, shuffle=False, device=device, transforms=[ops.Resize(base_size)],
                 normalize=(MEAN, STD), max_image_size=(max_side, max_side))
    return train, val


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="images/ and masks/ (default: generate data/reference-segmentation)")
    p.add_argument("--base-size", type=int, default=52, help="the reference's 520, scaled to the data")
    p.add_argument("--crop-size", type=int, default=48, help="the reference's 480, scaled alike")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="batches of each loader")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    root = args.data or "data/reference-segmentation"
    if not args.data and not os.path.isdir(os.path.join(root, "images")):
        make_segmentation_set(root, count=32, size_range=(60, 100), classes=args.classes, seed=0)
    # The largest evaluation image: the longer side when the shorter is base_size
    # (the generated images' aspect ratios stay within 100 / 60).
    max_side = -(-args.base_size * 100 // 60)
    train, val = loaders(root, args.base_size, args.crop_size, args.batch_size, args.device, max_side)
    model = nn.Conv2d(3, args.classes, 3, padding=1).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with train, val:
        for step, batch in zip(range(args.steps), train):
            images, targets = batch["image"], batch["mask"].long()
            assert images.shape == (args.batch_size, 3, args.crop_size, args.crop_size)
            loss = F.cross_entropy(model(images), targets, ignore_index=IGNORE)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"train step {step}: images {tuple(images.shape)}, loss {loss.item():.3f}, "
                  f"ignored pixels {(targets == IGNORE).float().mean().item():.3f}")
        confusion = torch.zeros(args.classes, args.classes, dtype=torch.int64)
        with torch.no_grad():
            for step, batch in zip(range(args.steps), val):
                image, target = batch["image"], batch["mask"].long()  # [1, 3, h, w], [1, h, w]
                h, w = batch["size"][0].tolist()
                assert image.shape[2:] == (h, w) and min(h, w) == args.base_size
                pred = model(image).argmax(1)
                keep = target != IGNORE
                confusion += torch.bincount(target[keep] * args.classes + pred[keep],
                                            minlength=args.classes ** 2).view(args.classes, -1).cpu()
                print(f"eval step {step}: native size {h}x{w}")
        print(f"pixel accuracy {confusion.diag().sum().item() / max(1, confusion.sum().item()):.3f}")
        print("feeder:", train.stats())


if __name__ == "__main__":
    main()
