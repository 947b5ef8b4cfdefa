"""What a file's first read costs, against a full decode and a later read, for
two feeder source trees in alternating rounds.

With ``jpeg_verify`` (the default) the first read of a JPEG entropy-decodes
it to its end (every MCU, in one pass: the crop's rows with their IDCT, the
rest without) and records its row index; later reads of the same bytes stop
after the crop's last row and enter its rows at the index's checkpoints.

Each round runs, per tree, one child process that times on one thread (thread
CPU time, meaningful on a shared machine), over every image of ``--files``
with RandomResizedCrop(224) + flip draws:

* ``full``: the full-decode ceiling's work (``feeder-bench ceiling
  --full-decode-too``: the whole image decoded, then the same crop, resize and
  flip), a pass after an untimed one;
* ``first``: the region path's first read of each file (a fresh memory of
  verified files: read to the end, index recorded);
* ``later``: the same files again (the next epoch's draws): stops after the
  crop, enters its rows at the index.

each as decode only and as decode + transform; then, with ``--engine DIR``,
the bench's own one-epoch and three-epoch Feeder runs over DIR
(``python -m feeder.bench.runner``, the ``feeder`` row of ``feeder-bench
compare``): the process CPU per image of the one-epoch run and of epochs 2-3,
and their images/s. Ratios are taken within a round, then their median.

    python bench/experiments/first_read_cost.py --files DATA --engine DATA2K \\
        --tree base=/path/a --tree new=/path/b --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _trees import run_in_tree  # this folder's helper (the scripts run as files)

CHILD = r"""
import json, sys, time
import cv2, numpy as np
import feeder
from feeder import ImageFolder
from feeder.bench.loaders import full_decode_transforms, sample_work, transforms
from feeder.decode import buffer_of
from feeder.sample.rng import sample_key

root = sys.argv[1]
src = ImageFolder(root)
n = len(src)
datas = [src.read(i)[0] for i in range(n)]
out = np.empty((224, 224, 3), np.uint8)
cv2.setNumThreads(1)

def timed(work, epoch):
    dec = total = 0.0
    for i, data in enumerate(datas):
        key = sample_key(0, epoch, i)
        t0 = time.thread_time()
        img, ctx = work.decode(data, key)
        t1 = time.thread_time()
        work.transform(img, key, ctx, out)
        t2 = time.thread_time()
        dec += t1 - t0
        total += t2 - t0
    return 1e3 * dec / n, 1e3 * total / n

full = sample_work(full_decode_transforms(), files=n)
timed(full, 0)  # untimed: as the ceiling, an epoch after the first
res = {"full": timed(full, 0)}
work = sample_work(transforms(), files=n)
res["first"] = timed(work, 0)
res["later"] = timed(work, 1)
print(json.dumps({"feeder": feeder.__file__, "images": n, **res}))
"""


def engine(tree: str, root: str, epochs: int) -> dict:
    """The bench's own Feeder run (``feeder-bench compare``'s feeder row) from ``tree``."""
    spec = {"mode": "loader", "kind": "feeder", "root": root, "batch_size": 64, "epochs": epochs}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        subprocess.run([sys.executable, "-m", "feeder.bench.runner", json.dumps(spec), path],
                       env=dict(os.environ, PYTHONPATH=tree), cwd=tree, check=True, timeout=900,
                       capture_output=True)
        with open(path) as f:
            return json.load(f)


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", required=True, help="ImageFolder timed on one thread")
    p.add_argument("--engine", help="ImageFolder of the Feeder runs (none: no engine rows)")
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH, two or more")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    rows: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for name, path in order:
            before = load()
            got = run_in_tree(path, CHILD, [args.files], timeout=900)
            row = {f"{k} {part}": got[k][j] for k in ("full", "first", "later")
                   for j, part in enumerate(("decode", "sample"))}
            if args.engine:
                one = engine(path, args.engine, 1)
                three = engine(path, args.engine, 3)["extra"]
                row["engine 1 epoch CPU ms/img"] = 1e3 * one["cpu_s"] / one["images"]
                row["engine 1 epoch img/s"] = one["images"] / one["wall_s"]
                span = three["epoch_images"][-1] - three["epoch_images"][0]
                row["engine epochs 2-3 CPU ms/img"] = 1e3 * (three["epoch_cpu_s"][-1]
                                                             - three["epoch_cpu_s"][0]) / span
                row["engine epochs 2-3 img/s"] = span / (three["epoch_end_s"][-1] - three["epoch_end_s"][0])
            row["load"] = f"{before}-{load()}"
            rows[name].append(row)
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    print(f"\nmedians of {args.rounds} rounds, ms of CPU per image (one thread unless 'engine'; "
          f"'sample' = decode + crop/resize/flip)")
    keys = [k for k in rows[trees[0][0]][0] if k != "load"]
    print(f"{'':34s}" + "".join(f"{name:>12s}" for name, _ in trees))
    for k in keys:
        print(f"{k:34s}" + "".join(f"{statistics.median(x[k] for x in rows[name]):12.3f}"
                                    for name, _ in trees))
    print("\nratios within each round (median; per round):")
    for name, _ in trees:
        for what, num, den in (("first read / full decode (decode)", "first decode", "full decode"),
                               ("first read / full decode (sample)", "first sample", "full sample"),
                               ("later read / full decode (sample)", "later sample", "full sample"),
                               ("first read / later read (sample)", "first sample", "later sample"),
                               ("engine 1 epoch / full-decode work (CPU per image)",
                                "engine 1 epoch CPU ms/img", "full sample"),
                               ("engine epochs 2-3 / full-decode work (CPU per image)",
                                "engine epochs 2-3 CPU ms/img", "full sample")):
            if num not in keys:
                continue
            per = [x[num] / x[den] for x in rows[name]]
            print(f"  {name}: {what:54s} {statistics.median(per):.3f} "
                  f"({' '.join(f'{v:.3f}' for v in per)})")
    if len(trees) == 2:
        (a, _), (b, _) = trees
        print(f"\n{b} / {a}, within each round (median; per round):")
        for k in keys:
            per = [y[k] / x[k] for x, y in zip(rows[a], rows[b])]
            print(f"  {k:34s} {statistics.median(per):.3f} ({' '.join(f'{v:.3f}' for v in per)})")


if __name__ == "__main__":
    main()
