"""The figure of a padded, grouped detection batch (docs/guides/detection.md).

Runs a feeder over a generated detection set (images of random sizes and
aspect ratios), with ``max_image_size``, ``size_divisibility=32`` and
``group_by_aspect_ratio=True``, and draws the epoch's first batch of portraits
and its first of landscapes as they come: each image at the top left of the
batch's slot, the padding around it, its boxes. Seconds on a CPU::

    python docs/figures/detection_batch.py [OUT_DIR]   # default: docs/figures/
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

from feeder import Feeder, ops
from feeder.synthetic import make_detection_set

NAME = "detection_batch.png"


class Detection:
    def __init__(self, annotations: str) -> None:
        with open(annotations) as f:
            self.records = json.load(f)

    def __len__(self) -> int:
        return len(self.records)

    def read(self, i: int) -> dict:
        r = self.records[i]
        with open(r["image"], "rb") as f:
            return {"image": f.read(), "boxes": np.asarray(r["boxes"], np.float32).reshape(-1, 4),
                    "box_labels": np.asarray(r["labels"], np.int64)}


def batches(data: str) -> list[dict]:
    """The first batch of portraits and the first of landscapes of a grouped, padded
    feeder over ``data``, as numpy."""
    out: dict[bool, dict] = {}
    with Feeder(Detection(os.path.join(data, "annotations.json")), batch_size=4, shuffle=True, seed=3,
                transforms=[ops.Resize(64)], max_image_size=(160, 160), size_divisibility=32,
                group_by_aspect_ratio=True) as feeder:
        for batch in feeder:
            sizes = batch["size"].numpy()
            portrait = bool(sizes[0, 0] > sizes[0, 1])
            if portrait not in out:
                out[portrait] = {"image": batch["image"].numpy().transpose(0, 2, 3, 1), "size": sizes,
                                 "boxes": [b.numpy() for b in batch["boxes"]]}
            if len(out) == 2:
                break
    return [out[k] for k in sorted(out)]


def draw(got: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cols = max(len(b["image"]) for b in got)
    fig, axes = plt.subplots(len(got), cols, figsize=(2.3 * cols, 2.5 * len(got)), squeeze=False)
    for row, b in enumerate(got):
        hb, wb = b["image"].shape[1:3]
        for col, ax in enumerate(axes[row]):
            ax.set_xticks([])
            ax.set_yticks([])
            if col >= len(b["image"]):
                ax.axis("off")
                continue
            h, w = (int(x) for x in b["size"][col])
            ax.imshow(b["image"][col], interpolation="nearest")
            # The padding: zeros right of and below the image, up to the batch's size.
            ax.add_patch(Rectangle((w - 0.5, -0.5), wb - w, hb, facecolor="none", edgecolor="tab:gray",
                                   hatch="///", linewidth=0))
            ax.add_patch(Rectangle((-0.5, h - 0.5), w, hb - h, facecolor="none", edgecolor="tab:gray",
                                   hatch="///", linewidth=0))
            ax.add_patch(Rectangle((-0.5, -0.5), w, h, facecolor="none", edgecolor="white", linewidth=1.2,
                                   linestyle="--"))
            for x0, y0, x1, y1 in b["boxes"][col]:
                ax.add_patch(Rectangle((x0 - 0.5, y0 - 0.5), x1 - x0, y1 - y0, facecolor="none",
                                       edgecolor="yellow", linewidth=1.2))
            ax.set_title(f"image {h}x{w}", fontsize=8)
        axes[row][0].set_ylabel(f"a batch: {hb}x{wb}", fontsize=9)
    fig.suptitle("Resize(64), max_image_size=(160, 160), size_divisibility=32, group_by_aspect_ratio=True:\n"
                 "each image at the top left, padding (hatched) to the batch's largest, rounded up to 32; "
                 "boxes in yellow", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(out_dir: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        make_detection_set(tmp, count=32, size_range=(60, 150), seed=4)
        got = batches(tmp)
    os.makedirs(out_dir, exist_ok=True)
    return draw(got, os.path.join(out_dir, NAME))


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))))
