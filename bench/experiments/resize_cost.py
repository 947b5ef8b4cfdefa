"""What the crop's resize costs per image, by the interpolation the chain picks.

RandomResizedCrop resizes each crop to its output size with bilinear
interpolation, or with OpenCV's area averaging (``INTER_AREA``) when bilinear
would shrink a side by more than 2x (``antialias=True``, as torchvision). This
records the crops the chain resizes on one thread (the region path and the
full-decode path, the same boxes), then times ``cv2.resize`` on each of them
as the chain calls it, and the same crops with bilinear, so the report shows:

* the share of images whose crop takes the area path, and what that path and
  the bilinear one cost per call and per image on average;
* how that compares with the whole region path (decode + transforms).

OpenCV's area averaging has a fast path for integer shrink factors only; for
the others it runs a general weighted sum, about ten times the cost of
bilinear on the same crop.

    python bench/experiments/resize_cost.py DATA_DIR [--limit 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import cv2
import numpy as np

from feeder import ImageFolder
from feeder.bench.ceiling import timed_indices
from feeder.bench.loaders import full_decode_transforms, transforms
from feeder.engine.steps import SampleWork
from feeder.ops import resize
from feeder.ops.chain import Chain
from feeder.sample.rng import sample_key


def record(datas: list[bytes], chain: list) -> list[tuple[np.ndarray, tuple[int, int], int]]:
    """The (crop, output size, interpolation) of every resize the chain makes on ``datas``."""
    seen: list[tuple[np.ndarray, tuple[int, int], int]] = []
    real = resize._resize_into  # what RandomResizedCrop calls

    def spy(img, size, interpolation, out):
        seen.append((np.ascontiguousarray(img), tuple(size), interpolation))
        return real(img, size, interpolation, out)

    work = SampleWork(Chain(chain, None))
    h, w = work.image_size
    out = np.empty((h, w, 3), np.uint8)
    resize._resize_into = spy
    try:
        for i, d in enumerate(datas):
            key = sample_key(0, 0, i)
            img, ctx = work.decode(d, key)
            work.transform(img, key, ctx, out)
    finally:
        resize._resize_into = real
    return seen


def per_call_ms(calls: list, interpolation: int | None, repeats: int) -> list[float]:
    """Each call's best-of-``repeats`` thread time in ms (its own interpolation when None)."""
    times = []
    for img, (h, w), interp in calls:
        dst = np.empty((h, w, 3), np.uint8)
        best = float("inf")
        for _ in range(repeats):
            t = time.thread_time()
            cv2.resize(img, (w, h), dst=dst, interpolation=interp if interpolation is None else interpolation)
            best = min(best, time.thread_time() - t)
        times.append(best * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--limit", type=int, default=400, help="images (default 400)")
    p.add_argument("--repeats", type=int, default=5, help="timings per call, best kept (default 5)")
    args = p.parse_args()
    cv2.setNumThreads(1)  # as in the feeder's threads
    source = ImageFolder(args.dir)
    datas = [source.read(i)[0] for i in timed_indices(len(source), args.limit)]
    n = len(datas)
    print(f"resize cost on {args.dir}: {n} images, RandomResizedCrop(224) + flip, one thread, "
          f"best of {args.repeats} per call")
    for name, chain in (("region path", transforms()), ("full-decode path", full_decode_transforms())):
        calls = record(datas, chain)
        own = per_call_ms(calls, None, args.repeats)
        bilinear = per_call_ms(calls, cv2.INTER_LINEAR, args.repeats)
        area = [k for k, (_, _, interp) in enumerate(calls) if interp == cv2.INTER_AREA]
        other = [k for k in range(len(calls)) if k not in set(area)]
        mean = statistics.fmean
        print(f"  {name}: {len(area)} of {len(calls)} crops ({len(area) / len(calls):.0%}) take the area "
              f"path (a side shrunk more than 2x)")
        if area:
            print(f"    area path: {mean(own[k] for k in area):.3f} ms per call (median "
                  f"{statistics.median(own[k] for k in area):.3f}); bilinear on the same crops "
                  f"{mean(bilinear[k] for k in area):.3f} ms; mean crop "
                  f"{mean(calls[k][0].shape[1] for k in area):.0f}x{mean(calls[k][0].shape[0] for k in area):.0f}")
        if other:
            print(f"    bilinear path: {mean(own[k] for k in other):.3f} ms per call; mean crop "
                  f"{mean(calls[k][0].shape[1] for k in other):.0f}x{mean(calls[k][0].shape[0] for k in other):.0f}")
        print(f"    per image: {sum(own) / n:.3f} ms resizing, of which {sum(own[k] for k in area) / n:.3f} "
              f"on the area path ({sum(bilinear) / n:.3f} ms if every crop were resized bilinearly)")


if __name__ == "__main__":
    main()
