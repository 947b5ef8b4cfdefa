"""Where each thread holds the GIL while a loader feeds a launch-bound training thread.

Runs the ``interference`` benchmark's setting in a child process under
``py-spy record --gil --threads`` (py-spy keeps only the samples of the thread
holding the GIL): the training thread runs the proxy step (tiny in-place torch
ops) between batches, pinned to one core, the loader to another. Then it
prints, per thread (siblings merged: ``feeder-decode-0`` and ``-1`` are
``feeder-decode``), the GIL time it held per delivered image, and where that
time went: by the innermost feeder function on the stack (its own code and
everything it calls), and by the leaf function (self time).

    pip install py-spy   # into the same environment, with torch pinned
    python bench/experiments/gil_profile.py DATA --loader feeder --seconds 20
    python bench/experiments/gil_profile.py DATA --loader work-thread   # the work alone, no engine

GIL seconds per image = GIL samples of the thread / rate / images delivered.
py-spy pauses the process for each sample (all threads alike), so shares are
sound while absolute rates run a little below an unprofiled run's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def child(args: argparse.Namespace) -> None:
    import cv2
    import torch

    from feeder.bench.fedloop import ProxyStep, WorkThreads, _cycle, on_cores, split_cores
    from feeder.bench.loaders import Loader

    loop, loader_cores = split_cores(sorted(os.sched_getaffinity(0)), 1, args.threads)
    if loop is not None:
        os.sched_setaffinity(0, loop)
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    step = ProxyStep("cpu", args.ops)
    with on_cores(loader_cores):
        if args.loader == "work-thread":
            wt = WorkThreads(args.data, args.batch_size, args.threads, 4, 0)
            wt.start()
            batches, close = wt.batches(), wt.close
        else:
            ld = Loader("feeder", args.data, args.batch_size, decode_threads=args.threads,
                        augment_threads=0, starting=lambda: on_cores(loader_cores),
                        size=args.size)
            batches, close = _cycle(ld), ld.close
    done: list[tuple[float, int]] = []  # (time.time() after each batch, its images)
    t0 = time.time()
    try:
        while time.time() - t0 < args.warmup:
            step(*next(batches))
        with open(args.ready, "w") as f:  # the parent attaches py-spy now
            f.write(str(os.getpid()))
        while time.time() - t0 < args.warmup + args.seconds + 2:
            x, y = next(batches)
            step(x, y)
            done.append((time.time(), x.shape[0]))
    finally:
        close()
    with open(args.report, "w") as f:
        json.dump({"batches": done}, f)


# A thread's role, from its stack: py-spy caches thread names by thread id, and
# each pass starts new threads that may reuse an old one's id, so names lie.
_ROLES = (("Sampler.work", "sampler"), ("MapStage.work", "decode (map stage)"),
          ("Transfer.work", "transfer"), ("WorkThreads._fill", "work-thread"))
_LOOPS = ("Sampler.work", "MapStage.work", "Transfer.work", "WorkThreads._fill")


def _role(name: str, frames: list[tuple[str, str]]) -> str:
    fns = {fn for fn, _ in frames}
    for fn, role in _ROLES:
        if fn in fns:
            return role
    if any(file.endswith(("engine/reaper.py", "_reaper.py")) for _, file in frames):
        return "reaper"
    return "training thread" if name == "MainThread" else f"other ({name})"


def parse(raw_path: str) -> dict[str, list[tuple[list[tuple[str, str]], int]]]:
    """py-spy raw output -> {thread role: [(frames outermost first as (function, file), count)]}."""
    threads: dict[str, list] = collections.defaultdict(list)
    with open(raw_path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, count = line.rsplit(" ", 1)
            parts = stack.split(";")
            name = parts[0].split(": ", 1)[-1] if parts[0].startswith("thread") else parts[0]
            frames = []
            for p in parts[1:]:
                m = _FRAME.match(p)
                frames.append((m["fn"], m["file"]) if m else (p, ""))
            threads[_role(name, frames)].append((frames, int(count)))
    return threads


def _is_feeder(file: str) -> bool:
    return (file.startswith("feeder/") or "/feeder/" in file) and "bench/" not in file


def _module(frames: list[tuple[str, str]]) -> str:
    """The feeder module of the innermost feeder frame (what it calls included)."""
    for _, file in reversed(frames):
        if _is_feeder(file):
            return "feeder/" + file.rsplit("feeder/", 1)[1]
    return "(outside feeder)"


def _callee(frames: list[tuple[str, str]]) -> str:
    """The function the thread's loop called (its own code: ``<loop> (self)``)."""
    for k, (fn, _) in enumerate(frames):
        if fn in _LOOPS:
            if k + 1 == len(frames):
                return f"{fn} (self)"
            callee = frames[k + 1][0]
            # One level deeper for the map steps, so read/decode/augment's own parts show.
            if callee.startswith("steps.<locals>.") and k + 2 < len(frames):
                return f"{callee} > {frames[k + 2][0]}"
            return callee
    return "(outside a stage loop)"


# The per-sample work itself (what any loader must do): a stack through one of these.
_WORK = {"SampleWork.decode", "SampleWork.transform", "SampleWork.__call__", "FileList.read",
         "ImageFolder.read", "sample_key"}


def _is_work(frames: list[tuple[str, str]]) -> bool:
    return any(fn in _WORK for fn, _ in frames)


def _leaf(frames: list[tuple[str, str]]) -> str:
    if not frames:
        return "(no frame)"
    fn, file = frames[-1]
    return f"{fn} ({os.path.basename(file)})" if file else fn


def summarize(threads, rate: float, images: int, seconds: float, top: int) -> str:
    lines = []
    total = sum(c for stacks in threads.values() for _, c in stacks)
    lines.append(f"GIL samples: {total} at {rate:g} Hz over {seconds:.1f} s "
                 f"({total / rate / seconds:.0%} of the time some thread held it); "
                 f"{images} images delivered")
    lines.append(f"{'thread':<22}{'GIL s':>8}{'us/image':>10}{'share':>8}{'work us/img':>13}"
                 f"{'engine us/img':>15}")
    order = sorted(threads, key=lambda t: -sum(c for _, c in threads[t]))
    per_image = 1e6 / rate / max(images, 1)
    for t in order:
        n = sum(c for _, c in threads[t])
        work = sum(c for frames, c in threads[t] if _is_work(frames))
        lines.append(f"{t:<22}{n / rate:>8.2f}{n * per_image:>10.1f}{n / total:>8.0%}"
                     f"{work * per_image:>13.1f}{(n - work) * per_image:>15.1f}")
    lines.append("(work: stacks through the per-sample work itself, read + decode + transforms + "
                 "keys; engine: the rest of the thread's GIL time)")
    for t in order:
        stacks = threads[t]
        n = sum(c for _, c in stacks)
        if n / total < 0.01:
            continue
        for title, key in (("by the function the loop called (inclusive)", _callee),
                           ("by the innermost feeder module (inclusive)", _module),
                           ("by leaf function (self)", _leaf)):
            agg: collections.Counter = collections.Counter()
            for frames, c in stacks:
                agg[key(frames)] += c
            lines.append("")
            lines.append(f"{t}: {title}, us/image")
            for name, c in agg.most_common(top):
                lines.append(f"  {1e6 * c / rate / max(images, 1):8.1f}  {c / n:5.1%}  {name}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("--loader", choices=("feeder", "work-thread"), default="feeder")
    p.add_argument("--threads", type=int, default=1, help="decode threads (default 1, on one core)")
    p.add_argument("--seconds", type=float, default=20.0, help="profiled seconds")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds run before profiling")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop's output side")
    p.add_argument("--ops", type=int, default=400, help="tiny ops per proxy step")
    p.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--keep", help="also save py-spy's raw output here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--ready", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    with tempfile.TemporaryDirectory(prefix="gil-profile-") as tmp:
        raw, rep, ready = (os.path.join(tmp, n) for n in ("raw.txt", "report.json", "ready"))
        child_cmd = [sys.executable, os.path.abspath(__file__), args.data, "--child", "--report", rep,
                     "--ready", ready, "--loader", args.loader, "--threads", str(args.threads),
                     "--seconds", str(args.seconds), "--warmup", str(args.warmup),
                     "--batch-size", str(args.batch_size), "--ops", str(args.ops),
                     "--size", str(args.size)]
        proc = subprocess.Popen(child_cmd)
        try:
            deadline = time.time() + 300
            while not os.path.exists(ready):  # start-up and imports stay out of the profile
                if proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"the profiled child exited or never got ready ({proc.returncode})")
                time.sleep(0.1)
            cmd = [spy, "record", "--gil", "--threads", "-r", str(args.rate), "-f", "raw", "-o", raw,
                   "-d", str(int(args.seconds)), "--pid", str(proc.pid)]
            if args.native:
                cmd.append("--native")
            t0 = time.time()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=args.seconds + 120)
            t1 = time.time()
            proc.wait(timeout=args.seconds + 120)
        finally:
            if proc.poll() is None:
                proc.kill()
        with open(rep) as f:
            got = json.load(f)
        if args.keep:
            shutil.copy(raw, args.keep)
        images = sum(n for t, n in got["batches"] if t0 <= t <= t1)
        steps = sum(1 for t, _ in got["batches"] if t0 <= t <= t1)
        print(f"{args.loader}, RandomResizedCrop({args.size}) + flip, {args.threads} thread(s), "
              f"batch {args.batch_size}, proxy step of "
              f"{args.ops} ops between batches; {steps} steps profiled")
        print(summarize(parse(raw), args.rate, images, t1 - t0, args.top))


if __name__ == "__main__":
    main()
