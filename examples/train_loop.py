"""A custom training loop fed by feeder.

Trains a small CNN on an ImageFolder dataset. Without ``--data`` it first
generates a small synthetic one (photograph-like JPEGs, 10 classes) under
``data/example``. Runs on the CPU, and on CUDA when it is present.

    python examples/train_loop.py                    # generated data
    python examples/train_loop.py --data /path/to/train --epochs 5 --batch-size 128
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
from torch import nn

from feeder import Feeder, ImageFolder, ops
from feeder.errors import run_script
from feeder.synthetic import make_image_folder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def small_cnn(classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU(inplace=True))
    return nn.Sequential(block(3, 16), block(16, 32), block(32, 64), block(64, 128),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="ImageFolder root (default: generate data/example)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--decode-threads", default="auto")
    p.add_argument("--augment-threads", default="auto")
    p.add_argument("--images", type=int, default=640, help="images to generate when --data is not given")
    args = p.parse_args()
    if args.epochs < 1:
        p.error(f"--epochs must be at least 1, got {args.epochs}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    root = args.data
    if root is None:
        root = os.path.join("data", "example")
        if not os.path.isdir(root):
            print(f"generating {args.images} images under {root} ...", flush=True)
            make_image_folder(root, classes=10, per_class=max(1, args.images // 10), seed=0)
    source = ImageFolder(root)
    device = torch.device(args.device)
    threads = {k: (v if v == "auto" else int(v)) for k, v in
               (("decode_threads", args.decode_threads), ("augment_threads", args.augment_threads))}

    model = small_cnn(len(source.classes)).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    print(f"{len(source)} images, {len(source.classes)} classes, device {device}", flush=True)

    with Feeder(source, batch_size=args.batch_size,
                transforms=[ops.RandomResizedCrop(args.image_size), ops.RandomHorizontalFlip()],
                device=device, normalize=(MEAN, STD), shuffle=True, seed=0, drop_last=True,
                **threads) as feeder:
        for epoch in range(args.epochs):
            feeder.set_epoch(epoch)
            model.train()
            seen, loss_sum, t0 = 0, 0.0, time.perf_counter()
            for images, labels in feeder:
                loss = loss_fn(model(images), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                seen += images.shape[0]
                loss_sum += loss.item() * images.shape[0]
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            print(f"epoch {epoch}: {seen} images in {dt:.2f} s = {seen / dt:.0f} img/s, "
                  f"loss {loss_sum / max(1, seen):.3f}", flush=True)
        print()
        print(feeder.stats())


if __name__ == "__main__":
    run_script(main)  # a bad argument or dataset: one line naming it, not a traceback
