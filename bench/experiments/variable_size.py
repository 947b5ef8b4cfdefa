"""Variable-size batches, detection-like: feeder against a fixed-size feeder run of
the same mean image area and against DataLoader doing the same per-sample work.

Per sample: decode a JPEG (a mix of landscape and portrait photo-like images of
COCO's common sizes), resize so the shorter side is drawn from 480..800 (step
32, torchvision's detection multi-scale list) with the longer side at most 1333,
flip half of them. Batches of 8, uint8.

Settings, each run in a fresh child process, in rounds with the order rotated:

* ``feeder-var``: ``Feeder(max_image_size=(1333, 1333), size_divisibility=32,
  group_by_aspect_ratio=True)``, batches padded to their largest image;
* ``feeder-var-random``: the same without grouping (random batches);
* ``feeder-fixed``: the same decode, a ``Resize((S, S))`` with ``S * S`` the mean
  output area of the variable runs (same pixels written per sample), fixed-size;
* ``dl``: ``torch.utils.data.DataLoader`` (``num_workers`` = cores, persistent
  workers) over a Dataset calling feeder's own per-sample work
  (``feeder.engine.steps.SampleWork``: the same decode and transform chain), collated
  as torchvision's ``GeneralizedRCNNTransform.batch_images`` does (zeros, the
  batch's largest image rounded up to 32).

Reported: images/s after the first batch (median over rounds), its ratio to
``feeder-var`` within each round, and for the variable runs the padded share of
the delivered pixels (``1 - sum(h * w) / sum(B * Hb * Wb)``).

    python bench/experiments/variable_size.py [--images 240] [--epochs 2] [--rounds 3]
        [--out bench/results/variable_size]
    python bench/experiments/variable_size.py --padding [--images 400 --epochs 2]
    python bench/experiments/variable_size.py --interleaved 8 [--images 160]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# COCO's most common (width, height) pairs, landscape and portrait.
SHAPES = [(640, 480), (640, 427), (640, 426), (500, 375), (640, 640), (480, 640), (427, 640),
          (375, 500), (612, 612), (640, 512)]
MIN_SIZES = tuple(range(480, 801, 32))
MAX_SIZE = 1333
BATCH = 8


def target_size(h: int, w: int, short: int) -> tuple[int, int]:
    """torchvision's detection resize: shorter side ``short``, longer at most MAX_SIZE."""
    scale = min(short / min(h, w), MAX_SIZE / max(h, w))
    return max(1, round(h * scale)), max(1, round(w * scale))


def make_transforms():
    from feeder import ops

    class DetectionResize(ops.Transform):
        """Random shorter side from MIN_SIZES, longer side capped at MAX_SIZE."""

        # The size is drawn before decoding (decode_hint, kept in ctx.plan), so
        # the chain knows it (planned_size) and gives apply() the image's region
        # of the batch slot to write into, as ops.Resize does.
        def decode_hint(self, height, width, rng, ctx=None):
            size = target_size(height, width, MIN_SIZES[rng.integers(0, len(MIN_SIZES))])
            if ctx is not None:
                ctx.plan = size
            return size

        def planned_size(self, height, width, ctx=None):
            return ctx.plan if ctx is not None and ctx.plan is not None else None

        def apply(self, img, rng, out=None, ctx=None):
            # Bilinear, as ops.Resize((S, S)) of the fixed-size run (both enlarge
            # these images, where ops.Resize does not switch to area averaging).
            import cv2
            if ctx is not None and ctx.plan is not None:
                th, tw = ctx.plan
            else:  # the same draw as decode_hint's (the same stream)
                h, w = img.shape[:2]
                th, tw = target_size(h, w, MIN_SIZES[rng.integers(0, len(MIN_SIZES))])
            if out is not None and out.shape == (th, tw, 3):
                return cv2.resize(img, (tw, th), dst=out, interpolation=cv2.INTER_LINEAR)
            return cv2.resize(img, (tw, th), interpolation=cv2.INTER_LINEAR)

        def __repr__(self):
            return "DetectionResize(480..800, max 1333)"

    return [DetectionResize(), ops.RandomHorizontalFlip()]


def mean_area(shapes: list[tuple[int, int]]) -> float:
    return float(np.mean([np.prod(target_size(h, w, s)) for w, h in shapes for s in MIN_SIZES]))


def make_blobs(n: int) -> tuple[list[bytes], list[tuple[int, int]]]:
    import simplejpeg
    from feeder.synthetic import make_image
    rng = np.random.default_rng(0)
    blobs, shapes = [], []
    for i in range(n):
        w, h = SHAPES[int(rng.integers(0, len(SHAPES)))]
        blobs.append(simplejpeg.encode_jpeg(make_image(h, w, i), quality=90))
        shapes.append((w, h))
    return blobs, shapes


class Blobs:
    def __init__(self, blobs: list[bytes]) -> None:
        self.blobs = blobs
        self.reads_may_block = False

    def __len__(self) -> int:
        return len(self.blobs)

    def read(self, index: int):
        return self.blobs[index], index


class WorkDataset:
    """feeder's per-sample work (SampleWork: decode + the same chain) as a Dataset item."""

    def __init__(self, blobs: list[bytes]) -> None:
        from feeder.ops.chain import Chain
        from feeder.engine.steps import SampleWork
        self.blobs = blobs
        self.work = SampleWork(Chain(make_transforms(), None, max_image_size=(MAX_SIZE, MAX_SIZE)))
        self.epoch = 0
        self.out = None

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int):
        import torch
        from feeder.sample.rng import sample_key
        key = sample_key(0, self.epoch, index)
        img, ctx = self.work.decode(self.blobs[index], key)
        if self.out is None:  # one max-size slot per worker, reused
            self.out = np.empty((MAX_SIZE, MAX_SIZE, 3), np.uint8)
        h, w = self.work.transform(img, key, ctx, self.out)
        # The image at its own size, in memory of its own (what a Dataset returns).
        return torch.from_numpy(self.out[:h, :w].copy()), index


def batch_images(items):
    """torchvision's batch_images on uint8 HWC: zeros, largest image rounded up to 32."""
    import torch
    images = [img for img, _ in items]
    H = -(-max(i.shape[0] for i in images) // 32) * 32
    W = -(-max(i.shape[1] for i in images) // 32) * 32
    batch = torch.zeros((len(images), H, W, 3), dtype=torch.uint8)
    for b, img in zip(batch, images):
        b[:img.shape[0], :img.shape[1]].copy_(img)
    sizes = torch.tensor([i.shape[:2] for i in images])
    return batch.permute(0, 3, 1, 2), sizes, torch.tensor([i for _, i in items])


def _init_worker(worker_id: int) -> None:
    import cv2
    cv2.setNumThreads(1)


def child(setting: str, images: int, epochs: int, side: int) -> dict:
    import cv2
    import torch
    from feeder import Feeder, ops
    # One OpenCV thread here, as in the workers and as feeder sets it: a thread
    # pool used before DataLoader forks its workers can deadlock them.
    cv2.setNumThreads(1)
    blobs, _ = make_blobs(images)
    cores = len(os.sched_getaffinity(0))
    t_build = time.perf_counter()
    if setting == "dl":
        loader = torch.utils.data.DataLoader(WorkDataset(blobs), batch_size=BATCH, shuffle=True,
                                             num_workers=cores, persistent_workers=True,
                                             collate_fn=batch_images, worker_init_fn=_init_worker)
    elif setting == "feeder-fixed":
        loader = Feeder(Blobs(blobs), BATCH, [ops.Resize((side, side)), ops.RandomHorizontalFlip()],
                        shuffle=True, seed=0)
    else:
        loader = Feeder(Blobs(blobs), BATCH, make_transforms(), shuffle=True, seed=0,
                        max_image_size=(MAX_SIZE, MAX_SIZE), size_divisibility=32,
                        group_by_aspect_ratio=setting == "feeder-var")
    n = valid = delivered = 0
    first = None
    t0 = None
    for _ in range(epochs):
        for batch in loader:
            if setting == "dl":
                imgs, sizes, _ = batch
            elif isinstance(batch, dict):
                imgs, sizes = batch["image"], batch["size"]
            else:
                imgs, sizes = batch[0], None
            if t0 is None:
                t0 = time.perf_counter()
                first = t0 - t_build
                continue  # the rate is taken after the first batch
            n += len(imgs)
            delivered += imgs.shape[0] * imgs.shape[2] * imgs.shape[3]
            batch_pixels = imgs.shape[0] * imgs.shape[2] * imgs.shape[3]
            valid += int((sizes[:, 0] * sizes[:, 1]).sum()) if sizes is not None else batch_pixels
    dt = time.perf_counter() - t0
    if setting != "dl":
        loader.close()
    return {"setting": setting, "images_per_s": n / dt, "first_batch_s": first,
            "padded_share": 1 - valid / delivered, "images": n}


def padding(images: int, epochs: int) -> list[str]:
    """Padded share of the delivered pixels, grouped against random batches, at one
    scale (shorter side 800, as the references evaluate) and multi-scale (480..800
    per image, as they train): the feeder's own batches ("size" and the shapes)."""
    from feeder import Feeder, ops

    class SingleScale(ops.Transform):
        def planned_size(self, height, width, ctx=None):
            return target_size(height, width, 800)

        def apply(self, img, rng, out=None, ctx=None):
            import cv2
            h, w = img.shape[:2]
            th, tw = target_size(h, w, 800)
            return cv2.resize(img, (tw, th), interpolation=cv2.INTER_NEAREST)

    blobs, shapes = make_blobs(images)
    lines = [f"padding: {images} JPEGs ({len(SHAPES)} COCO shapes, "
             f"{sum(w > h for w, h in shapes)} landscape, {sum(w < h for w, h in shapes)} portrait, "
             f"{sum(w == h for w, h in shapes)} square), batch {BATCH}, size_divisibility 32, "
             f"{epochs} epochs; padded share = 1 - sum(h*w) / sum(B*Hb*Wb)", "",
             "aspect: grouped by aspect ratio alone (GroupedBatchSampler's rule; the planned sizes",
             "withheld); grouped: by aspect ratio and planned size (group_by_aspect_ratio=True)", "",
             f"{'resize':26s} {'random':>8s} {'aspect':>8s} {'grouped':>8s} "
             f"{'padding per image pixel, random/aspect':>39s} {'random/grouped':>15s}"]
    import feeder.order.group as grouping
    plan = grouping.planned_sizes
    for name, first in (("shorter 800, max 1333", SingleScale()),
                        ("shorter 480..800, max 1333", make_transforms()[0])):
        shares = {}
        for group in ("random", "aspect", "grouped"):
            valid = total = 0
            grouping.planned_sizes = (lambda *a: None) if group == "aspect" else plan
            with Feeder(Blobs(blobs), BATCH, [first], shuffle=True, seed=0,
                        group_by_aspect_ratio=group != "random",
                        max_image_size=(MAX_SIZE, MAX_SIZE), size_divisibility=32) as f:
                for epoch in range(epochs):
                    f.set_epoch(epoch)
                    for b in f:
                        hw = b["size"]
                        valid += int((hw[:, 0] * hw[:, 1]).sum())
                        total += b["image"].shape[0] * b["image"].shape[2] * b["image"].shape[3]
            shares[group] = 1 - valid / total
        grouping.planned_sizes = plan
        r, a, g = shares["random"], shares["aspect"], shares["grouped"]
        lines.append(f"{name:26s} {r:8.3f} {a:8.3f} {g:8.3f} {r / (1 - r) / (a / (1 - a)):38.2f}x "
                     f"{r / (1 - r) / (g / (1 - g)):14.2f}x")
    return lines


def interleaved(images: int, pairs: int) -> list[str]:
    """``feeder-var`` and ``feeder-fixed`` in one process, both warm (buffers
    allocated, headers read), one epoch of each in turn: the ratio of each pair of
    neighbouring epochs cancels most of a shared machine's drifting load."""
    from feeder import Feeder, ops
    blobs, shapes = make_blobs(images)
    side = round(mean_area(shapes) ** 0.5)
    var = Feeder(Blobs(blobs), BATCH, make_transforms(), shuffle=True, seed=0,
                 max_image_size=(MAX_SIZE, MAX_SIZE), size_divisibility=32, group_by_aspect_ratio=True)
    fixed = Feeder(Blobs(blobs), BATCH, [ops.Resize((side, side)), ops.RandomHorizontalFlip()],
                   shuffle=True, seed=0)

    def epoch(f, e):
        f.set_epoch(e)
        t = time.perf_counter()
        n = sum(len(b["image"] if isinstance(b, dict) else b[0]) for b in f)
        return n / (time.perf_counter() - t)

    rows = []
    with var, fixed:
        epoch(var, 0), epoch(fixed, 0)  # warm: buffers, header sizes, caches
        for k in range(pairs):
            order = (var, fixed) if k % 2 == 0 else (fixed, var)
            rates = {id(f): epoch(f, k + 1) for f in order}
            rows.append((rates[id(var)], rates[id(fixed)]))
    ratios = sorted(v / f for v, f in rows)
    lines = [f"interleaved epochs in one process: {images} JPEGs, batch {BATCH}, feeder-var (grouped, "
             f"max 1333, size_divisibility 32) and feeder-fixed (Resize(({side}, {side}))), "
             f"{pairs} pairs of epochs, order alternating",
             "", "pair  var img/s  fixed img/s  var/fixed"]
    lines += [f"{k:4d} {v:10.1f} {f:12.1f} {v / f:10.3f}" for k, (v, f) in enumerate(rows)]
    lines += ["", f"median var/fixed: {statistics.median(ratios):.3f}"]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=240)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", default="feeder-var,feeder-var-random,feeder-fixed,dl")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.txt")
    ap.add_argument("--padding", action="store_true",
                    help="only the padding of grouped against random batches (one process)")
    ap.add_argument("--interleaved", type=int, default=0, metavar="PAIRS",
                    help="only feeder-var against feeder-fixed, epochs alternating in one process")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.padding or args.interleaved:
        text = "\n".join(padding(args.images, args.epochs) if args.padding
                          else interleaved(args.images, args.interleaved))
        print(text)
        if args.out:
            command = " ".join([os.path.relpath(sys.executable), *sys.argv])
            with open(args.out + ".txt", "w") as f:
                f.write(text + f"\n\ncommand: {command}\n")
        return 0
    if args.child:
        setting, images, epochs, side = args.child
        print(json.dumps(child(setting, int(images), int(epochs), int(side))))
        return 0
    _, shapes = make_blobs(args.images)
    area = mean_area(shapes)
    side = round(area ** 0.5)
    settings = args.settings.split(",")
    runs: list[dict] = []
    for r in range(args.rounds):
        order = settings[r % len(settings):] + settings[:r % len(settings)]
        for setting in order:
            out = subprocess.run([sys.executable, __file__, "--child", setting, str(args.images),
                                  str(args.epochs), str(side)], capture_output=True, text=True,
                                 timeout=900)
            if out.returncode:
                raise SystemExit(f"{setting} failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["round"] = r
            runs.append(row)
            print(f"round {r} {setting:18s} {row['images_per_s']:7.1f} img/s  padded "
                  f"{row['padded_share']:.3f}", flush=True)
    lines = [f"variable-size batches, detection-like: {args.images} JPEGs ({len(SHAPES)} COCO "
             f"shapes, landscape and portrait), shorter side 480..800 step 32, max 1333, flip; "
             f"batch {BATCH}, uint8, {args.epochs} epochs, {args.rounds} rounds, rotated order, "
             f"fresh process per run; {len(os.sched_getaffinity(0))} cores "
             f"({platform.processor() or platform.machine()}); fixed-size run: Resize(({side}, "
             f"{side})), the mean output area {area:.0f} px of the variable runs",
             "", f"{'setting':18s} {'img/s (median)':>15s} {'vs feeder-var':>14s} "
                 f"{'padded share':>13s}"]
    summary = {}
    for setting in settings:
        mine = [x for x in runs if x["setting"] == setting]
        ratios = []
        for x in mine:
            ref = [y for y in runs if y["round"] == x["round"] and y["setting"] == "feeder-var"]
            if ref:
                ratios.append(x["images_per_s"] / ref[0]["images_per_s"])
        summary[setting] = {
            "images_per_s": statistics.median(x["images_per_s"] for x in mine),
            "ratio_to_feeder_var": statistics.median(ratios) if ratios else None,
            "padded_share": statistics.median(x["padded_share"] for x in mine)}
        s = summary[setting]
        ratio = f"{s['ratio_to_feeder_var']:.3f}" if s["ratio_to_feeder_var"] else "-"
        lines.append(f"{setting:18s} {s['images_per_s']:15.1f} {ratio:>14s} "
                     f"{s['padded_share']:13.3f}")
    if "feeder-var" in summary and "feeder-var-random" in summary:
        g, rnd = summary["feeder-var"]["padded_share"], summary["feeder-var-random"]["padded_share"]
        lines.append("")
        lines.append(f"padded pixels, random batches / grouped batches: "
                     f"{rnd / (1 - rnd) / (g / (1 - g)):.2f}x (padding per valid pixel)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        command = " ".join([os.path.relpath(sys.executable), *sys.argv])
        with open(args.out + ".txt", "w") as f:
            f.write(text + f"\n\ncommand: {command}\n")
        with open(args.out + ".json", "w") as f:
            json.dump({"command": command, "summary": summary, "runs": runs, "side": side,
                       "mean_area": area}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
