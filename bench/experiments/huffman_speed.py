"""feeder's own Huffman decoder (``feeder/decode/_huffman.c``) against
libjpeg-turbo's, on whole decodes: the extension's ``decode`` of every image
at scale 1/1 with ``own=True`` and ``own=False`` (the same IDCT, colour
conversion and output: only the entropy decoder differs), and simplejpeg's
whole decode beside them. One thread, thread CPU per image, the median of
``--rounds`` alternating rounds.

    python bench/experiments/huffman_speed.py DATA [--files 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time

import numpy as np
import simplejpeg

from feeder.decode import extension


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="a folder of JPEGs (searched recursively)")
    p.add_argument("--files", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    ext = extension.jpeg
    assert ext is not None, "the region decoder is not built"
    paths = sorted(glob.glob(os.path.join(args.data, "**", "*.jp*g"), recursive=True))[:args.files]
    datas = []
    for path in paths:
        with open(path, "rb") as f:
            datas.append(f.read())
    sizes = [simplejpeg.decode_jpeg_header(d)[:2] for d in datas]
    out = np.empty(max(h * (w + 64) for h, w in sizes) * 3, np.uint8)

    def ours(own: bool) -> float:
        start = time.thread_time()
        for data, (h, w) in zip(datas, sizes):
            ext.decode(data, 0, 0, h, w, 1, out, 1 << 40, False, True, own=own)
        return (time.thread_time() - start) / len(datas)

    def simple() -> float:
        start = time.thread_time()
        for data in datas:
            simplejpeg.decode_jpeg(data, colorspace="RGB")
        return (time.thread_time() - start) / len(datas)

    rows: dict[str, list[float]] = {"feeder's Huffman decoder": [], "libjpeg-turbo's": [],
                                    "simplejpeg (whole decode)": []}
    for _ in range(args.rounds):
        rows["feeder's Huffman decoder"].append(ours(True))
        rows["libjpeg-turbo's"].append(ours(False))
        rows["simplejpeg (whole decode)"].append(simple())
    base = statistics.median(rows["libjpeg-turbo's"])
    print(f"{len(datas)} JPEGs from {args.data}, whole decodes at 1/1, one thread, "
          f"median of {args.rounds} alternating rounds")
    for name, times in rows.items():
        ms = statistics.median(times)
        print(f"{name:28} {1e3 * ms:7.3f} ms per image  {ms / base:5.2f}x libjpeg-turbo's")


if __name__ == "__main__":
    main()
