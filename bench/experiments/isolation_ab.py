"""A/B of ``isolation="thread"`` and ``isolation="process"`` on the same data and settings.

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
    python bench/experiments/isolation_ab.py --make /tmp/isoab 2000   # write a synthetic set first

Prints the medians per setting and the median over rounds of process/thread
measured in the same round (the machine's drift cancels in the ratio).
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
root, epochs, batch, decode, isolation, setup_s = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                                   sys.argv[4], sys.argv[5], float(sys.argv[6]))
decode = decode if decode == "auto" else int(decode)
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
               decode_threads=decode, isolation=isolation)
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
                      "feeder": __import__("feeder").__file__}))
"""


def run(args: argparse.Namespace, isolation: str, setup_s: float) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, args.data, str(args.epochs),
                          str(args.batch_size), args.decode_threads, isolation, str(setup_s)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"{isolation} run failed:\n{out.stderr}")
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
    settings = ("thread", "process")
    results: dict[str, list[dict]] = {s: [] for s in settings}
    setup: dict[str, list[float]] = {s: [] for s in settings}
    ratios = []
    for r in range(args.rounds):
        got = {}
        for isolation in settings if r % 2 == 0 else settings[::-1]:
            got[isolation] = run(args, isolation, 0.0)
            results[isolation].append(got[isolation])
            if args.setup_s:
                setup[isolation].append(run(args, isolation, args.setup_s)["first_after_setup_s"])
            print(f"round {r + 1} {isolation}: {got[isolation]['img_s']:.0f} img/s, first batch "
                  f"{got[isolation]['first_s']:.2f} s", file=sys.stderr, flush=True)
        ratios.append(got["process"]["img_s"] / got["thread"]["img_s"])
    print(f"data {args.data}; RandomResizedCrop(224) + flip, batch {args.batch_size}, {args.epochs} "
          f"epochs, decode_threads={args.decode_threads}, uint8 on CPU, empty consumer; "
          f"{args.rounds} alternating rounds, medians; cores: {os.cpu_count()}")
    print(f"{'isolation':<10}{'img/s':>8}{'CPU ms/img':>12}{'1st batch s':>13}"
          f"{f'1st after {args.setup_s:g} s set-up':>28}")
    for s in settings:
        rs = results[s]
        after = f"{statistics.median(setup[s]):.3f}" if setup[s] else "-"
        print(f"{s:<10}{statistics.median(x['img_s'] for x in rs):>8.0f}"
              f"{statistics.median(x['cpu_ms'] for x in rs):>12.2f}"
              f"{statistics.median(x['first_s'] for x in rs):>13.3f}{after:>28}")
    print(f"process/thread images/s, same round: median {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
