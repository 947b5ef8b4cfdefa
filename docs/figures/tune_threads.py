"""The figure of ``"tune"`` thread counts over time (docs/guides/doctor.md).

A source whose reads each wait 5 ms (as on remote storage) feeds a training
loop that takes 60 ms per batch, then none (the model sped up). With
``read_threads="tune"`` the read pool starts at its ``"auto"`` size, parks the
threads the slow loop does not need, and wakes them as soon as the loop
starts waiting; the figure plots ``stats().active_threads`` against the
loop's pace. Seconds on a
CPU::

    python docs/figures/tune_threads.py [OUT_DIR]   # default: docs/figures/
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from feeder import Feeder, ops

NAME = "tune_threads.png"
BATCH = 16
READ_S = 0.005
# (batches, the loop's step in ms): slow, then fast; FEEDER_FIGURE_QUICK=1: fewer
# batches (the docs tests draw the figure that way).
PHASES = ([(40, 60.0), (30, 0.0)] if os.environ.get("FEEDER_FIGURE_QUICK") == "1"
          else [(150, 60.0), (100, 0.0)])


class SlowReads:
    """Tiny JPEGs, each read waiting READ_S as a remote store would."""

    reads_may_block = True

    def __init__(self, n: int) -> None:
        import cv2

        ok, buf = cv2.imencode(".jpg", np.full((24, 24, 3), 128, np.uint8))
        self.jpeg, self.n = buf.tobytes(), n

    def __len__(self) -> int:
        return self.n

    def read(self, i: int) -> tuple[bytes, int]:
        time.sleep(READ_S)
        return self.jpeg, i % 2


def run() -> tuple[list[tuple[float, str, int]], list[tuple[float, float]]]:
    """``(active_threads, [(seconds, step ms)])`` of one tuned pass."""
    steps = [ms for count, ms in PHASES for _ in range(count)]
    pace = []
    with Feeder(SlowReads(BATCH * len(steps)), BATCH, [ops.Resize((16, 16))], read_threads="tune",
                decode_threads=2, seed=0) as feeder:
        t0 = None
        for k, _batch in enumerate(feeder):
            if t0 is None:
                t0 = time.perf_counter()
            ms = steps[min(k, len(steps) - 1)]
            pace.append((time.perf_counter() - t0, ms))
            if ms:
                time.sleep(ms / 1000)
        history = feeder.stats().active_threads
    return list(history), pace


def draw(history: list[tuple[float, str, int]], pace: list[tuple[float, float]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.4))
    pts = [(t, n) for t, stage, n in history if stage == "read"]
    end = pace[-1][0]
    ax.step([t for t, _ in pts] + [end], [n for _, n in pts] + [pts[-1][1]], where="post",
            color="tab:blue", label='read threads active ("tune")')
    ax.set_xlabel("seconds")
    ax.set_ylabel("threads active")
    ax.set_ylim(0, max(n for _, n in pts) + 2)
    # Shade the fast phase: the loop stops sleeping and needs more reads at once.
    fast = [t for t, ms in pace if ms == 0]
    if fast:
        ax.axvspan(fast[0], max(end, fast[-1]), color="tab:orange", alpha=0.15,
                   label=f"the loop's step: 0 ms ({PHASES[0][1]:g} ms before)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(f"batches of {BATCH}, each read waiting {READ_S * 1000:g} ms: threads follow the loop's pace",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(out_dir: str) -> str:
    history, pace = run()
    os.makedirs(out_dir, exist_ok=True)
    return draw(history, pace, os.path.join(out_dir, NAME))


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))))
