"""The per-sample CPU a decode thread spends holding the GIL, and in C without it,
on the engine's own per-sample work (``SampleWork``: decode + RandomResizedCrop
+ flip) over real files, with feeder's region decoder.

On a loaded machine a GIL profile inflates whatever Python a descheduled thread
was running, and throughput follows the other processes more than the code.
This runs the per-sample steps on one thread, as a decode thread with the
augment step inline runs them (with the fused crop where the tree has it:
``SampleWork.decode_into``), and times (thread CPU time) the calls that
release the GIL, the region decode (``ext.decode``; ``ext.fused_small``, the
whole sample of a small file, where the tree has it), the resize (the
extension's or ``cv2.resize``) and ``cv2.flip``: the rest of the sample's CPU time is what it spends holding
the GIL, which is what caps a pool of threads in one process. The first pass
reads every file (and fills the verified-JPEG memory), its figures printed
last; the others are the best of ``--repeats`` later passes, each with new
crops (a new epoch).

    python bench/experiments/work_gil.py DATA [--files 2000] [--size 64]

Run it from each source tree (``PYTHONPATH=tree``), alternating, to compare two.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import os
import pstats
import time

import cv2
import numpy as np

import feeder
from feeder import ops
from feeder.decode import extension
from feeder.engine.steps import SampleWork
from feeder.ops import base as _base
from feeder.ops import geometry as _geometry
from feeder.ops.chain import Chain
from feeder.sample.rng import epoch_key, index_key
from feeder.sources import FileList

_in_c = [0.0]  # thread CPU seconds inside the timed calls


def _timed(fn):
    def call(*args, **kwargs):
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _in_c[0] += time.thread_time() - t
    return call


class _Proxy:
    """A module with some of its functions timed."""

    def __init__(self, module, names) -> None:
        self._module = module
        for name in names:
            setattr(self, name, _timed(getattr(module, name)))

    def __getattr__(self, name):
        return getattr(self._module, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="an ImageFolder of JPEGs")
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--small-bytes", type=int, default=None,
                   help="JpegDecoder.SMALL_BYTES (0: every file through the verified memory)")
    args = p.parse_args()
    files = sorted(glob.glob(os.path.join(args.data, "*", "*")))[::1][:args.files]
    src = FileList(files, [0] * len(files))
    datas = [src.read(i)[0] for i in range(len(files))]
    assert extension.jpeg is not None, "the region decoder is not built"
    extension.jpeg = _Proxy(extension.jpeg, [name for name in ("decode", "fused_small", "fused")
                                             if hasattr(extension.jpeg, name)])
    _base.cv2 = _Proxy(cv2, ["resize"])
    _geometry.cv2 = _Proxy(cv2, ["flip"])
    from feeder.ops import resize as _resize
    if getattr(_resize, "_native_resize", None) is not None:
        _resize._native_resize = _timed(_resize._native_resize)
    if args.small_bytes is not None:
        from feeder.decode.jpeg import JpegDecoder
        JpegDecoder.SMALL_BYTES = args.small_bytes
    work = SampleWork(Chain([ops.RandomResizedCrop(args.size), ops.RandomHorizontalFlip()], None),
                      files=len(datas))
    out = np.zeros((args.size, args.size, 3), np.uint8)
    fused = getattr(work, "fused", None) is not None

    def epoch(e: int) -> tuple[float, float]:
        pass_key = epoch_key(0, e)
        _in_c[0] = 0.0
        t = time.thread_time()
        for i, data in enumerate(datas):
            k = index_key(pass_key, i)
            if fused:
                img, ctx = work.decode_into(data, k, out)
                if img is None:
                    work.finish_into(k, out)
                    continue
            else:
                img, ctx = work.decode(data, k)
            work.transform(img, k, ctx, out)
        total = time.thread_time() - t
        return total / len(datas) * 1e6, _in_c[0] / len(datas) * 1e6

    first = epoch(0)  # every file read for the first time (to its end, with jpeg_verify)
    runs = [epoch(e + 1) for e in range(args.repeats)]
    total, c = min(runs, key=lambda r: r[0] - r[1])
    prof = cProfile.Profile()
    prof.enable()
    epoch(args.repeats + 1)
    prof.disable()
    calls = pstats.Stats(prof).total_calls / len(datas)
    tree = os.path.dirname(os.path.dirname(os.path.abspath(feeder.__file__)))
    small = "" if args.small_bytes is None else f" (SMALL_BYTES={args.small_bytes})"
    print(f"{tree}{small}: {len(datas)} files, RandomResizedCrop({args.size}) + flip, later epochs: "
          f"{total:.1f} us CPU/sample, of which {total - c:.1f} holding the GIL and {c:.1f} in "
          f"C without it; {calls:.0f} Python calls/sample; first pass: {first[0]:.1f} us CPU/sample, "
          f"{first[0] - first[1]:.1f} holding the GIL")


if __name__ == "__main__":
    main()
