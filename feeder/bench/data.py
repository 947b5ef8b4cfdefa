"""``make-data``: a deterministic ImageFolder of photograph-like JPEGs.

The images come from :func:`feeder.synthetic.make_image_folder` (smooth light,
shapes with hard edges, fractal texture and sensor noise), which decode at the
speed of real photographs, unlike flat colours or pure noise.
"""

from __future__ import annotations

import argparse
import logging
import os

from ..synthetic import make_image_folder
from . import report

log = logging.getLogger(__name__)


def dataset_summary(root: str) -> dict[str, float | int]:
    """Files, classes, total bytes and mean file size of an ImageFolder tree."""
    files = 0
    size = 0
    classes = 0
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not entry.is_dir():
            continue
        classes += 1
        for dirpath, _, names in os.walk(entry.path):
            for n in names:
                files += 1
                size += os.path.getsize(os.path.join(dirpath, n))
    return {"classes": classes, "files": files, "bytes": size, "mean_kib": size / max(1, files) / 1024}


def run(args: argparse.Namespace) -> int:
    """The ``make-data`` subcommand: write the dataset unless ``--force`` is off and it exists."""
    if os.path.isdir(args.dir) and os.listdir(args.dir) and not args.force:
        report.progress(f"make-data: {args.dir} exists and is not empty; keeping it (--force to rewrite)")
    else:
        small = getattr(args, "small", False)
        kind = ("large (~1500x1100)" if args.large else "small (64-96 px)" if small
                else "ImageNet-like (300-600 px)")
        report.progress(f"make-data: writing {args.n_classes} x {args.per_class} {kind} JPEGs to {args.dir}")
        make_image_folder(args.dir, classes=args.n_classes, per_class=args.per_class, seed=args.seed,
                          large=args.large, size_range=(64, 96) if small else (300, 600))
    s = dataset_summary(args.dir)
    if not s["files"]:
        raise ValueError(f"make-data: {args.dir!r} is not empty but holds no JPEG in class folders: "
                         f"choose an empty or new folder, or --force to write the dataset there")
    print(f"{args.dir}: {s['files']} JPEGs in {s['classes']} classes, {s['bytes'] / 2**20:.1f} MiB "
          f"(mean {s['mean_kib']:.0f} KiB)")
    return 0
