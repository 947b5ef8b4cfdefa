"""Where a map-style Dataset's ``__getitem__`` runs best under ``DatasetSource``,
against DataLoader over the same ``__getitem__``.

The Dataset decodes with PIL inside ``__getitem__`` (``Image.open(...).convert("RGB")``,
torchvision's ``pil_loader``), as most custom datasets do, and returns
``(PIL image, label)``. feeder then crops and flips
(``ops.RandomResizedCrop(224)``, ``ops.RandomHorizontalFlip()``) in these
arrangements:

* ``decode-threads``: ``__getitem__`` called by the decode threads
  (``read_threads=0``; what ``DatasetSource.reads_may_block = False`` gives);
* ``decode-threads=4``: the same with 4 decode threads (2 per core) instead
  of ``"auto"``'s one per core;
* ``read-threads=N``: a read stage of N threads calling ``__getitem__`` ahead
  of the decode threads (N=32: what ``read_threads="auto"`` gives a source that
  says its reads may block, on 2 cores);
* ``process``: ``isolation="process"``, the same threads in one worker process.

DataLoader (``num_workers=2``) runs the same ``__getitem__`` followed by the
same crop and flip in PIL (``feeder.bench.loaders.PILDataset``: torchvision's
``RandomResizedCrop`` + ``RandomHorizontalFlip`` + ``PILToTensor`` without
torchvision). Rounds alternate the arrangements; each is one pass over the
folder after its first batch. Figures: images per second, the median of the
rounds.

    python bench/experiments/dataset_adapter.py /tmp/feeder-bench-data/imagenet-like --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from feeder import DatasetSource, Feeder, ImageFolder, ops
from feeder.bench.loaders import PILDataset


class PILFolder(torch.utils.data.Dataset):
    """A custom Dataset as users write them: the path list of an image folder,
    ``__getitem__`` decoding with PIL and returning ``(PIL image, label)``."""

    def __init__(self, root: str) -> None:
        folder = ImageFolder(root)
        self.paths, self.labels = folder.paths, folder.labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        from PIL import Image

        with open(self.paths[index], "rb") as f:
            img = Image.open(f).convert("RGB")
        return img, self.labels[index]


def run_feeder(root: str, batch_size: int, **options) -> float:
    source = DatasetSource(PILFolder(root))
    with Feeder(source, batch_size, [ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()],
                shuffle=True, seed=0, timeout=300, **options) as f:
        it = iter(f)
        next(it)
        t0, n = time.perf_counter(), 0
        for images, _ in it:
            n += images.shape[0]
        return n / (time.perf_counter() - t0)


def run_dataloader(root: str, batch_size: int, workers: int) -> float:
    loader = torch.utils.data.DataLoader(PILDataset(root), batch_size=batch_size, shuffle=True,
                                         num_workers=workers, timeout=300)
    it = iter(loader)
    next(it)
    t0, n = time.perf_counter(), 0
    for images, _ in it:
        n += images.shape[0]
    rate = n / (time.perf_counter() - t0)
    del it
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="an image folder (bench data: feeder-bench make-data)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader's num_workers")
    args = parser.parse_args()
    arms = {
        "feeder decode-threads": lambda: run_feeder(args.root, args.batch_size, read_threads=0),
        "feeder decode-threads=4": lambda: run_feeder(args.root, args.batch_size, read_threads=0,
                                                      decode_threads=4),
        "feeder read-threads=4": lambda: run_feeder(args.root, args.batch_size, read_threads=4),
        "feeder read-threads=32": lambda: run_feeder(args.root, args.batch_size, read_threads=32),
        "feeder process": lambda: run_feeder(args.root, args.batch_size, read_threads=0,
                                             isolation="process"),
        f"DataLoader num_workers={args.workers}": lambda: run_dataloader(args.root, args.batch_size,
                                                                         args.workers),
    }
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, fn in arms.items():
            rates[name].append(fn())
            print(f"round {r + 1}: {name:<28} {rates[name][-1]:7.1f} img/s", flush=True)
    print(f"\n{len(PILFolder(args.root))} images under {args.root}; batch {args.batch_size}; "
          f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}); "
          f"torch {torch.__version__}")
    loader = statistics.median(rates[f"DataLoader num_workers={args.workers}"])
    print(f"{'arrangement':<28} {'median img/s':>12} {'rounds':>24} {'vs DataLoader':>14}")
    for name, values in rates.items():
        med = statistics.median(values)
        shown = " ".join(f"{v:.0f}" for v in values)
        print(f"{name:<28} {med:12.1f} {shown:>24} {med / loader:13.2f}x")


if __name__ == "__main__":
    main()
