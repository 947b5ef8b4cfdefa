"""A/B of ``isolation="thread"`` and ``isolation="process"`` (its worker forked and
spawned: ``start_method``) on the same data and settings.

Alternating rounds, each run a fresh child process (so neither inherits the
other's warm caches or threads). Per run it reports:

* images/s over ``--epochs`` epochs with an empty consumer (what ``feeder-bench
  compare`` times), from the first batch to the end (steady state; the first
  batch is reported on its own);
* the first batch: from ``Feeder(...)`` to the first batch (``first_s``: the
  worker process's start-up included), and from the first ``next()`` when the
  program has spent ``--setup-s`` seconds elsewhere after building the feeder
  (``first_after_setup_s``: a training script builds its model there; the worker
  starts at construction, so its start-up overlaps that);
* CPU ms per image after the first batch, of this process and the worker.

    python bench/experiments/isolation_ab.py DATA [--rounds 5] [--epochs 3] [--batch-size 64]
        [--settings thread,fork,spawn]
    python bench/experiments/isolation_ab.py --make /tmp/isoab 2000   # write a synthetic set first

Settings: ``thread``, and ``fork`` / ``spawn`` / ``forkserver`` / ``auto`` for
``isolation="process"`` with that start method. Prints the medians per setting,
the first batch of each as a ratio to the thread engine's, and the median over
rounds of images/s against the thread engine measured in the same round (the
machine's drift cancels in the ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, resource, sys, time
from feeder import Feeder, ImageFolder, ops
root, epochs, batch, decode, setting, setup_s = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                                 sys.argv[4], sys.argv[5], float(sys.argv[6]))
decode = decode if decode == "auto" else int(decode)
options = ({"isolation": "thread"} if setting == "thread"
           else {"isolation": "process", "start_method": setting})
TICK = os.sysconf("SC_CLK_TCK")

def cpu(f):
    # This process and the feeder's worker process (read live from /proc).
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    process = getattr(f._engine, "process", None)
    if process is not None:
        with open(f"/proc/{process.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total

if __name__ == "__main__":
    src = ImageFolder(root)
    t_build = time.perf_counter()
    f = Feeder(src, batch, [ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()], seed=0,
               decode_threads=decode, **options)
    if setup_s:
        time.sleep(setup_s)  # the training script's own set-up (model, optimizer)
    t0 = time.perf_counter()
    first = cpu0 = None
    n = 0
    for epoch in range(epochs):
        f.set_epoch(epoch)
        for x, y in f:
            if first is None:
                # Steady state from here: the worker's start-up is the first batch's.
                first, cpu0 = time.perf_counter(), cpu(f)
            else:
                n += x.shape[0]
    wall = time.perf_counter() - first
    cpu1 = cpu(f)
    f.close()
    print(json.dumps({"img_s": n / wall, "cpu_ms": 1000 * (cpu1 - cpu0) / n,
                      "first_s": first - t_build, "first_after_setup_s": first - t0,
                      "method": f.start_method, "feeder": __import__("feeder").__file__}))
"""


SETTINGS = ("thread", "fork", "spawn", "forkserver", "auto")


def run(args: argparse.Namespace, setting: str, setup_s: float) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, args.data, str(args.epochs),
                          str(args.batch_size), args.decode_threads, setting, str(setup_s)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"{setting} run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", nargs="?")
    p.add_argument("--make", nargs=2, metavar=("DIR", "COUNT"),
                   help="write a synthetic ImageFolder of COUNT JPEGs to DIR and use it")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--decode-threads", default="auto")
    p.add_argument("--settings", default="thread,fork,spawn",
                   help=f"comma-separated, from {SETTINGS}: 'thread', or isolation='process' with "
                        f"that start method")
    p.add_argument("--setup-s", type=float, default=2.0,
                   help="seconds the program spends elsewhere between Feeder() and the first next()")
    args = p.parse_args()
    if args.make:
        from feeder.synthetic import make_image_folder

        root, count = args.make[0], int(args.make[1])
        if not os.path.isdir(root):
            make_image_folder(root, classes=10, per_class=max(1, count // 10))
        args.data = root
    if not args.data:
        p.error("give DATA or --make DIR COUNT")
    settings = tuple(args.settings.split(","))
    bad = [x for x in settings if x not in SETTINGS]
    if bad or "thread" not in settings:
        p.error(f"--settings: a comma-separated list of {SETTINGS} including 'thread', got {args.settings!r}")
    results: dict[str, list[dict]] = {s: [] for s in settings}
    setup: dict[str, list[float]] = {s: [] for s in settings}
    ratios: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
        got = {}
        # Each round in another order (rotated), so no setting always runs first.
        order = settings[r % len(settings):] + settings[:r % len(settings)]
        for setting in order:
            got[setting] = run(args, setting, 0.0)
            results[setting].append(got[setting])
            if args.setup_s:
                setup[setting].append(run(args, setting, args.setup_s)["first_after_setup_s"])
            print(f"round {r + 1} {setting} ({got[setting]['method'] or 'threads'}): "
                  f"{got[setting]['img_s']:.0f} img/s, first batch {got[setting]['first_s']:.3f} s",
                  file=sys.stderr, flush=True)
        for setting in settings:
            ratios[setting].append(got[setting]["img_s"] / got["thread"]["img_s"])
    print(f"data {args.data}; RandomResizedCrop(224) + flip, batch {args.batch_size}, {args.epochs} "
          f"epochs, decode_threads={args.decode_threads}, uint8 on CPU, empty consumer; "
          f"{args.rounds} rounds, order rotated, medians; cores: {os.cpu_count()}")
    print("first batch: from Feeder(...) (cold); and from the first next() after "
          f"{args.setup_s:g} s of other set-up; x: the setting's median / the thread engine's")
    print(f"{'setting':<12}{'img/s':>8}{'vs thread':>11}{'CPU ms/img':>12}{'1st batch s':>13}"
          f"{'x':>7}{f'1st after {args.setup_s:g} s':>17}{'x':>7}")
    first_thread = statistics.median(x["first_s"] for x in results["thread"])
    setup_thread = statistics.median(setup["thread"]) if setup["thread"] else None
    for s in settings:
        rs = results[s]
        name = "thread" if s == "thread" else f"process+{s}"
        first = statistics.median(x["first_s"] for x in rs)
        if setup[s]:
            after = statistics.median(setup[s])
            after_cols = f"{after:>17.3f}{after / setup_thread:>7.2f}"
        else:
            after_cols = f"{'-':>17}{'-':>7}"
        print(f"{name:<12}{statistics.median(x['img_s'] for x in rs):>8.0f}"
              f"{statistics.median(ratios[s]):>11.3f}"
              f"{statistics.median(x['cpu_ms'] for x in rs):>12.2f}"
              f"{first:>13.3f}{first / first_thread:>7.2f}{after_cols}")
    for s in settings:
        if s != "thread":
            print(f"process+{s}/thread images/s, same round: "
                  f"{', '.join(f'{x:.3f}' for x in ratios[s])}")


if __name__ == "__main__":
    main()
