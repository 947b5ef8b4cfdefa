"""A source of images already decoded (uint8 HWC arrays in memory) under feeder
and under DataLoader with the same per-sample work.

The first ``--limit`` images of an image folder are decoded once, up front,
into RGB arrays held in memory (as an HDF5/NPZ/LMDB array dataset, rendered
frames or a cache of decoded images give them). A map-style Dataset returns
``(array, label)``. Then, with the same RandomResizedCrop(224) + horizontal
flip (feeder's own per-sample work, ``feeder.bench.loaders.sample_work``, the
object the engine's steps call):

* ``feeder``: ``Feeder(DatasetSource(dataset), ...)`` with its defaults;
* ``feeder read_threads=0``: ``__getitem__`` called by the decode threads
  (it only indexes a list: a read stage of its own buys nothing);
* ``DataLoader``: ``num_workers`` worker processes (forked: the arrays are
  shared with the parent, not copied), each calling ``__getitem__`` and the
  same work into a fresh array, OpenCV on one thread per worker.

Rounds alternate the arms; each is one pass after its first batch. Figures:
images per second, the median of the rounds, and each arm against DataLoader.

    python bench/experiments/decoded_arrays.py /tmp/feeder-bench-data/imagenet-like --limit 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import cv2
import numpy as np
import torch

from feeder import DatasetSource, Feeder, ImageFolder, ops
from feeder.bench.loaders import sample_work, transforms
from feeder.sample.rng import sample_key


class Arrays(torch.utils.data.Dataset):
    """Decoded RGB images in memory: ``(uint8 [H, W, 3] array, label)``."""

    def __init__(self, root: str, limit: int) -> None:
        folder = ImageFolder(root)
        n = min(limit, len(folder))
        self.images = []
        for i in range(n):
            bgr = cv2.imread(folder.paths[i], cv2.IMREAD_COLOR)
            self.images.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
        self.labels = [int(x) for x in folder.labels[:n]]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]


class Transformed(torch.utils.data.Dataset):
    """``Arrays`` followed by feeder's per-sample work, for DataLoader."""

    def __init__(self, arrays: Arrays) -> None:
        self.arrays = arrays
        self.work = sample_work(transforms(), files=len(arrays))

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, index: int):
        image, label = self.arrays[index]
        h, w = self.work.image_size
        out = np.empty((h, w, 3), np.uint8)
        self.work(image, sample_key(0, 0, index), out)
        return torch.from_numpy(out), label


def _one_cv2_thread(worker_id: int) -> None:
    cv2.setNumThreads(1)


def timed(batches) -> float:
    it = iter(batches)
    next(it)
    t0, n = time.perf_counter(), 0
    for images, _ in it:
        n += images.shape[0]
    return n / (time.perf_counter() - t0)


def run_feeder(arrays: Arrays, batch_size: int, **options) -> float:
    with Feeder(DatasetSource(arrays), batch_size, [ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()],
                shuffle=True, seed=0, timeout=300, **options) as f:
        return timed(f)


def run_dataloader(arrays: Arrays, batch_size: int, workers: int) -> float:
    loader = torch.utils.data.DataLoader(Transformed(arrays), batch_size=batch_size, shuffle=True,
                                         num_workers=workers, timeout=300,
                                         worker_init_fn=_one_cv2_thread,
                                         multiprocessing_context="fork")
    return timed(loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="an image folder (bench data: feeder-bench make-data)")
    parser.add_argument("--limit", type=int, default=1000, help="images decoded into memory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader's num_workers")
    args = parser.parse_args()
    arrays = Arrays(args.root, args.limit)
    dl = f"DataLoader num_workers={args.workers}"
    arms = {
        "feeder": lambda: run_feeder(arrays, args.batch_size),
        "feeder read_threads=0": lambda: run_feeder(arrays, args.batch_size, read_threads=0),
        dl: lambda: run_dataloader(arrays, args.batch_size, args.workers),
    }
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, fn in arms.items():
            rates[name].append(fn())
            print(f"round {r + 1}: {name:<24} {rates[name][-1]:7.1f} img/s", flush=True)
    pixels = statistics.mean(a.shape[0] * a.shape[1] for a in arrays.images)
    print(f"\n{len(arrays)} decoded images of {args.root} in memory (mean {pixels / 1e3:.0f} kpx); "
          f"batch {args.batch_size}; {os.cpu_count()} cores ({platform.processor() or platform.machine()}); "
          f"torch {torch.__version__}")
    base = statistics.median(rates[dl])
    print(f"{'arm':<24} {'median img/s':>12} {'rounds':>20} {'vs DataLoader':>14}")
    for name, values in rates.items():
        med = statistics.median(values)
        shown = " ".join(f"{v:.0f}" for v in values)
        print(f"{name:<24} {med:12.1f} {shown:>20} {med / base:13.2f}x")


if __name__ == "__main__":
    main()
