"""The per-sample Python of a decode thread's work, with the C work taken out.

The GIL profile (``gil_profile.py``) attributes time to feeder's modules, but on
a loaded machine a thread descheduled while it holds the GIL inflates whatever
Python it was running, so its per-module figures move by 20-30% run to run.
This times the same per-sample steps on one thread with the region decoder's
``decode`` (or, without it, ``simplejpeg.decode_jpeg``), ``cv2.resize`` and
``cv2.flip`` replaced by stubs that return preallocated arrays: what is left
is feeder's own Python (key, header parse and plan, the chain, the batch's count), plus the file read measured on its own (the read's
system calls included). Thread CPU time, best of 7 passes over the files; and
the Python function calls per sample (cProfile), which do not depend on load.

    python bench/experiments/work_python.py DATA [--files 500] [--size 224]

Run it from each source tree (``PYTHONPATH=tree``), alternating, to compare two.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import os
import pstats
import sys
import time

import cv2
import numpy as np
import simplejpeg

import feeder
from feeder import decode as _decode
from feeder.sample import rng as _rng
from feeder import ops
from feeder.ops.chain import Chain
from feeder.engine.batch import Batch
from feeder.engine.steps import SampleWork
from feeder.sources import FileList


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="an ImageFolder of JPEGs (feeder-bench make-data)")
    p.add_argument("--files", type=int, default=500)
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop's output side")
    args = p.parse_args()
    files = sorted(glob.glob(os.path.join(args.data, "*", "*")))[:args.files]
    src = FileList(files, [0] * len(files))
    datas = [src.read(i)[0] for i in range(len(files))]  # warms the page cache too

    decoded: dict[tuple[int, int], np.ndarray] = {}

    def decode_stub(data, colorspace="RGB", min_height=0, min_width=0, buffer=None, **kw):
        h, w = simplejpeg.decode_jpeg_header(data)[:2]
        img = decoded.get((h, w))
        if img is None:
            img = decoded[h, w] = np.zeros((h, w, 3), np.uint8)
        return img

    def resize_stub(img, size, dst=None, interpolation=None):
        return dst if dst is not None else np.zeros((size[1], size[0], 3), np.uint8)

    def flip_stub(img, code, dst=None):
        return dst if dst is not None else img

    _decode.jpeg.simplejpeg = type("simplejpeg", (), {
        "decode_jpeg": staticmethod(decode_stub),
        "decode_jpeg_header": staticmethod(simplejpeg.decode_jpeg_header)})

    class _Cv2:
        """cv2 with resize and flip stubbed (constants and the rest as they are)."""
        resize = staticmethod(resize_stub)
        flip = staticmethod(flip_stub)

        def __getattr__(self, name):
            return getattr(cv2, name)

    # Every feeder.ops module that calls cv2 (the resize lives in ops.base now).
    for name, module in list(sys.modules.items()):
        if name.startswith("feeder.ops") and getattr(module, "cv2", None) is cv2:
            module.cv2 = _Cv2()
    ext = getattr(_decode, "extension", None)
    if ext is not None and ext.jpeg is not None:
        real = ext.jpeg

        class _Region:
            """The region decoder with its decode stubbed: the output's layout (its
            stride and offset, as the extension gives them), no pixel decoded."""

            def decode(self, data, y0, x0, rh, rw, d, buf, max_pixels, compact, verify, **kw):
                stride, offset = rw + 2 * real.PAD, real.PAD
                return (stride, offset, None, 0) if kw else (stride, offset)

            def __getattr__(self, name):
                return getattr(real, name)

        ext.jpeg = _Region()
    work = SampleWork(Chain([ops.RandomResizedCrop(args.size), ops.RandomHorizontalFlip()], None))
    out = np.zeros((args.size, args.size, 3), np.uint8)
    if hasattr(_rng, "index_key"):
        pass_key = _rng.epoch_key(0, 0)

        def key(i: int) -> int:
            return _rng.index_key(pass_key, i)
    else:  # a tree from before per-pass keys
        def key(i: int) -> int:
            return _rng.sample_key(0, 0, i)

    def reads() -> None:
        for i in range(len(files)):
            src.read(i)

    def samples() -> None:
        batch = Batch(0, None, len(files))
        for i, data in enumerate(datas):
            k = key(i)
            img, ctx = work.decode(data, k)
            work.transform(img, k, ctx, out)
            batch.finish_slot()

    def best_us(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(7):
            t0 = time.thread_time()
            fn()
            best = min(best, time.thread_time() - t0)
        return best / len(files) * 1e6

    def calls(fn) -> float:
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        return pstats.Stats(prof).total_calls / len(files)

    tree = os.path.dirname(os.path.dirname(os.path.abspath(feeder.__file__)))
    print(f"{tree}: read {best_us(reads):.1f} us/file ({calls(reads):.0f} calls); "
          f"work {best_us(samples):.1f} us/sample ({calls(samples):.0f} calls), C work stubbed")


if __name__ == "__main__":
    main()
