"""``scaled-decode``: what reduced-scale JPEG decoding buys on large photos.

The same feeder, transforms and output, run twice per round: once as users get
it (RandomResizedCrop tells the decoder the smallest size it needs, and
libjpeg-turbo decodes at 1/2, 1/4 or 1/8 scale when that still covers the
crop; 3/8 too on the simplejpeg path) and once with the hint switched off (see
:func:`feeder.bench.loaders.full_decode_transforms`), which forces full-size
decoding. The crop box is the same in both; the pixels differ only by the
resampling path, which the table reports as a mean absolute difference.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from .. import ImageFolder
from ..sample.rng import sample_key
from ..engine.threads import auto_threads, available_cores
from . import report
from .loaders import sample_work, full_decode_transforms, transforms
from .measure import RunResult, run_child
from .report import median

log = logging.getLogger(__name__)

COLUMNS = [
    ("row", "feeder decode", "{}"),
    ("images_per_s", "img/s", "{:.0f}"),
    ("cpu_ms_per_image", "CPU ms/img", "{:.2f}"),
    ("first_batch_s", "1st batch s", "{:.2f}"),
    ("single_thread_ms", "1-thread ms/img", "{:.2f}"),
    ("speedup", "vs full", "{:.2f}x"),
]


def output_difference(root: str, samples: int = 16) -> dict[str, float]:
    """Mean and max absolute pixel difference between scaled and full decode, same crops."""
    source = ImageFolder(root)
    scaled, full = sample_work(transforms()), sample_work(full_decode_transforms())
    h, w = scaled.image_size
    a, b = np.empty((h, w, 3), np.uint8), np.empty((h, w, 3), np.uint8)
    diffs, maxes, reduced = [], [], 0
    for i in np.linspace(0, len(source) - 1, min(samples, len(source))).astype(int).tolist():
        data, _ = source.read(i)
        key = sample_key(0, 0, i)
        img_a, ctx_a = scaled.decode(data, key)
        img_b, ctx_b = full.decode(data, key)
        reduced += img_a.shape[:2] != img_b.shape[:2]
        scaled.transform(img_a, key, ctx_a, a)
        full.transform(img_b, key, ctx_b, b)
        d = np.abs(a.astype(np.int16) - b.astype(np.int16))
        diffs.append(float(d.mean()))
        maxes.append(float(d.max()))
    return {"mean_abs_diff": float(np.mean(diffs)), "max_abs_diff": float(np.max(maxes)),
            "reduced_share": reduced / max(1, len(diffs))}


def run(args: argparse.Namespace) -> int:
    """The ``scaled-decode`` subcommand."""
    d, a = auto_threads(available_cores())
    base = {"mode": "loader", "kind": "feeder", "root": args.dir, "batch_size": args.batch_size,
            "epochs": args.epochs, "decode_threads": d, "augment_threads": a, "queue_size": 4,
            "seed": args.seed}
    variants = [("scaled (default)", {**base, "full_decode": False}),
                ("full (forced)", {**base, "full_decode": True})]
    ceilings = [("scaled (default)", {"mode": "ceiling", "root": args.dir, "limit": args.ceiling_images,
                                      "full_decode": False}),
                ("full (forced)", {"mode": "ceiling", "root": args.dir, "limit": args.ceiling_images,
                                   "full_decode": True})]
    rounds: list[dict[str, RunResult]] = []
    single: dict[str, list[float]] = {"scaled (default)": [], "full (forced)": []}
    for r in range(args.repeats):
        report.progress(f"scaled-decode: round {r + 1}/{args.repeats}")
        got = {}
        order = variants if r % 2 == 0 else variants[::-1]
        for label, spec in order:
            res = run_child(spec)
            got[label] = res
            report.progress(f"  {label}: " + (f"{res.images_per_s:.0f} img/s" if res.ok
                                              else f"FAILED ({res.error[:300]})"))
        for label, spec in (ceilings if r % 2 == 0 else ceilings[::-1]):
            res = run_child(spec)
            if res.ok:
                single[label].append(res.extra["per_image_ms"])
        rounds.append(got)
    rows = []
    for label, _ in variants:
        ok = [g[label] for g in rounds if g[label].ok]
        rows.append({"row": label, "images_per_s": median([x.images_per_s for x in ok]),
                     "cpu_ms_per_image": 1e3 * median([x.cpu_per_image_s for x in ok]),
                     "first_batch_s": median([x.first_batch_s for x in ok]),
                     "single_thread_ms": median(single[label]),
                     "repeats_images_per_s": [x.images_per_s for x in ok]})
    ratios = [g["scaled (default)"].images_per_s / g["full (forced)"].images_per_s
              for g in rounds if g["scaled (default)"].ok and g["full (forced)"].ok
              and g["full (forced)"].images_per_s > 0]
    rows[0]["speedup"] = median(ratios)
    rows[1]["speedup"] = 1.0
    diff = output_difference(args.dir)
    machine = report.machine_info()
    print(report.format_table(rows, COLUMNS, title=(
        f"scaled-decode on {args.dir}: feeder auto ({d}x{a}), batch {args.batch_size}, RandomResizedCrop(224)"
        f" + flip, median of {args.repeats} rounds (speed-up: median of per-round ratios)\n"
        f"machine: {report.describe_machine(machine)}")))
    print(f"same crops: mean |scaled - full| = {diff['mean_abs_diff']:.2f} grey levels "
          f"(max {diff['max_abs_diff']:.0f}); {diff['reduced_share']:.0%} of the checked samples "
          f"decoded at reduced scale\n")
    report.write_outputs(args.out, "scaled_decode", rows, {
        "dir": args.dir, "batch_size": args.batch_size, "epochs": args.epochs, "repeats": args.repeats,
        "output_difference": diff, "per_round_speedup": ratios})
    return 0

