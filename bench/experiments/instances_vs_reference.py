"""Per-instance masks, boxes and keypoints from feeder against torchvision's
detection reference (``references/detection/transforms.py``) for the same draw.

Runs the reference's ``hflip`` and ``multiscale`` training presets
(``RandomHorizontalFlip(0.5)``; ``RandomShortestSize((480, ..., 800), 1333)`` then
the flip) through feeder on generated samples (``tests/support/instances.py``:
ellipse instances with COCO-style keypoints), reads each sample's draw back from
what was delivered (its size; the flip from the image's red ramp), applies a numpy
re-implementation of the reference's transforms for that draw to the source
sample, and prints the share of mask pixels that agree, the largest box
difference and the largest keypoint difference.

    PYTHONPATH=. python bench/experiments/instances_vs_reference.py [--size 480 640] [--samples 48]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.support.instances import COCO_FLIP, flipped, instance_sample, ref_hflip, ref_resize  # noqa: E402

from feeder import Feeder, ops  # noqa: E402

MULTISCALE = (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)


class Samples:
    def __init__(self, n: int, size: tuple[int, int]) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def read(self, i: int) -> dict:
        return instance_sample(i, self.size, count=(1, 8))


def compare(preset: str, n: int, size: tuple[int, int], isolation: str = "thread") -> dict:
    """Run ``preset`` over ``n`` samples of ``size``; returns the agreement figures."""
    flip = ops.RandomHorizontalFlip(0.5, keypoint_flip=ops.COCO_PERSON_KEYPOINT_FLIP)
    transforms = [flip] if preset == "hflip" else [ops.RandomShortestSize(MULTISCALE, 1333), flip]
    side = max(size) if preset == "hflip" else 1333
    source = Samples(n, size)
    equal = total = 0
    box_err = kp_err = 0.0
    vis_diff = 0
    with Feeder(source, 4, transforms, max_image_size=(side, side), size_divisibility=32,
                seed=0, isolation=isolation) as feeder:
        for batch in feeder:
            images, targets = batch.images_and_targets()
            for image, target in zip(images, targets):
                sample = source.read(int(target["image_id"]))
                ref = {k: sample[k] for k in ("boxes", "masks", "keypoints")}
                h, w = image.shape[1:]
                if (h, w) != size:
                    ref = ref_resize(ref, size, (h, w))
                if flipped(image):
                    ref = ref_hflip(ref, w, COCO_FLIP)
                masks = target["masks"].numpy()
                assert masks.shape == ref["masks"].shape, (masks.shape, ref["masks"].shape)
                equal += int((masks == ref["masks"]).sum())
                total += masks.size
                box_err = max(box_err, float(np.abs(target["boxes"].numpy() - ref["boxes"]).max()))
                kp, rk = target["keypoints"].numpy(), ref["keypoints"]
                vis_diff += int(((kp[..., 2] > 0) != (rk[..., 2] > 0)).sum())
                kp_err = max(kp_err, float(np.abs(kp[..., :2] - rk[..., :2]).max()))
    return {"preset": preset, "size": size, "samples": n, "mask_agreement": equal / total,
            "box_max_diff": box_err, "keypoint_max_diff": kp_err, "visibility_diffs": vis_diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, nargs=2, default=(480, 640), metavar=("H", "W"))
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--isolation", default="thread", choices=("thread", "process"))
    args = p.parse_args()
    for preset in ("hflip", "multiscale"):
        r = compare(preset, args.samples, tuple(args.size), args.isolation)
        print(f"{r['preset']:10s} {r['size'][0]}x{r['size'][1]} x{r['samples']}: masks equal on "
              f"{100 * r['mask_agreement']:.4f}% of pixels, boxes within {r['box_max_diff']:.2e} px, "
              f"keypoints within {r['keypoint_max_diff']:.2e} px, {r['visibility_diffs']} "
              f"visibility differences")


if __name__ == "__main__":
    main()
