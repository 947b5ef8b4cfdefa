"""``decode_threads="tune"`` against ``"auto"`` with a model step 4x slower than the loader,
which then becomes 4x faster mid-run (issue #26's targets).

    python bench/experiments/tune.py DATA [--rounds 2] [--batch-size 32] [--out bench/results]

DATA is an image folder (``feeder-bench make-data``); it is read 20 times over per
pass (one long pass, so the tuner's state is not reset at an epoch boundary).

The step stands for a GPU step on this CPU-only machine: its host side is
launch-bound (:class:`feeder.bench.interference.ProxyStep`: tiny in-place torch
ops, each a C call that gives the GIL up and takes it back, as kernel launches
do) for ``LAUNCH_SHARE`` of its time, and it waits (GIL and CPU free, as for
the device) for the rest. It is calibrated to take 4x the loader's time per
batch (the loader alone, ``"auto"``, measured first). Each run takes
``--slow`` batches at that step, then ``--fast`` batches at a step 4x shorter
(as fast as the loader). Per setting, in alternating rounds:

* active decode threads in the slow phase (its last half): ``stats().active()``;
* the loop's wait share in the slow phase (after ``--warmup`` batches) and in
  the fast phase after its first 20 batches;
* decoded images in flight: decode threads holding a sample, sampled every
  5 ms, mean over the slow phase; and batch buffers allocated;
* the interference: the median step fed (slow phase) over the median step
  alone (timed before the runs, no loader);
* after the switch: batches until the active count is back at the ``"auto"``
  count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

from feeder import Feeder, ImageFolder, ops
from feeder.bench.fedloop import ProxyStep
from feeder.bench.report import describe_machine, machine_info


LAUNCH_SHARE = 0.3


class GpuLikeStep:
    """``ops`` launch-like torch ops, then ``wait_s`` asleep (the device's share)."""

    def __init__(self, ops: int, wait_s: float) -> None:
        self.proxy = ProxyStep("cpu", ops)
        self.ops, self.wait_s = ops, wait_s

    def __call__(self, images, labels) -> None:
        self.proxy(images, labels)
        time.sleep(self.wait_s)


class Repeat:
    """``source`` ``times`` over, as one long epoch."""

    def __init__(self, source, times: int) -> None:
        self.source, self.times = source, times

    def __len__(self) -> int:
        return len(self.source) * self.times

    def read(self, i: int):
        return self.source.read(i % len(self.source))


def transforms():
    return [ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()]


def step_time(step, n: int = 20) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step(None, None)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def loader_batch_s(source, batch_size: int, batches: int = 40) -> float:
    with Feeder(source, batch_size, transforms(), shuffle=True, seed=0) as f:
        it = iter(f)
        next(it)
        t = time.perf_counter()
        for _ in range(batches):
            next(it)
        return (time.perf_counter() - t) / batches


def in_flight_sampler(f, out: list, stop: threading.Event) -> None:
    """Decode threads holding a sample, every 5 ms (a sample in work holds a decoded image)."""
    while not stop.wait(0.005):
        run = f._engine.current
        if run is None:
            continue
        decode = [s for s in run.stages if s.name == "decode"]
        if decode:
            out.append(sum(1 for c in decode[0].counters if c.current is not None and c.ended is None))


def run(source, setting, batch_size: int, slow_step, fast_step, slow: int, fast: int,
        warmup: int, alone_s: float) -> dict:
    rows = []
    flight: list[int] = []
    stop = threading.Event()
    with Feeder(source, batch_size, transforms(), shuffle=True, seed=0,
                decode_threads=setting) as f:
        auto = int(f.config.decode_threads)
        it = iter(f)
        next(it)
        sampler = threading.Thread(target=in_flight_sampler, args=(f, flight, stop), daemon=True)
        sampler.start()
        marks = {}
        for k in range(slow + fast):
            step = slow_step if k < slow else fast_step
            if k == slow:
                marks["flight"] = len(flight)
                marks["buffers"] = f.stats().buffers
            t0 = time.perf_counter()
            next(it)
            t1 = time.perf_counter()
            step(None, None)
            t2 = time.perf_counter()
            rows.append({"wait": t1 - t0, "step": t2 - t1, "active": f.stats().active() or auto})
        stop.set()
        sampler.join(5)
        stats = f.stats()

    def share(part):
        total = sum(r["wait"] + r["step"] for r in part)
        return sum(r["wait"] for r in part) / total if total else 0.0

    slow_rows = rows[warmup:slow]
    after = rows[slow:]
    regrow = next((i + 1 for i, r in enumerate(after) if r["active"] >= auto), None)
    return {
        "setting": setting, "auto_threads": auto,
        "active_slow": statistics.median(r["active"] for r in rows[slow // 2:slow]),
        "wait_share_slow": share(slow_rows),
        "wait_share_fast_after_20": share(after[20:]),
        "decoded_in_flight_slow": statistics.mean(flight[:marks["flight"]]) if flight else None,
        "buffers_at_switch": marks["buffers"],
        "step_fed_ms": 1e3 * statistics.median(r["step"] for r in slow_rows),
        "interference": statistics.median(r["step"] for r in slow_rows) / alone_s,
        "regrown_after_batches": regrow if setting == "tune" else None,
        "active_history": [(round(t, 2), n) for t, s, n in stats.active_threads if s == "decode"][:40],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--slow", type=int, default=80)
    p.add_argument("--fast", type=int, default=60)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    source = Repeat(ImageFolder(args.data), 20)
    per_op = step_time(ProxyStep("cpu", 2000)) / 2000
    load_s = loader_batch_s(source, args.batch_size)
    slow_step = GpuLikeStep(max(1, round(LAUNCH_SHARE * 4 * load_s / per_op)),
                            (1 - LAUNCH_SHARE) * 4 * load_s)
    fast_step = GpuLikeStep(max(1, round(LAUNCH_SHARE * load_s / per_op)), (1 - LAUNCH_SHARE) * load_s)
    slow_alone = step_time(slow_step, 10)
    print(f"loader alone: {1e3 * load_s:.1f} ms a batch of {args.batch_size}; slow step "
          f"{slow_step.ops} ops = {1e3 * slow_alone:.1f} ms alone; fast step {fast_step.ops} ops",
          file=sys.stderr)
    results = {"auto": [], "tune": []}
    for r in range(args.rounds):
        for setting in (("auto", "tune") if r % 2 == 0 else ("tune", "auto")):
            res = run(source, setting, args.batch_size, slow_step, fast_step, args.slow, args.fast,
                      args.warmup, slow_alone)
            results[setting].append(res)
            print(f"round {r} {setting}: " + json.dumps({k: v for k, v in res.items()
                                                          if k != "active_history"}), file=sys.stderr)
    med = {s: {k: statistics.median(x[k] for x in rs) for k in rs[0]
               if isinstance(rs[0][k], (int, float)) and not isinstance(rs[0][k], bool)
               and all(x[k] is not None for x in rs)}
           for s, rs in results.items()}
    a, t = med["auto"], med["tune"]
    regrow = [x["regrown_after_batches"] for x in results["tune"]]
    lines = [
        f"tune vs auto: {args.data} x20 as one pass, RandomResizedCrop(224)+flip, batch "
        f"{args.batch_size}; a GPU-like step ({100 * LAUNCH_SHARE:.0f}% launch-bound ProxyStep ops, "
        f"the rest asleep) 4x the loader's batch time "
        f"({1e3 * load_s:.1f} ms -> {1e3 * slow_alone:.1f} ms alone) for {args.slow} batches, then "
        f"4x faster for {args.fast}; {args.rounds} alternating rounds, medians",
        f"machine: {describe_machine(machine_info())}",
        f"command: python bench/experiments/tune.py {' '.join(sys.argv[1:])}",
        "",
        f"{'':34}{'auto':>10}{'tune':>10}",
        f"{'active decode threads (slow)':34}{a['active_slow']:>10.1f}{t['active_slow']:>10.1f}",
        f"{'loop wait share (slow)':34}{100 * a['wait_share_slow']:>9.2f}%{100 * t['wait_share_slow']:>9.2f}%",
        f"{'decoded images in flight (slow)':34}{a['decoded_in_flight_slow']:>10.2f}"
        f"{t['decoded_in_flight_slow']:>10.2f}",
        f"{'batch buffers at the switch':34}{a['buffers_at_switch']:>10.0f}{t['buffers_at_switch']:>10.0f}",
        f"{'step fed / alone (interference)':34}{a['interference']:>10.3f}{t['interference']:>10.3f}",
        f"{'loop wait share (fast, from 20)':34}{100 * a['wait_share_fast_after_20']:>9.2f}%"
        f"{100 * t['wait_share_fast_after_20']:>9.2f}%",
        f"tune regrew to the auto count after {regrow} batches of the fast step (per round)",
        "",
        "targets:",
        f"  fewer active threads than auto: {t['active_slow']:.1f} < {a['active_slow']:.1f}: "
        f"{'met' if t['active_slow'] < a['active_slow'] else 'NOT met'}",
        f"  wait share at most 1 pp above auto's: {100 * (t['wait_share_slow'] - a['wait_share_slow']):+.2f} pp: "
        f"{'met' if t['wait_share_slow'] - a['wait_share_slow'] <= 0.01 else 'NOT met'}",
        f"  fewer decoded images in flight: {t['decoded_in_flight_slow']:.2f} < "
        f"{a['decoded_in_flight_slow']:.2f}: "
        f"{'met' if t['decoded_in_flight_slow'] < a['decoded_in_flight_slow'] else 'NOT met'}",
        f"  less interference: {t['interference']:.3f} < {a['interference']:.3f}: "
        f"{'met' if t['interference'] < a['interference'] else 'NOT met'}",
        f"  regrows within 20 batches: {regrow}: "
        f"{'met' if all(x is not None and x <= 20 for x in regrow) else 'NOT met'}",
        f"  wait share back near auto's after the switch (batches 20+): "
        f"{100 * (t['wait_share_fast_after_20'] - a['wait_share_fast_after_20']):+.2f} pp",
    ]
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump({"command": sys.argv, "load_batch_s": load_s, "slow_ops": slow_step.ops,
                   "fast_ops": fast_step.ops, "slow_alone_s": slow_alone, "runs": results,
                   "medians": med}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
