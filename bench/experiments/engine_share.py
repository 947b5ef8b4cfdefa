"""Where small images lose to worker processes: the engine's own share against the
per-sample work's, on the same threads.

Each row runs in a fresh process, rows alternating over ``--rounds`` rounds,
epochs 1-3 of the files (epoch 0 warms the page cache and the verified-JPEG
memory):

* ``feeder``: a Feeder with its defaults (``RandomResizedCrop(64)`` + flip,
  batch 256), the engine and all.
* ``threads``: the same per-sample work (the source's read, then
  ``SampleWork.decode`` and ``SampleWork.transform``, the calls the engine's
  decode step makes) on ``--threads`` plain threads, each a fixed share of the
  files: no sampler, queues, batch slots or transfer.
* ``threads, decode only``: as ``threads`` without the transform (the resize
  and the flip): what the per-sample work would cost if the transform ran in
  the decode's C call.
* ``one thread``: the ``threads`` row on one thread; twice its rate is what
  the threads would reach if they never waited for each other.

``feeder`` over ``threads`` is the engine's own share; ``threads`` over twice
``one thread`` is what the per-sample work's hand-offs of the GIL cost.

    python bench/experiments/engine_share.py DATA [--rounds 3] [--threads 2]

DATA: an ImageFolder of small JPEGs (``feeder-bench make-data DATA --small``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

ROWS = ("feeder", "threads", "threads, decode only", "one thread")
_SIZE = 64
_EPOCHS = 3


def _transforms():
    from feeder import ops
    return [ops.RandomResizedCrop(_SIZE), ops.RandomHorizontalFlip()]


def _feeder(data: str, threads: int) -> tuple[float, float]:
    from feeder import Feeder, ImageFolder

    with Feeder(ImageFolder(data), 256, _transforms(), seed=0, decode_threads=threads) as f:
        f.set_epoch(0)
        for _ in f:
            pass
        t, c, n = time.perf_counter(), time.process_time(), 0
        for epoch in range(1, _EPOCHS + 1):
            f.set_epoch(epoch)
            for x, _ in f:
                n += x.shape[0]
        dt = time.perf_counter() - t
        return n / dt, (time.process_time() - c) / dt


def _threads(data: str, threads: int, transform: bool) -> tuple[float, float]:
    import numpy as np

    from feeder import ImageFolder
    from feeder.decode.image import buffer_of
    from feeder.decode.step import SampleWork
    from feeder.ops.chain import Chain
    from feeder.sample.rng import epoch_key, index_key

    source = ImageFolder(data)
    work = SampleWork(Chain(_transforms(), None), files=len(source))

    def run(indices: list[int], epoch: int) -> None:
        out = np.zeros((_SIZE, _SIZE, 3), np.uint8)
        ekey = epoch_key(0, epoch)
        for i in indices:
            data, _ = source.read(i)
            key = index_key(ekey, i)
            img, ctx = work.decode(data, key)
            if transform:
                work.transform(img, key, ctx, out)
            else:
                work.buffers.give(buffer_of(img))

    def epoch(e: int) -> None:
        pool = [threading.Thread(target=run, args=(list(range(k, len(source), threads)), e))
                for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    epoch(0)
    t, c = time.perf_counter(), time.process_time()
    for e in range(1, _EPOCHS + 1):
        epoch(e)
    dt = time.perf_counter() - t
    return _EPOCHS * len(source) / dt, (time.process_time() - c) / dt


def one(data: str, row: str, threads: int) -> tuple[float, float]:
    if row == "feeder":
        return _feeder(data, threads)
    if row == "one thread":
        return _threads(data, 1, True)
    return _threads(data, threads, row == "threads")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", choices=ROWS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(*one(args.data, args.one, args.threads))
        return
    got: dict[str, list[tuple[float, float]]] = {row: [] for row in ROWS}
    for r in range(args.rounds):
        order = ROWS[r % len(ROWS):] + ROWS[:r % len(ROWS)]
        for row in order:
            cmd = [sys.executable, __file__, args.data, "--one", row, "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900).stdout
            rate, cores = map(float, out.split())
            got[row].append((rate, cores))
            print(f"round {r + 1}: {row}: {rate:.0f} images/s, {cores:.2f} cores", file=sys.stderr)
    med = {row: statistics.median(v[0] for v in vals) for row, vals in got.items()}
    print(f"small images, RandomResizedCrop({_SIZE}) + flip, epochs 1-{_EPOCHS}; "
          f"{args.threads} threads; median of {args.rounds} rounds, each row a fresh process")
    print(f"{'row':24s} {'images/s':>9s} {'cores':>6s}  rounds")
    for row, vals in got.items():
        cores = statistics.median(v[1] for v in vals)
        print(f"{row:24s} {med[row]:9.0f} {cores:6.2f}  " + " ".join(f"{v[0]:.0f}" for v in vals))
    # Ratios within each round (its rows ran one after the other), then their median.
    def ratio(a: str, b: str, times: int = 1) -> str:
        each = [x[0] / (times * y[0]) for x, y in zip(got[a], got[b])]
        return f"{statistics.median(each):.2f} (rounds: {' '.join(f'{r:.2f}' for r in each)})"

    print(f"engine's own share: feeder / threads = {ratio('feeder', 'threads')}")
    print(f"hand-offs: threads / ({args.threads} x one thread) = "
          f"{ratio('threads', 'one thread', args.threads)}")
    print(f"the transform: decode only / threads = {ratio('threads, decode only', 'threads')}")


if __name__ == "__main__":
    main()
