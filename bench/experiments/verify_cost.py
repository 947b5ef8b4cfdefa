"""The cost of storage verification on the remote read path: TarShards over HTTP
(feeder's loopback server in a process of its own, 2 ms per request), every
sample read by range (cache off: the path each check sits on), in 16 threads,
full Feeder pass with decode + RandomResizedCrop, alternating two source trees.

    python bench/experiments/verify_cost.py OLD_TREE NEW_TREE [--rounds 5]

prints img/s per round and the median ratio new/old. Each tree runs in a fresh
interpreter with PYTHONPATH set to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
from feeder import Feeder, ops
from feeder.shards import TarShards
url, n = sys.argv[1], int(sys.argv[2])
src = TarShards(url + "/train-{000000..%06d}.tar" % (n - 1), cache_dir=False)
with Feeder(src, 64, [ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()], seed=0,
            read_threads=16) as f:
    t = time.perf_counter(); k = 0
    for x, y in f:
        k += len(y)
    dt = time.perf_counter() - t
print(json.dumps({"img_s": k / dt}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=1200)
    args = ap.parse_args()
    sys.path.insert(0, args.new)
    from feeder.bench.httpserver import ServerProcess  # noqa: PLC0415
    from feeder.pack import pack, parse_size  # noqa: PLC0415
    from feeder.synthetic import make_image_folder  # noqa: PLC0415

    work = tempfile.mkdtemp(prefix="verify-cost-")
    folder = os.path.join(work, "imgs")
    make_image_folder(folder, classes=10, per_class=args.images // 10, seed=0)
    res = pack(folder, os.path.join(work, "shards"), shard_size=parse_size("4MB"))
    n = len(res.shards)
    results: dict[str, list[float]] = {"old": [], "new": []}
    with ServerProcess(os.path.join(work, "shards"), latency_s=0.002) as srv:
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                tree = getattr(args, name)
                env = {**os.environ, "PYTHONPATH": tree}
                out = subprocess.run([sys.executable, "-c", CHILD, srv.url, str(n)], env=env,
                                     capture_output=True, text=True, timeout=600, check=True)
                v = json.loads(out.stdout.strip().splitlines()[-1])["img_s"]
                results[name].append(v)
                print(f"round {r + 1} {name}: {v:.0f} img/s", flush=True)
    old, new = statistics.median(results["old"]), statistics.median(results["new"])
    ratios = [b / a for a, b in zip(results["old"], results["new"])]
    print(f"median img/s old {old:.0f}, new {new:.0f}; new/old {new / old:.3f} "
          f"(per-round ratios {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
