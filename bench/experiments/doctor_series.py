"""The doctor run again and again on one set-up: does it give one verdict and one fix?

Runs ``feeder-doctor DATA --model MODEL`` ``--runs`` times in a row, each a
fresh process writing its report under ``--work``, optionally beside a CPU hog
(``--hog N``: N processes of pure-Python work, started before the first run and
stopped after the last: "another CPU-heavy process running"). Prints one line a
run (the load average before and after, the verdict, the first fix or thing to
try) and then how many runs gave each verdict and each first advice.

The model the series was made for is a small CPU network, whose step and the
loader compete for the same cores (``bench/experiments/doctor_model.py``)::

    cd bench/experiments && PYTHONPATH=../.. python doctor_series.py DATA \\
        --model doctor_model:train_step --runs 10 [--hog 1] [--out FILE]

The feeder-doctor command runs in this folder, so ``doctor_model`` imports
from it as any ``MODULE:NAME`` from the current folder.

``--replay WORK`` runs nothing: it decides again, with this tree's
:func:`feeder.doctor.decide`, on the measurements each run of an earlier
series recorded (``WORK/run*/doctor.json``), and counts those verdicts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HOG = "while True:\n    sum(i * i for i in range(10000))\n"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def advice(verdict: dict) -> str:
    """The verdict's first fix, else its first thing to try, with its numbers
    taken out (the advice, not the figures measured in that run)."""
    first = (verdict.get("fixes") or verdict.get("tries") or ["(none)"])[0]
    first = first.split(":")[0]  # "split the cores: ..." -> "split the cores"
    return re.sub(r"\d+(\.\d+)?", "N", first)


def replay(work: str) -> None:
    from feeder.doctor.verdict import Measurements, decide

    verdicts: collections.Counter = collections.Counter()
    advices: collections.Counter = collections.Counter()
    runs = sorted((d for d in os.listdir(work) if re.fullmatch(r"run\d+", d)), key=lambda d: int(d[3:]))
    for run in runs:
        v = vars(decide(Measurements.load(os.path.join(work, run, "doctor.json"))))
        verdicts[v["bottleneck"]] += 1
        advices[advice(v)] += 1
        print(f"{run}: {v['bottleneck']} | {advice(v)}")
    print(f"verdicts: {dict(verdicts)}\nfirst advice: {dict(advices)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--model", default="doctor_model:train_step")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--hog", type=int, default=0, help="CPU-bound processes beside the runs")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--work", default=None, help="folder for each run's report")
    p.add_argument("--out", default=None, help="also write the summary here")
    p.add_argument("--replay", default=None, metavar="WORK",
                   help="decide again on an earlier series' recorded runs")
    args = p.parse_args()
    if args.replay:
        replay(args.replay)
        return
    work = args.work or tempfile.mkdtemp(prefix="doctor-series-")
    doctor = [sys.executable, "-m", "feeder.doctor"]
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hog)]
    lines = [f"feeder-doctor {args.data} --model {args.model} --batch-size {args.batch_size} "
             f"--seconds {args.seconds:g}, {args.runs} runs in a row"
             + (f", beside {args.hog} CPU-bound process(es) of pure Python" if args.hog else
                ", nothing else started"),
             f"command: {' '.join(sys.argv)}",
             f"started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
             f"{os.cpu_count()} cores"]
    print("\n".join(lines), flush=True)
    verdicts: collections.Counter = collections.Counter()
    advices: collections.Counter = collections.Counter()
    try:
        for k in range(1, args.runs + 1):
            out = os.path.join(work, f"run{k}")
            before = loadavg()
            t0 = time.monotonic()
            res = subprocess.run(doctor + [args.data, "--model", args.model, "--batch-size",
                                           str(args.batch_size), "--seconds", str(args.seconds),
                                           "-q", "--out", out],
                                 capture_output=True, text=True, timeout=3600)
            took = time.monotonic() - t0
            if res.returncode:
                line = f"run {k}: failed ({res.returncode}): {res.stderr.strip()[-300:]}"
            else:
                with open(os.path.join(out, "doctor.json")) as f:
                    doc = json.load(f)
                v, m = doc["verdict"], doc["measurements"]
                verdicts[v["bottleneck"]] += 1
                advices[advice(v)] += 1
                extra = [n for n in m.get("notes", []) if "more were run" in n]
                line = (f"run {k}: load {before} -> {loadavg()}, {took:.0f} s, other processes "
                        f"{m.get('other_cores_run') or 0:.2f} cores: {v['bottleneck']} | "
                        f"{advice(v)}" + (f" ({extra[0].split(': ')[-1]})" if extra else ""))
            lines.append(line)
            print(line, flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    summary = [f"verdicts: {dict(verdicts)}", f"first advice: {dict(advices)}",
               f"reports: {work}"]
    lines += summary
    print("\n".join(summary))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
