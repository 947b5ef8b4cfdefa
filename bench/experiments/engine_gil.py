"""The CPU each pipeline thread of a whole Feeder spends per sample holding the
GIL, and in calls that let go of it: the engine included (sampler, stage loops,
queues, steps, batch bookkeeping, the transfer thread), not the work alone as
``work_gil.py`` measures it.

Every stage thread's CPU time is read (``time.thread_time``) when it starts and
when it ends; the calls that let go of the GIL (the extension's ``fused`` and ``fused_run``,
``decode``, ``resize`` and file read, cv2's ``resize`` and ``flip``) are timed
apart in the same clock. A thread's CPU less its time in those calls is what
it ran holding the GIL, as an upper bound: each timed call's own wrapper
(a Python frame and two clock reads) and the kernel's work of handing the GIL
over (futex calls) count as held. A GIL profiler's sampling (``gil_profile.py``)
counts a thread descheduled while it holds the GIL, and one that let go of
it while no other took it, as holding it; this does not depend on that.

Figures are over the passes after the first (every file already in the
verified-JPEG memory), per delivered sample, summed over threads of a stage.

    python bench/experiments/engine_gil.py DATA --size 64 --batch-size 256
    python bench/experiments/engine_gil.py DATA --size 224 --batch-size 64

Run it from each source tree (``PYTHONPATH=tree``) to compare two.
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time

import cv2

import feeder
from feeder import Feeder, ImageFolder, ops
from feeder import sources as _sources
from feeder.decode import extension
from feeder.engine import stage as _stage
from feeder.ops import base as _base
from feeder.ops import geometry as _geometry

_free = collections.defaultdict(float)  # thread id -> CPU seconds in calls that let go of the GIL
_calls = collections.Counter()  # thread id -> such calls


def _timed(fn):
    clock, ident = time.thread_time, threading.get_ident

    def call(*args, **kwargs):
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            me = ident()
            _free[me] += clock() - t
            _calls[me] += 1
    return call


class _Proxy:
    """A module with some of its functions timed."""

    def __init__(self, module, names) -> None:
        self._module = module
        for name in names:
            if hasattr(module, name):
                setattr(self, name, _timed(getattr(module, name)))

    def __getattr__(self, name):
        return getattr(self._module, name)


def _system_s() -> float:
    """This thread's system (kernel) CPU seconds so far, from /proc (clock ticks)."""
    try:
        with open("/proc/thread-self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="an ImageFolder of JPEGs")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=4, help="passes; the first is not counted")
    p.add_argument("--decode-threads", type=int, default=2)
    args = p.parse_args()
    assert extension.jpeg is not None, "the region decoder is not built"
    extension.jpeg = _Proxy(extension.jpeg, ["fused", "fused_run", "decode", "resize"])
    if _sources._native_read is not None:
        _sources._native_read = _timed(_sources._native_read)
    _base.cv2 = _Proxy(cv2, ["resize"])
    _geometry.cv2 = _Proxy(cv2, ["flip"])
    from feeder.ops import resize as _resize
    if getattr(_resize, "_native_resize", None) is not None:
        _resize._native_resize = _timed(_resize._native_resize)

    counting = [False]
    # cpu, free, calls, kernel (of cpu: system time, which includes the GIL's hand-offs)
    spent: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0, 0.0])
    lock = threading.Lock()
    run = _stage.Stage._main

    def measured(self, c):
        me = threading.get_ident()
        counted = counting[0]
        _free[me], _calls[me] = 0.0, 0
        t, k = time.thread_time(), _system_s()
        try:
            run(self, c)
        finally:
            cpu, kernel = time.thread_time() - t, _system_s() - k
            if counted:
                with lock:
                    row = spent[self.name]
                    row[0] += cpu
                    row[1] += _free[me]
                    row[2] += _calls[me]
                    row[3] += kernel

    _stage.Stage._main = measured
    src = ImageFolder(args.data)
    samples = 0
    with Feeder(src, args.batch_size, [ops.RandomResizedCrop(args.size), ops.RandomHorizontalFlip()],
                seed=0, shuffle=True, decode_threads=args.decode_threads, augment_threads=0) as f:
        for epoch in range(args.epochs):
            f.set_epoch(epoch)
            counting[0] = epoch > 0
            for x, _ in f:
                samples += x.shape[0] if epoch else 0
    # Threads of the last pass end at close: every counted thread has reported.
    tree = os.path.dirname(os.path.dirname(os.path.abspath(feeder.__file__)))
    print(f"{tree}: {len(src)} files, RandomResizedCrop({args.size}) + flip, batch {args.batch_size}, "
          f"decode_threads={args.decode_threads}, {args.epochs - 1} passes counted ({samples} samples)")
    print(f"{'stage':<10}{'CPU us/sample':>15}{'of it kernel':>14}{'GIL-free us':>13}{'held us':>10}"
          f"{'timed calls':>13}")
    total = [0.0, 0.0, 0.0]
    for name, (cpu, free, calls, kernel) in spent.items():
        total[0] += cpu
        total[1] += free
        total[2] += kernel
        print(f"{name:<10}{1e6 * cpu / samples:>15.1f}{1e6 * kernel / samples:>14.1f}"
              f"{1e6 * free / samples:>13.1f}{1e6 * (cpu - free) / samples:>10.1f}{calls / samples:>13.2f}")
    print(f"{'all':<10}{1e6 * total[0] / samples:>15.1f}{1e6 * total[2] / samples:>14.1f}"
          f"{1e6 * total[1] / samples:>13.1f}{1e6 * (total[0] - total[1]) / samples:>10.1f}")


if __name__ == "__main__":
    main()
