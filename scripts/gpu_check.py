"""The GPU acceptance check of the CUDA transfer path (run by ``scripts/gpu-check``).

CI has no GPU, so the CUDA-only logic is checked there against a faked
``torch.cuda`` (``tests/test_cuda_logic.py``); this script checks the same
risks on a real GPU, once, and prints one table row per check:

* ``gpu suite``: ``pytest tests/cuda``.
* ``copy slowed on the side stream``: every copy delayed with ``torch.cuda._sleep`` queued ahead of
  it on the side stream, two batch buffers (``num_buffers=2``): a buffer reused
  before its copy finished would change the bytes; batches are compared byte
  for byte with the CPU path's.
* ``transfer CPU / wall``: the transfer thread's CPU time against its busy (wall)
  time over the slowed pass, where it waits for every copy: a spinning wait
  would make them equal; the target is below 10%.
* ``set_device after build``: a feeder built before ``set_device(1)`` delivers
  on GPU 1, and no CUDA context is created on GPU 0 (needs two GPUs).
* ``teardown while the side stream is busy``: close and garbage collection while the side stream is
  busy (thread and isolated engine): no error, every registered array
  unregistered, pinned host memory back to where it was.
* ``40 passes against a user stream``: 40 passes consumed on a user stream that lags behind
  (values against the CPU path; one side stream throughout).
* ``exit mid-epoch``: a script leaving mid-epoch with copies in flight exits
  with code 0 and prints no error.

Exit status: 0 when nothing failed, 1 otherwise, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import simplejpeg  # noqa: E402
import torch  # noqa: E402

from feeder import Feeder, ops  # noqa: E402
from feeder.engine import transfer as _transfer
from feeder.synthetic import make_image  # noqa: E402

SPIN = 20_000_000  # GPU clock cycles for torch.cuda._sleep: milliseconds per batch
CPU_TARGET = 0.10  # transfer thread CPU / busy time
SUBPROCESS_S = 300


class MemorySource:
    """In-memory JPEGs labelled by index (module level: spawned workers import it)."""

    def __init__(self, n: int, size: int = 64, seed: int = 0) -> None:
        self.blobs = [simplejpeg.encode_jpeg(np.ascontiguousarray(make_image(size, size + 8, seed + i)),
                                             quality=90, colorspace="RGB") for i in range(n)]

    def __len__(self) -> int:
        return len(self.blobs)

    def read(self, index: int):
        return self.blobs[index], index


AUG = [ops.RandomResizedCrop(48), ops.RandomHorizontalFlip()]


def make(source, **kw) -> Feeder:
    """A feeder for the checks; ``num_buffers=N`` caps the thread engine's buffer pool
    at N (the pool only grows past that to avoid a deadlock, which stats().buffers shows)."""
    kw.setdefault("seed", 3)
    kw.setdefault("decode_threads", 4)
    kw.setdefault("timeout", 120)
    cap = kw.pop("num_buffers", None)
    f = Feeder(source, kw.pop("batch_size", 16), AUG, **kw)
    if cap is not None and kw.get("isolation", "thread") == "thread":
        f._engine.pool.capacity = cap
    return f


@contextlib.contextmanager
def slowed_copies(cycles: int = SPIN):
    """Queue ``torch.cuda._sleep(cycles)`` on the side stream ahead of every copy."""
    real = _transfer.SideStream.copying

    @contextlib.contextmanager
    def copying(self):
        with real(self):
            torch.cuda._sleep(cycles)  # the current stream is the side stream here
            yield
    _transfer.SideStream.copying = copying
    try:
        yield
    finally:
        _transfer.SideStream.copying = real


def to_host(batches):
    return [(x.cpu().clone(), y.cpu().clone()) for x, y in batches]


def identical(a, b) -> str:
    """'' when the two lists of (images, labels) are byte for byte equal, else where not."""
    if len(a) != len(b):
        return f"{len(a)} batches against {len(b)}"
    for i, ((xa, ya), (xb, yb)) in enumerate(zip(a, b)):
        if xa.dtype != xb.dtype or xa.shape != xb.shape or not torch.equal(xa, xb):
            return f"batch {i}: images differ"
        if not torch.equal(ya, yb):
            return f"batch {i}: labels differ"
    return ""


def run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts"),
                                                      os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=SUBPROCESS_S)


def error_lines(stderr: str) -> list[str]:
    words = ("Traceback", "CUDA error", "Exception ignored", "Error", "error:")
    return [line for line in stderr.splitlines() if any(w in line for w in words)]


# -- the checks: each returns (status, detail) ---------------------------------------
def check_suite(args):
    cmd = [sys.executable, "-m", "pytest", "tests/cuda", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else result.stderr.strip()[-200:]
    if args.verbose or result.returncode:
        print(result.stdout[-6000:], result.stderr[-3000:], sep="\n", file=sys.stderr)
    return ("PASS" if result.returncode == 0 else "FAIL"), summary


def check_slowed_copy(args, shared):
    source = MemorySource(96)
    with make(source, device="cpu", shuffle=True) as cpu:
        cpu.set_epoch(1)
        expect = to_host(cpu)
    with slowed_copies():
        with make(source, device="cuda", num_buffers=2, queue_size=1, shuffle=True) as gpu:
            gpu.set_epoch(0)
            for _ in gpu:  # warm-up pass: CUDA context, kernels loaded
                pass
            before = gpu.stats().stage("transfer")
            gpu.set_epoch(1)
            got = []
            for x, y in gpu:
                assert x.is_cuda and x.dtype == torch.uint8
                got.append((x.cpu().clone(), y.cpu().clone()))
            after = gpu.stats().stage("transfer")
            buffers = gpu.stats().buffers
    shared["transfer"] = (after.cpu_s - before.cpu_s, after.busy_s - before.busy_s,
                          after.items - before.items)
    diff = identical(expect, got)
    if diff:
        return "FAIL", diff
    return "PASS", f"{len(got)} batches identical to the CPU path, {buffers} buffers"


def check_transfer_cpu(args, shared):
    if "transfer" not in shared:
        return "SKIP", "needs the slowed-copy check"
    cpu_s, busy_s, items = shared["transfer"]
    ratio = cpu_s / busy_s if busy_s > 0 else float("nan")
    detail = (f"CPU {cpu_s:.3f} s / busy {busy_s:.3f} s = {100 * ratio:.1f}% over {items} batches "
              f"({1e3 * cpu_s / max(items, 1):.2f} ms CPU per batch); target < {100 * CPU_TARGET:.0f}%")
    return ("PASS" if ratio < CPU_TARGET else "FAIL"), detail


def check_set_device_after_build(args):
    if torch.cuda.device_count() < 2:
        return "SKIP", f"{torch.cuda.device_count()} GPU: needs two"
    code = """
        import torch
        from gpu_check import MemorySource, make
        src = MemorySource(48)
        has_ctx = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        for isolation in ("thread", "process"):
            f = make(src, device="cuda", isolation=isolation)   # built first ...
            torch.cuda.set_device(1)                             # ... the rank's device after
            devices = set()
            for x, y in f:
                devices |= {str(x.device), str(y.device)}
            f.close()
            assert devices == {"cuda:1"}, (isolation, devices)
        print("ctx0", None if has_ctx is None else bool(has_ctx(0)))
    """
    result = run_python(code)
    if result.returncode != 0:
        return "FAIL", (error_lines(result.stderr) or [result.stderr.strip()[-300:]])[-1]
    ctx0 = result.stdout.split("ctx0")[-1].strip()
    if ctx0 == "True":
        return "FAIL", "batches on cuda:1, but a CUDA context was created on GPU 0"
    what = "no context on GPU 0" if ctx0 == "False" else "GPU 0 context not checkable"
    return "PASS", f"thread and isolated engine deliver on cuda:1; {what}"


def check_busy_teardown(args):
    stats = getattr(torch.cuda, "host_memory_stats", None)
    gc.collect()
    empty = getattr(getattr(torch, "accelerator", None), "memory", None)
    if empty is not None:
        empty.empty_host_cache()
    base = stats()["allocated_bytes.current"] if stats else None
    source = MemorySource(64)
    notes = []
    for isolation in ("thread", "process"):
        with slowed_copies(SPIN * 10):  # the side stream is busy for a long while
            f = make(source, device="cuda", isolation=isolation, num_buffers=2)
            it = iter(f)
            next(it)
            engine = f._engine
            t0 = time.perf_counter()
            f.close()
            took = time.perf_counter() - t0
            if isolation == "process" and engine._registered:
                return "FAIL", f"{len(engine._registered)} arrays still registered after close()"
            notes.append(f"{isolation} close {took:.2f} s")
            # Collected instead of closed, mid-epoch, with copies in flight.
            g = make(source, device="cuda", isolation=isolation, num_buffers=2)
            it2 = iter(g)
            next(it2)
            del it, it2, g, f, engine
            gc.collect()
            from feeder.engine import reaper as _reaper
            import threading
            done = threading.Event()
            _reaper.defer(done.set)
            if not done.wait(60):
                return "FAIL", "the collected feeder's clean-up did not run"
    torch.cuda.synchronize()  # a copy that faulted on unregistered memory would raise here
    if stats:
        gc.collect()
        left = stats()["allocated_bytes.current"] - base
        notes.append(f"pinned host bytes left {left}")
        if left > 0:
            return "FAIL", "; ".join(notes)
    return "PASS", "; ".join(notes)


def check_user_stream(args):
    source = MemorySource(64, size=48)
    user = torch.cuda.Stream()
    bad = []
    with make(source, device="cpu", batch_size=8) as cpu, \
            make(source, device="cuda", batch_size=8, dtype=torch.float32) as gpu:
        for epoch in range(40):
            cpu.set_epoch(epoch)
            expect = [x.to(torch.float64).sum().item() / 255.0 for x, _ in cpu]
            gpu.set_epoch(epoch)
            sums = []
            with torch.cuda.stream(user):
                for x, _ in gpu:
                    torch.cuda._sleep(SPIN // 4)  # the user stream lags behind the side stream
                    sums.append(x.double().sum())
                    del x
            user.synchronize()
            got = [s.item() for s in sums]
            if len(got) != len(expect) or not np.allclose(got, expect, rtol=1e-6):
                bad.append(epoch)
        streams = list(gpu._engine.side._streams.values())
    if bad:
        return "FAIL", f"values differ from the CPU path in passes {bad}"
    if len(streams) != 1 or streams[0].cuda_stream in (user.cuda_stream,
                                                       torch.cuda.default_stream().cuda_stream):
        return "FAIL", f"side streams: {streams}"
    return "PASS", f"40 passes equal to the CPU path; one side stream, priority {streams[0].priority}"


def check_exit_mid_epoch(args):
    notes = []
    for isolation in ("thread", "process"):
        for ending in ("exit", "gc then exit"):
            code = f"""
                import gc, torch
                from gpu_check import MemorySource, make, slowed_copies
                with slowed_copies({SPIN * 5}):
                    f = make(MemorySource(64), device="cuda", isolation={isolation!r})
                    it = iter(f)
                    next(it); next(it)
                    if {ending == "gc then exit"}:
                        del it, f
                        gc.collect()
                    print("leaving mid-epoch", flush=True)
            """
            result = run_python(code)
            errors = error_lines(result.stderr)
            if result.returncode != 0 or errors or "leaving mid-epoch" not in result.stdout:
                return "FAIL", (f"{isolation}, {ending}: exit code {result.returncode}; "
                                f"{(errors or [result.stderr.strip()[-300:]])[-1]}")
            notes.append(f"{isolation}/{ending}")
    return "PASS", "exit code 0, no error printed: " + ", ".join(notes)


CHECKS = [
    ("gpu suite (pytest tests/cuda)", check_suite, False),
    ("copy slowed on the side stream", check_slowed_copy, True),
    ("transfer CPU / wall", check_transfer_cpu, True),
    ("set_device after build", check_set_device_after_build, False),
    ("teardown while the side stream is busy", check_busy_teardown, False),
    ("40 passes against a user stream", check_user_stream, False),
    ("exit mid-epoch", check_exit_mid_epoch, False),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-suite", action="store_true", help="leave out pytest tests/cuda")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the suite's output")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: torch.cuda.is_available() is False; this check is for a CUDA machine",
              file=sys.stderr)
        return 2
    print(f"gpu-check: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    shared: dict = {}
    rows = []
    for name, check, needs_shared in CHECKS:
        if name.startswith("gpu suite") and args.skip_suite:
            rows.append((name, "SKIP", "--skip-suite", 0.0))
            continue
        t0 = time.perf_counter()
        try:
            status, detail = check(args, shared) if needs_shared else check(args)
        except Exception as exc:  # noqa: BLE001 - a check that raises has failed
            traceback.print_exc()
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
        rows.append((name, status, detail, time.perf_counter() - t0))
        print(f"  {status:<5} {name} ({rows[-1][3]:.1f} s)", flush=True)
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'check':<{width}}  {'result':<6}  {'s':>6}  detail")
    for name, status, detail, seconds in rows:
        print(f"{name:<{width}}  {status:<6}  {seconds:>6.1f}  {detail}")
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
