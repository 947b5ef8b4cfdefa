"""Where the verified-JPEG memory stops paying: the per-file cost of the region
decode with it and without it, by file size.

With ``jpeg_verify`` a file's first region decode reads it to its end and
records its row index; the memory (``feeder/decode/verified.py``) then lets
later decodes of the same bytes stop after the crop and enter its rows at the
index. That costs Python with the GIL held on every decode (two CRC-32C
calls, a table lookup, an index copied out of the ring and checked, an add),
which on a small file can exceed what it saves. This times, on one thread
(thread CPU time, best of ``--repeats`` passes, a fresh crop per pass), the
engine's decode + RandomResizedCrop + flip per file (``SampleWork``):

* ``memory, later``: the same bytes again, memory kept (read to the end
  once, then indexed decodes that stop after the crop);
* ``memory, first``: every file's first read (a fresh memory per pass);
* ``no memory``: every decode reads the file to its end, nothing kept (what
  files below ``JpegDecoder.SMALL_BYTES`` get, whatever the epoch);
* ``whole``: the whole image through the extension, then the crop (for
  reference: the other way to decode a small file with the same pixels).

Files: generated JPEGs (4:2:0, quality 90) of squares of each ``--sides``
and of the directories given (a sample of ``--limit`` files each).

    python bench/experiments/small_files.py [DIR ...] [--sides 64 96 ...] [--size 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import cv2
import numpy as np

from feeder import ImageFolder, ops
from feeder.bench.ceiling import timed_indices
from feeder.decode.region import decode_region
from feeder.engine.steps import SampleWork
from feeder.ops.chain import Chain
from feeder.synthetic import make_image


def _jpeg(img: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(img[..., ::-1]),
                           [cv2.IMWRITE_JPEG_QUALITY, 90,
                            cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420])
    assert ok
    return buf.tobytes()


def _work(size: int, datas: list[bytes], way: str) -> SampleWork:
    work = SampleWork(Chain([ops.RandomResizedCrop(size), ops.RandomHorizontalFlip()], None),
                      files=len(datas))
    jpeg = work.jpeg
    jpeg.small_bytes = 1 << 62 if way == "no memory" else 0
    if way == "whole":
        def whole(data, h, w, need, planned, orientation, scans):
            return decode_region(jpeg.ext, data, h, w, need, planned, orientation, jpeg.max_pixels,
                                 jpeg.buffers, True, whole=True)[0]
        jpeg._region = whole
    return work


def _pass(work: SampleWork, datas: list[bytes], out: np.ndarray, salt: int) -> float:
    t = time.thread_time()
    for i, data in enumerate(datas):
        key = salt * 1_000_003 + i
        img, ctx = work.decode(data, key)
        work.transform(img, key, ctx, out)
    return (time.thread_time() - t) / len(datas) * 1e6


def per_file_us(size: int, datas: list[bytes], way: str, repeats: int) -> float:
    out = np.empty((size, size, 3), np.uint8)
    if way == "memory, first":
        return min(_pass(_work(size, datas, way), datas, out, r) for r in range(repeats))
    work = _work(size, datas, way)
    _pass(work, datas, out, 0)  # first reads
    return min(_pass(work, datas, out, r + 1) for r in range(repeats))


WAYS = ("memory, later", "memory, first", "no memory", "whole")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="*")
    p.add_argument("--sides", type=int, nargs="*", default=[64, 96, 128, 160, 192, 256, 320])
    p.add_argument("--per-side", type=int, default=100)
    p.add_argument("--limit", type=int, default=400)
    p.add_argument("--size", type=int, default=64, help="RandomResizedCrop's output side")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    sets = [(f"{s}x{s} generated", [_jpeg(make_image(s, s, seed=k)) for k in range(args.per_side)])
            for s in args.sides]
    for root in args.dirs:
        source = ImageFolder(root)
        sets.append((root, [bytes(source.read(i)[0]) for i in timed_indices(len(source), args.limit)]))
    print(f"decode + RandomResizedCrop({args.size}) + flip per file, one thread, thread CPU us, "
          f"best of {args.repeats} passes (a fresh crop per pass)")
    print(f"{'files':<44}{'median KiB':>11}" + "".join(f"{w:>15}" for w in WAYS)
          + f"{'no memory / memory, later':>27}")
    for name, datas in sets:
        kib = statistics.median(len(d) for d in datas) / 1024
        us = {w: per_file_us(args.size, datas, w, args.repeats) for w in WAYS}
        print(f"{name:<44}{kib:>11.1f}" + "".join(f"{us[w]:>15.1f}" for w in WAYS)
              + f"{us['no memory'] / us['memory, later']:>27.2f}", flush=True)


if __name__ == "__main__":
    main()
