"""What the decode/augment stage split costs: the feeder as built, against the
same feeder with each sample's transforms run in its decode thread (no hand-off
to the augment pool). Same process, alternating, several epochs each.

    python bench/experiments/stage_split.py DATA_DIR [--rounds 4]

This is a measurement, not a mode of the library: the fused variant patches the
decode stage's put for the duration of its epochs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from feeder import Feeder, ImageFolder, ops
from feeder import _decode
from feeder._queue import END
from feeder._stage import Stage


def _inline_put(self, c, channel, item):
    """Decoder.put in the fused variant: the decoded sample goes straight through the
    augment stage's work in this thread instead of onto the augment queue."""
    if channel is self.outbox and item is not END:
        self.run.stages[2].process(item, c)
    else:
        Stage.put(self, c, channel, item)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    src = ImageFolder(args.dir)
    rates: dict[str, list[float]] = {"staged": [], "fused": []}
    with Feeder(src, args.batch_size, [ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()],
                decode_threads=2, augment_threads=1, seed=0) as f:
        for _ in f:  # warm-up epoch
            pass
        for r in range(args.rounds):
            for mode in (("staged", "fused") if r % 2 == 0 else ("fused", "staged")):
                if mode == "fused":
                    _decode.Decoder.put = _inline_put
                try:
                    t, n = time.perf_counter(), 0
                    for _, y in f:
                        n += len(y)
                    rates[mode].append(n / (time.perf_counter() - t))
                finally:
                    if mode == "fused":
                        del _decode.Decoder.put  # back to Stage.put
    for mode, v in rates.items():
        print(f"{mode:7s} img/s per epoch {[round(x) for x in v]}  median {statistics.median(v):.0f}")
    print(f"staged / fused: {statistics.median(rates['staged']) / statistics.median(rates['fused']):.3f}")


if __name__ == "__main__":
    main()
