"""What the decode/augment stage split costs: the feeder as built, against the
same feeder with each sample's transforms run in its decode thread (no hand-off
to the augment pool). Same process, alternating, several epochs each.

    python bench/experiments/stage_split.py DATA_DIR [--rounds 4]

This is a measurement, not a mode of the library: the fused variant patches a
private method for the duration of its epochs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from feeder import Feeder, ImageFolder, ops
from feeder import _decode


def _fused(self, task, c):
    """Decoder.process followed by the augment stage's work, in the decode thread."""
    run = self.run
    try:
        data, label = run.source.read(task.index)
    except Exception as exc:
        run.sample_failed("read", task, exc, c)
        return
    task.label = label
    task.key = _decode.sample_key(run.seed, run.epoch, task.index)
    task.ctx = None
    task.image, size = _decode.decode_image(data, run.max_pixels, run.hint, task, run.decode_buffers)
    if task.ctx is None:
        task.ctx = _decode.SampleContext(size)
    run.stages[2].process(task, c)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    src = ImageFolder(args.dir)
    staged = _decode.Decoder.process
    rates: dict[str, list[float]] = {"staged": [], "fused": []}
    with Feeder(src, args.batch_size, [ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()],
                decode_threads=2, augment_threads=1, seed=0) as f:
        for _ in f:  # warm-up epoch
            pass
        for r in range(args.rounds):
            for mode in (("staged", "fused") if r % 2 == 0 else ("fused", "staged")):
                _decode.Decoder.process = _fused if mode == "fused" else staged
                try:
                    t, n = time.perf_counter(), 0
                    for _, y in f:
                        n += len(y)
                    rates[mode].append(n / (time.perf_counter() - t))
                finally:
                    _decode.Decoder.process = staged
    for mode, v in rates.items():
        print(f"{mode:7s} img/s per epoch {[round(x) for x in v]}  median {statistics.median(v):.0f}")
    print(f"staged / fused: {statistics.median(rates['staged']) / statistics.median(rates['fused']):.3f}")


if __name__ == "__main__":
    main()
