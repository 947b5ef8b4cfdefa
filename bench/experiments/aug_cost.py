"""Per-sample CPU cost of feeder's recipe augmentations against albumentations'
equivalent op on the same image (#24's target: ours <= albumentations).

Each op runs on one thread (OpenCV's own pool off, as in feeder's decode threads)
on the same 500x375 RGB uint8 image, with a fresh random draw per call. Rounds
alternate ours and albumentations' in blocks, each block timed with the thread's
CPU clock; the figure is the median per-call time over the blocks.

    PYTHONPATH=$PWD python bench/experiments/aug_cost.py --out bench/results/aug_cost
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import cv2
import numpy as np
import torch

import albumentations as A
from feeder import ops
from feeder.sample.rng import SampleRNG
from feeder.ops import autoaugment

NEAREST = cv2.INTER_NEAREST


def photo(h: int = 375, w: int = 500) -> np.ndarray:
    """Smooth gradients with noise: a stand-in for a photo (every value range used)."""
    r = np.random.default_rng(0)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255.0 / w, y * 255.0 / h, (x + y) * 127.0 / (h + w) + 64], -1)
    blobs = cv2.GaussianBlur(r.normal(0, 60, (h, w, 3)), (0, 0), 6)
    return np.clip(base + blobs + r.normal(0, 8, (h, w, 3)), 0, 255).astype(np.uint8)


def ours(t):
    return lambda img, k: t.apply(img, SampleRNG(k))


def op(name, mag):
    return lambda img, k: autoaugment.apply_op(img, name, mag, NEAREST, (0, 0, 0))


def albu(t):
    # The Compose's own seeding per call costs ~50 us (measured): call the
    # transform itself with its generator seeded once, so albumentations pays no
    # seeding at all here.
    c = A.Compose([t], p=1.0, seed=0)
    return lambda img, k: c(image=img)["image"]


def cases():
    """(name, ours, albumentations' equivalent, note)."""
    tw = ops.TrivialAugmentWide()
    return [
        ("RandomResize(256, 320)", ours(ops.RandomResize(256, 320)),
         albu(A.SmallestMaxSize(max_size=list(range(256, 321)), p=1.0)), "bilinear, shorter side 256-320"),
        ("Resize(256, max_size=320)", ours(ops.Resize(256, max_size=320)),
         albu(A.Compose([A.SmallestMaxSize(max_size=256, p=1.0), A.LongestMaxSize(max_size=320, p=1.0)])),
         "albumentations: SmallestMaxSize then LongestMaxSize"),
        ("RandomCrop(224)", ours(ops.RandomCrop(224)), albu(A.RandomCrop(224, 224, p=1.0)), ""),
        ("RandomCrop(512) padded", ours(ops.RandomCrop(512)),
         albu(A.RandomCrop(512, 512, pad_if_needed=True, p=1.0)), "pads 375x500 to 512"),
        ("ColorJitter(.4,.4,.4,.1)", ours(ops.ColorJitter(0.4, 0.4, 0.4, 0.1)),
         albu(A.ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0)), "albumentations: uint8 HSV hue"),
        ("Rotate 30 (policy op)", op("Rotate", 30.0), albu(A.Affine(rotate=(30, 30), interpolation=NEAREST, p=1.0)), "nearest, as torchvision's policies"),
        ("ShearX 0.3 (policy op)", op("ShearX", 0.3), albu(A.Affine(shear={"x": (16.7, 16.7), "y": (0, 0)}, interpolation=NEAREST, p=1.0)), ""),
        ("TranslateX 32 (policy op)", op("TranslateX", 32.0),
         albu(A.Affine(translate_px={"x": (32, 32), "y": (0, 0)}, interpolation=NEAREST, p=1.0)), ""),
        ("Brightness (policy op)", op("Brightness", 0.5),
         albu(A.RandomBrightnessContrast((0.5, 0.5), (0, 0), p=1.0)), ""),
        ("Contrast (policy op)", op("Contrast", 0.5),
         albu(A.RandomBrightnessContrast((0, 0), (0.5, 0.5), p=1.0)), ""),
        ("Color/saturation (policy op)", op("Color", 0.5),
         albu(A.ColorJitter(0, 0, (1.5, 1.5), 0, p=1.0)), ""),
        ("Sharpness (policy op)", op("Sharpness", 0.5), albu(A.Sharpen(p=1.0)), "albumentations: 5x5 kernel"),
        ("Posterize 4 (policy op)", op("Posterize", 4), albu(A.Posterize(num_bits=4, p=1.0)), ""),
        ("Solarize 128 (policy op)", op("Solarize", 128.0), albu(A.Solarize(threshold_range=(0.5, 0.5), p=1.0)), ""),
        ("AutoContrast (policy op)", op("AutoContrast", 0), albu(A.AutoContrast(p=1.0)), ""),
        ("Equalize (policy op)", op("Equalize", 0), albu(A.Equalize(p=1.0)), ""),
        ("TrivialAugmentWide", ours(tw),
         albu(A.OneOf([A.NoOp(), A.Affine(shear=(-45, 45), interpolation=NEAREST),
                       A.Affine(translate_px=(-32, 32), interpolation=NEAREST),
                       A.Affine(rotate=(-135, 135), interpolation=NEAREST), A.RandomBrightnessContrast(0.99, 0),
                       A.ColorJitter(0, 0, 0.99, 0), A.RandomBrightnessContrast(0, 0.99), A.Sharpen(),
                       A.Posterize((2, 8)), A.Solarize((0, 1)), A.AutoContrast(), A.Equalize()], p=1.0)),
         "albumentations: OneOf the equivalent ops"),
    ]


def photometric_cases():
    """SSD's photometric distortion: albumentations' equivalent is each change as
    its own single-factor ColorJitter (albumentations skips a factor of 1, so each
    does only its own step) with the same probability, then ChannelShuffle."""
    rows = []
    for p in (0.5, 1.0):
        rows.append((f"RandomPhotometricDistort(p={p})", ours(ops.RandomPhotometricDistort(p=p)),
                     albu(A.Compose([A.ColorJitter(brightness=(0.875, 1.125), contrast=0, saturation=0, hue=0, p=p),
                                     A.ColorJitter(brightness=0, contrast=(0.5, 1.5), saturation=0, hue=0, p=p),
                                     A.ColorJitter(brightness=0, contrast=0, saturation=(0.5, 1.5), hue=0, p=p),
                                     A.ColorJitter(brightness=0, contrast=0, saturation=0, hue=(-0.05, 0.05), p=p),
                                     A.ChannelShuffle(p=p)])),
                     "albumentations: single-factor ColorJitters + ChannelShuffle, same p"))
    return rows


def erasing_cases(img: np.ndarray):
    """RandomErasing is a batch transform on [B, C, H, W] tensors; it is timed on a
    batch of one holding the same image as albumentations' Erasing gets, in the
    same dtype: uint8 (what albumentations' per-sample pipelines hold) and float32
    (after normalize, where the recipes put it; 4x the bytes to copy, as
    torchvision's inplace=False copies the batch)."""
    t = ops.RandomErasing(p=1.0, value=0.0)
    lab = torch.zeros(1)
    x8 = torch.from_numpy(img).permute(2, 0, 1).contiguous()[None]
    xf = x8.float() / 255.0
    imgf = np.ascontiguousarray(xf[0].permute(1, 2, 0).numpy())
    eras = albu(A.Erasing(p=1.0))
    return [("RandomErasing (uint8, 1 sample)", lambda _, k: t.apply_keyed(x8, lab, [SampleRNG(k)]), eras,
             "ours: [1, 3, H, W] tensor; albumentations: HWC array"),
            ("RandomErasing (float32, 1 sample)", lambda _, k: t.apply_keyed(xf, lab, [SampleRNG(k)]),
             lambda _, k: eras(imgf, k), "as above, the image in [0, 1]")]


def measure(fn, img, calls, start):
    t0 = time.thread_time_ns()
    for k in range(start, start + calls):
        fn(img, k)
    return (time.thread_time_ns() - t0) / calls / 1e3  # microseconds per call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=None, help="write OUT.txt and OUT.json")
    ap.add_argument("--only", default="", help="comma-separated substrings: time only the ops named so")
    args = ap.parse_args()
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    img = photo()
    rows = []
    only = [w for w in args.only.split(",") if w]
    for name, mine, theirs, note in cases() + photometric_cases() + erasing_cases(img):
        if only and not any(w in name for w in only):
            continue
        mine(img, 0), theirs(img, 0)  # warm up
        a, b = [], []
        for r in range(args.rounds):
            first, second = (mine, theirs) if r % 2 == 0 else (theirs, mine)
            x = measure(first, img, args.calls, r * args.calls)
            y = measure(second, img, args.calls, r * args.calls)
            (a, b)[0 if first is mine else 1].append(x)
            (a, b)[1 if first is mine else 0].append(y)
        ma, mb = statistics.median(a), statistics.median(b)
        rows.append({"op": name, "feeder_us": round(ma, 1), "albumentations_us": round(mb, 1),
                     "ratio": round(ma / mb, 3), "note": note})
    lines = [f"per-call CPU time, one thread, 375x500 RGB uint8; median of {args.rounds} blocks of "
             f"{args.calls} calls; ratio = feeder / albumentations (<= 1: feeder as cheap or cheaper)",
             f"command: PYTHONPATH=$PWD python bench/experiments/aug_cost.py "
             f"--rounds {args.rounds} --calls {args.calls}" + (f" --out {args.out}" if args.out else ""),
             f"python {platform.python_version()}, numpy {np.__version__}, opencv {cv2.__version__}, "
             f"albumentations {A.__version__}, torch {torch.__version__}, {platform.machine()}", "",
             f"{'op':34s} {'feeder us':>10s} {'albu us':>10s} {'ratio':>7s}  note"]
    for r in rows:
        lines.append(f"{r['op']:34s} {r['feeder_us']:10.1f} {r['albumentations_us']:10.1f} "
                     f"{r['ratio']:7.2f}  {r['note']}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out + ".txt", "w") as f:
            f.write(text + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
