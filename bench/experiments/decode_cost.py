"""What JPEG decoding costs per image, by decoder and setting, on one thread.

Decode is most of the per-sample work (see ``ceiling``), so it bounds every
loader. This times, over the same images:

* simplejpeg at full size: what the feeder runs when no reduced scale applies;
* simplejpeg at 1/8 scale: entropy (Huffman) decoding is unchanged, while the
  inverse DCT, upsampling and colour conversion run on 1/64 of the pixels. It
  is the floor a region-of-interest decoder approaches for a small crop, since
  such a decoder must still entropy-decode every block above the crop's bottom
  edge;
* simplejpeg with fast DCT and fast upsampling (less accurate pixels: the mean
  absolute difference from the accurate decode is shown);
* OpenCV's and Pillow's decoders, for reference.

It then estimates the most a region-of-interest decoder could save for
RandomResizedCrop(224): entropy decoding down to the crop's bottom edge, plus
the per-pixel stages on the crop's area only, with the crop boxes the feeder
draws (a model built from the measured parts, printed as such).

    python bench/experiments/decode_cost.py DATA_DIR [--limit 500] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import cv2
import numpy as np
import simplejpeg

from feeder import ImageFolder, ops
from feeder.sample.rng import SampleRNG, sample_key
from feeder.bench.ceiling import timed_indices
from feeder.bench.report import format_table


def per_image_ms(fn, datas: list[bytes]) -> float:
    """One pass of ``fn`` over ``datas``: milliseconds per item."""
    t0 = time.perf_counter()
    for d in datas:
        fn(d)
    return 1e3 * (time.perf_counter() - t0) / len(datas)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--limit", type=int, default=500, help="images timed (default 500)")
    p.add_argument("--repeats", type=int, default=5, help="passes over the images, median kept (default 5)")
    args = p.parse_args()
    cv2.setNumThreads(1)
    source = ImageFolder(args.dir)
    datas = [source.read(i)[0] for i in timed_indices(len(source), args.limit)]

    def rgb(d, **kw):
        return simplejpeg.decode_jpeg(d, colorspace="RGB", **kw)

    full = [rgb(d) for d in datas[:50]]
    fast = [rgb(d, fastdct=True, fastupsample=True) for d in datas[:50]]
    fast_diff = float(np.mean([np.abs(a.astype(np.int16) - b).mean() for a, b in zip(full, fast)]))
    eighth = rgb(datas[0], min_height=1, min_width=1)
    scale = full[0].shape[0] / eighth.shape[0]

    variants = [
        ("simplejpeg, full size (feeder)", lambda d: rgb(d), ""),
        (f"simplejpeg, 1/{scale:.0f} scale", lambda d: rgb(d, min_height=1, min_width=1),
         "entropy decoding alone, nearly"),
        ("simplejpeg, fast DCT + upsampling", lambda d: rgb(d, fastdct=True, fastupsample=True),
         f"mean abs pixel diff {fast_diff:.2f}"),
        ("OpenCV imdecode (RGB)", lambda d: cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR_RGB), ""),
    ]
    try:
        from PIL import Image

        variants.append(("Pillow open + convert RGB", lambda d: Image.open(io.BytesIO(d)).convert("RGB"), ""))
    except ImportError:
        pass
    for _, fn, _ in variants:  # warm the code paths
        for d in datas[:20]:
            fn(d)
    # Alternate the variants pass by pass so drift lands on all of them.
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for _ in range(args.repeats):
        for name, fn, _ in variants:
            times[name].append(per_image_ms(fn, datas))
    base = statistics.median(times[variants[0][0]])
    rows = [{"decoder": name, "ms": statistics.median(times[name]),
             "of_full": statistics.median(times[name]) / base, "note": note} for name, _, note in variants]
    print(format_table(rows, [("decoder", "decoder", "{}"), ("ms", "ms/img", "{:.3f}"),
                              ("of_full", "of full", "{:.0%}"), ("note", "note", "{}")],
                       title=f"JPEG decode on one thread, {len(datas)} images of {args.dir}, "
                             f"median of {args.repeats} passes"))

    # Region-of-interest model: entropy decoding runs down to the crop's bottom
    # edge; the per-pixel stages run on the crop's area only.
    rrc = ops.RandomResizedCrop(224)
    bottom, area = [], []
    for i, d in zip(timed_indices(len(source), args.limit), datas):
        h, w, _, _ = simplejpeg.decode_jpeg_header(d)
        top, _, ch, cw = rrc.params(h, w, SampleRNG(sample_key(0, 0, i)))
        bottom.append((top + ch) / h)
        area.append(ch * cw / (h * w))
    floor = statistics.median(times[variants[1][0]])
    roi = floor * float(np.mean(bottom)) + (base - floor) * float(np.mean(area))
    print(f"\nregion-of-interest model for RandomResizedCrop(224): crop bottom at {np.mean(bottom):.0%} "
          f"of the height and crop area {np.mean(area):.0%} of the image, on average;\n"
          f"entropy {floor:.3f} ms x {np.mean(bottom):.2f} + per-pixel {base - floor:.3f} ms x "
          f"{np.mean(area):.2f} = {roi:.3f} ms/img, {roi / base:.0%} of a full decode (an estimate, "
          f"not a measurement: no decoder available here exposes a crop region)")


if __name__ == "__main__":
    main()
