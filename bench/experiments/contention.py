"""How much does work on the *other* core slow the training thread, with no loader at all?

The interference benchmark (``feeder-bench interference``) times the training
thread's proxy step while a loader feeds it. This script separates the part of
that slowdown that no loader design can remove: a separate process, pinned to
the loader's core, runs the same per-sample work (read, decode, transforms)
in a loop and delivers nothing; the training thread, pinned to its own core,
runs the same proxy step (``ProxyStep``: tiny in-place ops) on nothing. There is
no shared GIL, no queue, no copy: whatever slowdown remains is the machine's
(shared caches, memory bandwidth, the host's scheduling of the two vCPUs).

    python bench/experiments/contention.py DATA

Alternates short windows with the busy process working and idle (200 pairs of
20 steps), and prints the median over pairs of busy/alone step times, each
pair measured back to back (this machine's own speed drifts between seconds).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch

from feeder import ImageFolder
from feeder.bench.fedloop import ProxyStep
from feeder.bench.loaders import sample_work


def busy(root: str, core: int, ready, stop, run) -> None:
    """Decode and transform samples of ``root`` on ``core`` while ``run`` is set,
    until ``stop`` is set."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    source = ImageFolder(root)
    work = sample_work()
    h, w = work.image_size
    out = torch.empty((h, w, 3), dtype=torch.uint8).numpy()
    i = 0
    ready.set()
    while not stop.is_set():
        if not run.wait(0.05):
            continue
        data, _ = source.read(i % len(source))
        work(data, i, out)
        i += 1


def steps(step: ProxyStep, count: int) -> float:
    """Median step time over ``count`` steps (seconds)."""
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        step(None, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--rounds", type=int, default=200, help="alternating window pairs")
    p.add_argument("--steps", type=int, default=20, help="steps per window")
    p.add_argument("--ops", type=int, default=400)
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: one for the training thread, one for the busy process")
    loop_core, busy_core = cores[0], cores[1]
    os.sched_setaffinity(0, {loop_core})
    torch.set_num_threads(1)
    step = ProxyStep("cpu", args.ops)
    steps(step, 50)  # warm-up
    ctx = mp.get_context("spawn")
    ready, stop, run = ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=busy, args=(args.data, busy_core, ready, stop, run), daemon=True)
    proc.start()
    if not ready.wait(60):
        raise SystemExit("the busy process did not start")
    # Short alternating windows: this machine's own speed drifts between seconds,
    # so each "busy" window is compared with the "alone" window right next to it.
    ratios = []
    try:
        for r in range(args.rounds):
            pair = {}
            for what in (("alone", "busy") if r % 2 == 0 else ("busy", "alone")):
                if what == "busy":
                    run.set()
                    time.sleep(0.02)  # let it get going (a sample takes about 2 ms)
                else:
                    run.clear()
                    time.sleep(0.01)  # let its current sample finish
                pair[what] = steps(step, args.steps)
            run.clear()
            ratios.append(pair["busy"] / pair["alone"])
    finally:
        stop.set()
        proc.join(10)
    q = statistics.quantiles(ratios, n=4)
    print(f"proxy step ({args.ops} tiny ops) on core {loop_core}, a separate process decoding on "
          f"core {busy_core}, {args.rounds} alternating pairs of {args.steps}-step windows: "
          f"busy/alone median {statistics.median(ratios):.2f} (quartiles {q[0]:.2f}-{q[2]:.2f})")


if __name__ == "__main__":
    main()
