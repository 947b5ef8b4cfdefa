"""Your own map-style Dataset, fed by feeder.

``FolderDataset`` is a Dataset as many training scripts have one: it lists a
folder of JPEGs and its ``__getitem__`` opens one with PIL and returns
``(PIL image, class index)``. Ported from DataLoader, the dataset is left as it
is (minus its transform) and wrapped in ``DatasetSource``; the crops and flips
are feeder's ops. Without ``--data`` it first generates a small folder of
photograph-like JPEGs under ``data/own-dataset``. Runs on the CPU, and on CUDA
when it is present.

    python examples/own_dataset.py
    python examples/own_dataset.py --data /path/to/train --epochs 5 --batch-size 128
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from PIL import Image
from torch import nn

from feeder import DatasetSource, Feeder, ops
from feeder.synthetic import make_image_folder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class FolderDataset(torch.utils.data.Dataset):
    """``root/<class>/<image>.jpg``; ``dataset[i]`` is (PIL image, class index)."""

    def __init__(self, root: str, transform=None) -> None:
        self.classes = sorted(os.listdir(root))
        self.samples = [(os.path.join(root, c, name), k) for k, c in enumerate(self.classes)
                        for name in sorted(os.listdir(os.path.join(root, c)))]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with open(path, "rb") as f:
            image = Image.open(f).convert("RGB")
        if self.transform is not None:
            image = self.transform(image)
        return image, label


def small_cnn(classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU(inplace=True))
    return nn.Sequential(block(3, 16), block(16, 32), block(32, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a folder of class folders of JPEGs (default: generate one)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--images", type=int, default=96, help="images to generate when --data is not given")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    root = args.data
    if root is None:
        root = os.path.join("data", "own-dataset")
        if not os.path.isdir(root):
            print(f"generating {args.images} images under {root} ...", flush=True)
            make_image_folder(root, classes=4, per_class=max(1, args.images // 4),
                              size_range=(72, 120), seed=0)
    dataset = FolderDataset(root)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = small_cnn(len(dataset.classes)).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    print(f"{len(dataset)} images, {len(dataset.classes)} classes, device {device}", flush=True)

    loader = Feeder(DatasetSource(dataset), batch_size=args.batch_size, shuffle=True, drop_last=True,
                    transforms=[ops.RandomResizedCrop(args.image_size), ops.RandomHorizontalFlip()],
                    normalize=(MEAN, STD), device=device, seed=0)
    with loader:
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            seen, loss_sum, t0 = 0, 0.0, time.perf_counter()
            for images, labels in loader:
                loss = loss_fn(model(images), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                seen += images.shape[0]
                loss_sum += loss.item() * images.shape[0]
            dt = time.perf_counter() - t0
            print(f"epoch {epoch}: {seen} images in {dt:.2f} s, loss {loss_sum / max(1, seen):.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
