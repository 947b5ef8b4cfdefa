"""The extension's bilinear resize (``feeder.decode._jpeg.resize``, the one the
fused decode calls) against ``cv2.resize`` INTER_LINEAR, on random crops of a
few sizes resized to 224 x 224, and its area shrink (``area=True``, for crops
more than twice the output on a side) against INTER_AREA (one thread, best of
5 rounds of 300 calls).

    python bench/experiments/resize_speed.py
"""

from __future__ import annotations

import importlib
import time

import cv2
import numpy as np

SIZES = [(300, 300), (420, 350), (230, 260), (447, 447)]
AREA_SIZES = [(460, 350), (500, 470), (600, 450)]
CALLS, ROUNDS = 300, 5


def best_of(call) -> float:
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        times.append((time.perf_counter() - start) / CALLS)
    return min(times)


def main() -> None:
    ext = importlib.import_module("feeder.decode._jpeg")
    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    dst = np.empty((224, 224, 3), np.uint8)
    for h, w in SIZES:
        src = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ours = best_of(lambda: ext.resize(src, dst, True))
        theirs = best_of(lambda: cv2.resize(src, (224, 224), dst=dst, interpolation=cv2.INTER_LINEAR))
        print(f"{h}x{w} -> 224x224: feeder {1e6 * ours:.1f} us, cv2 (one thread) {1e6 * theirs:.1f} us")
    for h, w in AREA_SIZES:
        src = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ours = best_of(lambda: ext.resize(src, dst, True, True))
        theirs = best_of(lambda: cv2.resize(src, (224, 224), dst=dst, interpolation=cv2.INTER_AREA))
        print(f"{h}x{w} -> 224x224, area: feeder {1e6 * ours:.1f} us, cv2 (one thread) {1e6 * theirs:.1f} us")


if __name__ == "__main__":
    main()
