"""The figure of a mixture's proportions over an epoch (docs/guides/mixtures.md).

Runs a feeder over a :class:`feeder.Mixture` of three sources (weights 0.6, 0.3
and 0.1; the smallest source repeats within the epoch, the largest streams
across epochs) and records ``last_batch.sources`` for every batch: the top
panel plots each source's share of the samples delivered so far, the bottom
one how far each source's count is from ``weight * samples``, in samples.
Seconds on a CPU::

    python docs/figures/mixture_proportions.py [OUT_DIR]   # default: docs/figures/
"""

from __future__ import annotations

import os
import sys

import numpy as np

from feeder import Feeder, Mixture, ops

NAME = "mixture_proportions.png"
BATCH = 32
WEIGHTS = [0.6, 0.3, 0.1]
LENGTHS = [3000, 400, 5000]
PIXELS = np.full((8, 8, 3), 127, np.uint8)


class Decoded:
    """``n`` small decoded images (no decoding cost: the figure is about the order)."""

    reads_may_block = False

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def read(self, index: int):
        return PIXELS, 0


def run() -> np.ndarray:
    """The source number of every sample of one epoch, in delivery order."""
    mix = Mixture([Decoded(n) for n in LENGTHS], WEIGHTS, names=["curated", "synthetic", "web"])
    out = []
    with Feeder(mix, BATCH, [ops.Resize((8, 8))], shuffle=True, seed=0, decode_threads=2) as feeder:
        for _batch in feeder:
            out.append(feeder.last_batch.sources.numpy())
    return np.concatenate(out)


def draw(sources: np.ndarray, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    total = sum(LENGTHS)
    names = [f"{name} ({n} samples, {w * total / n:.2g} passes an epoch)"
             for name, n, w in zip(("curated", "synthetic", "web"), LENGTHS, WEIGHTS)]
    n = np.arange(1, len(sources) + 1)
    head = 8 * BATCH
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.4))
    for k, (w, name) in enumerate(zip(WEIGHTS, names)):
        drawn = np.cumsum(sources == k)
        line, = top.plot(n, drawn / n, label=f"{name}, weight {w}")
        top.axhline(w, color=line.get_color(), linestyle=":", linewidth=1)
        bottom.step(n[:head], (drawn - w * n)[:head], where="post", color=line.get_color(),
                    linewidth=1)
    top.set_xscale("log")
    top.set_xlabel("samples delivered (n), the whole epoch")
    top.set_ylabel("share so far")
    top.set_ylim(0, 0.8)
    top.legend(fontsize=8, loc="upper right")
    top.grid(alpha=0.3)
    top.set_title(f"one epoch of a Mixture, batches of {BATCH}: every prefix holds the weights",
                  fontsize=9)
    for b in range(BATCH, head, BATCH):
        bottom.axvline(b, color="black", linewidth=0.5, alpha=0.4)
    bottom.axhspan(-1, 1, color="tab:gray", alpha=0.12, label="within one sample")
    bottom.set_ylabel("drawn - weight x n\n(samples)")
    bottom.set_xlabel(f"samples delivered (n), the first {head // BATCH} batches (lines: batch ends)")
    bottom.set_ylim(-2, 2)
    bottom.legend(fontsize=8, loc="lower right")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(out_dir: str) -> str:
    sources = run()
    os.makedirs(out_dir, exist_ok=True)
    return draw(sources, os.path.join(out_dir, NAME))


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))))
