"""Two builds of the region decoder (``feeder.decode._jpeg``) on the same calls.

Records the extension calls the region path makes on a set of images (the
crops RandomResizedCrop(224) + flip draws, or the evaluation transform's with
``--eval``) in two epochs: the first reads (each file read to its end, its
index recorded) and the later ones (the next epoch's crops, entered at the
index); then times each build on exactly those calls, alternating, one
thread, and checks that both write the same bytes and return the same (index
included). For a change to
``feeder/decode/_jpeg.c``: build it to another file and compare it with the
installed one.

    cp feeder/decode/_jpeg.*.so /tmp/before.so
    # edit feeder/decode/_jpeg.c, then: python setup.py build_ext --inplace
    cp feeder/decode/_jpeg.*.so /tmp/after.so   # each build a copy outside the tree: a build at
    python bench/experiments/region_ext_ab.py DATA /tmp/before.so /tmp/after.so  # the installed path is the module already loaded
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from typing import Any

import numpy as np

from feeder import ImageFolder
from feeder.bench.ceiling import timed_indices
from feeder.bench.loaders import eval_transforms, transforms
from feeder.engine.steps import SampleWork
from feeder import decode as _decode
from feeder.ops.chain import Chain
from feeder.sample.rng import sample_key


def load(path: str) -> Any:
    """The extension module built at ``path`` (each path its own module object)."""
    spec = importlib.util.spec_from_file_location("feeder.decode._jpeg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("a", help="the first build (.so)")
    p.add_argument("b", help="the second build (.so)")
    p.add_argument("--limit", type=int, default=300, help="images (default 300)")
    p.add_argument("--rounds", type=int, default=7, help="alternating timings, median kept (default 7)")
    p.add_argument("--eval", action="store_true", help="the evaluation transform's regions")
    args = p.parse_args()
    builds = load(args.a), load(args.b)
    real = _decode._jpeg
    if real is None:
        raise SystemExit(f"the region decoder is not in use: {_decode._jpeg_missing}")
    source = ImageFolder(args.dir)
    datas = [source.read(i)[0] for i in timed_indices(len(source), args.limit)]
    calls: list[tuple] = []

    class Recorder:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def decode(data, top, left, height, width, denom, buf, max_pixels, *rest, **kw):
            calls.append((data, top, left, height, width, denom, max_pixels, rest, kw))
            return real.decode(data, top, left, height, width, denom, buf, max_pixels, *rest, **kw)

    work = SampleWork(Chain(eval_transforms() if args.eval else transforms(), None), files=len(datas))
    h, w = work.image_size
    out = np.empty((h, w, 3), np.uint8)
    epochs: list[list[tuple]] = []
    work.jpeg.ext = Recorder()
    try:
        for epoch in (0, 1):
            calls = []
            for i, d in enumerate(datas):
                key = sample_key(0, epoch, i)
                img, ctx = work.decode(d, key)
                work.transform(img, key, ctx, out)
            epochs.append(calls)
    finally:
        work.jpeg.ext = real
    pad = real.PAD
    size = max(c[3] * (c[4] + 2 * pad + 32) * 3 for c in epochs[0] + epochs[1])
    buf = np.empty(size, np.uint8)

    def timed(module: Any, calls: list[tuple]) -> float:
        t = time.thread_time()
        for data, top, left, height, width, denom, mp, rest, kw in calls:
            module.decode(data, top, left, height, width, denom, buf, mp, *rest, **kw)
        return (time.thread_time() - t) / len(calls) * 1e3

    for what, calls in zip(("first reads", "later reads"), epochs):
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(args.rounds):
            for k, module in enumerate(builds):
                times[k].append(timed(module, calls))
        one, two = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
        same = True
        for data, top, left, height, width, denom, mp, rest, kw in calls:
            one[:] = 0
            two[:] = 0
            same &= (builds[0].decode(data, top, left, height, width, denom, one, mp, *rest, **kw)
                     == builds[1].decode(data, top, left, height, width, denom, two, mp, *rest, **kw))
            same &= bool(np.array_equal(one, two))
        a, b = statistics.median(times[0]), statistics.median(times[1])
        ratios = [y / x for x, y in zip(*times)]
        print(f"{args.dir}, {what}: {len(calls)} region decodes, median of {args.rounds} alternating passes, "
              f"one thread: a {a:.3f} ms, b {b:.3f} ms per decode, b/a {b / a:.3f} (per pass "
              f"{statistics.median(ratios):.3f}: {' '.join(f'{r:.3f}' for r in ratios)}); same output: {same}")


if __name__ == "__main__":
    main()
