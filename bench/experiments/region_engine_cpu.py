"""CPU per image of the engine running the region decode, against the bare
per-sample work on one thread, for two feeder source trees in alternating rounds.

Each round runs, per tree, one fresh child process that first times the bare
work (read + ``SampleWork.decode`` + ``SampleWork.transform`` into one output
array, one thread, OpenCV on one thread: the ``ceiling region work`` row of
``feeder-bench region-decode``; best of the passes, in thread CPU time) and then
a Feeder (RandomResizedCrop(224) + flip, batch 64, threads "auto") over the same
set: its process CPU per image over a warm-up pass plus ``--epochs`` passes, the
thread CPU spent inside each engine step (read, decode, augment; the rest is the
engine's own: queues, sampler, collation, the training loop's side) and the
voluntary context switches per image (threads blocking on the GIL or a queue).
CPU time, unlike wall time, stays meaningful on a machine shared with other work
(though cache contention still inflates it), and engine / bare is taken within
one child.

    python bench/experiments/region_engine_cpu.py DATA --tree base=/path/a --tree new=/path/b
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _trees import run_in_tree  # this folder's helper (the scripts run as files)

CHILD = r"""
import json, os, resource, sys, threading, time
import cv2, numpy as np
import feeder, feeder.engine.pipeline as pipeline, feeder.engine.steps as work_mod
from feeder import Feeder, ImageFolder
from feeder.sample.rng import sample_key
from feeder.bench.loaders import sample_work, transforms

root, epochs = sys.argv[1], int(sys.argv[2])
src = ImageFolder(root)
n = len(src)
work = sample_work(transforms())
out = np.empty((224, 224, 3), np.uint8)
saved = cv2.getNumThreads()
cv2.setNumThreads(1)
for i in range(n):
    src.read(i)
bare = 1e9
for r in range(epochs):
    t = time.thread_time()
    for i in range(n):
        data, _ = src.read(i)
        key = sample_key(0, r, i)
        img, ctx = work.decode(data, key)
        work.transform(img, key, ctx, out)
    bare = min(bare, (time.thread_time() - t) / n)
cv2.setNumThreads(saved)

spent = {"read": 0.0, "decode": 0.0, "augment": 0.0}
lock = threading.Lock()
steps = work_mod.steps

def timed_steps(*a, **k):
    wrapped = []
    for st in steps(*a, **k):
        def fn(task, fn=st.fn, name=st.name):
            t = time.thread_time()
            try:
                return fn(task)
            finally:
                d = time.thread_time() - t
                with lock:
                    spent[name] += d
        wrapped.append(type(st)(st.name, fn))
    return tuple(wrapped)

pipeline.steps = timed_steps
with Feeder(src, 64, transforms(), seed=0) as f:
    for x, y in f:  # warm-up pass
        pass
    for k in spent:
        spent[k] = 0.0
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    c0, t0, images = time.process_time(), time.perf_counter(), 0
    for e in range(1, epochs + 1):
        f.set_epoch(e)
        for x, y in f:
            images += x.shape[0]
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"feeder": feeder.__file__, "bare_ms": bare * 1e3, "engine_ms": cpu * 1e3 / images,
                  "steps_ms": {k: v * 1e3 / images for k, v in spent.items()},
                  "vcsw": (r1.ru_nvcsw - r0.ru_nvcsw) / images, "img_s": images / wall,
                  "cores": cpu / wall}))
"""


def run(tree: str, data: str, epochs: int) -> dict:
    return run_in_tree(tree, CHILD, [data, str(epochs)], timeout=900)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH (one or more)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    results: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        for name, path in (trees if r % 2 == 0 else trees[::-1]):
            got = run(os.path.abspath(path), args.data, args.epochs)
            results[name].append(got)
            print(f"round {r + 1} {name}: bare {got['bare_ms']:.3f} engine {got['engine_ms']:.3f} ms/img, "
                  f"{got['cores']:.2f} cores", file=sys.stderr, flush=True)
    print(f"{args.data}: RandomResizedCrop(224) + flip, batch 64, threads auto; {args.rounds} rounds, "
          f"trees alternating; medians over rounds; CPU ms per image")
    print(f"{'tree':<8}{'bare':>7}{'engine':>8}{'engine/bare':>13}{'read':>7}{'decode':>8}{'augment':>9}"
          f"{'outside steps':>15}{'vcsw/img':>10}{'img/s':>7}{'cores':>7}")
    for name, _ in trees:
        rs = results[name]

        def med(fn):
            return statistics.median(fn(x) for x in rs)

        print(f"{name:<8}{med(lambda x: x['bare_ms']):>7.3f}{med(lambda x: x['engine_ms']):>8.3f}"
              f"{med(lambda x: x['engine_ms'] / x['bare_ms']):>13.3f}"
              f"{med(lambda x: x['steps_ms']['read']):>7.3f}{med(lambda x: x['steps_ms']['decode']):>8.3f}"
              f"{med(lambda x: x['steps_ms']['augment']):>9.3f}"
              f"{med(lambda x: x['engine_ms'] - sum(x['steps_ms'].values())):>15.3f}"
              f"{med(lambda x: x['vcsw']):>10.2f}{med(lambda x: x['img_s']):>7.0f}{med(lambda x: x['cores']):>7.2f}")


if __name__ == "__main__":
    main()
