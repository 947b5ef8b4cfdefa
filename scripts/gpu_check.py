"""The GPU acceptance check of the CUDA transfer path (run by ``scripts/gpu-check``).

CI has no GPU, so the CUDA-only logic is checked there against a faked
``torch.cuda`` (``tests/engine/test_cuda_logic.py``); this script checks the same
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
* ``synchronisation audit``: ``torch.cuda.set_sync_debug_mode("warn")`` over
  steady-state passes of uint8 pairs, normalized fp16, MixUp, CutMix, dict
  samples with masks and boxes, variable-size batches through
  ``images_and_targets`` and the isolated engine: warnings counted, 0 expected.
* ``isolated engine, copies slowed``: the isolated engine with every copy
  slowed, compared byte for byte with the CPU path.
* ``no context on GPU 0 before next()``: per engine, in a fresh process with one
  GPU visible: building the feeder initializes no CUDA; the first ``next()``
  then creates the context on the pass's device.
* ``H2D GB/s``: 38.5 MB uint8 batches (256 x 224 x 224 x 3) on both engines:
  host-to-device GB/s of the copies alone (a sleep kernel queued ahead of each
  batch's copies, so that the timed span holds no wait for the transfer thread
  to queue them), against a floor (``H2D_FLOOR_GBPS``: below it, copies are not
  from pinned memory) and against a plain copy of the same bytes from the
  feeder's page-locked memory in an otherwise idle process
  (``H2D_SHARE``); the transfer thread's CPU milliseconds per batch, under
  ``H2D_CPU_MS``. GB/s are per batch, medians.
* ``pinned and device memory``: pinned host bytes and device bytes held by a
  pass against docs/design/memory.md's formula.
* ``fed step against step and loader alone``: a small conv net's training
  step (bf16, channels_last, batch 256 at 224, defined here: no download) fed
  by feeder from decoded arrays (no decode) and by DataLoader(pin_memory=True)
  on the same arrays, against the slower of the step on a resident batch and
  the loader alone (batches taken with no model): a fed step may cost that
  plus ``OVERLAP_SLACK``. It fails where the loader and the step run one after
  the other (a copy that synchronizes the step, a training thread starved by
  the loader's threads); a 38.5 MB copy is under a tenth of this step on a
  PCIe 5 GPU, so the copy's own overlap with compute is shown by
  ``feeder-bench overlap``'s profiler trace (``bench/run_gpu.sh`` runs it), not
  by this row.

Each row's verdict is a function of its figures (``*_verdict``), tested on the
CPU in CI with recorded numbers. Without a GPU every row prints SKIP.
Exit status: 0 when nothing failed, 1 otherwise, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
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
from feeder.engine import transfer as _transfer  # noqa: E402
from feeder.engine.pinned import PinnedHost  # noqa: E402
from feeder.synthetic import make_image  # noqa: E402
from feeder.testing import engine_of, pool_of, side_stream_of  # noqa: E402

SPIN = 20_000_000  # GPU clock cycles for torch.cuda._sleep: milliseconds per batch
CPU_TARGET = 0.10  # transfer thread CPU / busy time
SUBPROCESS_S = 300
H2D_FLOOR_GBPS = 8.0  # pinned copies on PCIe 4/5 x16 reach 20+; pageable ones stay below
H2D_SHARE = 0.7  # an engine's copies reach this share of a plain copy from page-locked memory
BIG_BATCH = (256, 224)  # batch size, side: 256 x 224 x 224 x 3 uint8 = 38.5 MB
OVERLAP_SLACK = 0.15  # a fed step may cost this much more than the slower of step and loader alone
H2D_CPU_MS = 2.0  # the transfer thread's CPU per 38.5 MB batch (0.6 ms on an H200; a spin would be more)
MEMORY_SLACK = 2 << 20  # the caching allocator's rounding: one 2 MiB block per tensor kind


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
        pool_of(f).capacity = cap
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


def run_python(code: str, **environ: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "scripts"),
                                         os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=SUBPROCESS_S)


def error_lines(stderr: str) -> list[str]:
    words = ("Traceback", "CUDA error", "Exception ignored", "Error", "error:")
    return [line for line in stderr.splitlines() if any(w in line for w in words)]


# -- verdicts: pure functions of the figures (tested on the CPU) ------------------------
def sync_verdict(counts: dict) -> tuple[str, str]:
    """``counts``: synchronisation warnings per case; any is a FAIL."""
    bad = {case: n for case, n in counts.items() if n}
    detail = ", ".join(f"{case} {n}" for case, n in counts.items())
    return ("FAIL" if bad else "PASS"), f"warnings: {detail} (0 expected)"


def context_verdict(results: dict) -> tuple[str, str]:
    """``results``: per engine, (CUDA initialized after building, before ``next()``;
    devices with a context after the first ``next()``)."""
    notes, failed = [], False
    for engine, (early, devices) in results.items():
        failed |= bool(early) or list(devices) != [0]
        notes.append(f"{engine}: {'initialized at build' if early else 'nothing at build'}, "
                     f"contexts after next() {sorted(devices)}")
    return ("FAIL" if failed else "PASS"), "; ".join(notes)


def h2d_verdict(rows: dict, plain_gbps: float) -> tuple[str, str]:
    """``rows``: per engine, (bytes copied, seconds of copying, transfer CPU s, batches);
    ``plain_gbps``: a plain copy of the same bytes from page-locked memory."""
    notes, failed = [], False
    for engine, (nbytes, copy_s, cpu_s, batches) in rows.items():
        gbps = nbytes / copy_s / 1e9 if copy_s > 0 else 0.0
        cpu_ms = 1e3 * cpu_s / max(batches, 1)
        failed |= gbps < max(H2D_FLOOR_GBPS, H2D_SHARE * plain_gbps) or not cpu_ms <= H2D_CPU_MS
        notes.append(f"{engine} {gbps:.1f} GB/s, transfer CPU {cpu_ms:.2f} ms per batch")
    return ("FAIL" if failed else "PASS"), (
        "; ".join(notes) + f" (plain copy {plain_gbps:.1f} GB/s; floor max({H2D_FLOOR_GBPS:g}, "
        f"{H2D_SHARE:g} x plain); CPU <= {H2D_CPU_MS:g} ms)")


def memory_bounds(batch_size: int, side: int, num_buffers: int, queue_size: int,
                  itemsize: int) -> tuple[int, int]:
    """docs/design/memory.md for a pass of square uint8 images: (pinned host bytes:
    ``num_buffers`` buffers of images and int64 labels; device bytes: ``queue_size + 1``
    batches waiting plus the one the loop holds, in the output dtype)."""
    images = batch_size * side * side * 3
    pinned = num_buffers * (images + 8 * batch_size)
    device = (queue_size + 2) * (images * itemsize + 8 * batch_size)
    return pinned, device


def memory_verdict(pinned: int, pinned_bound: int, device: int, device_bound: int
                   ) -> tuple[str, str]:
    ok = pinned <= pinned_bound + MEMORY_SLACK and device <= device_bound + MEMORY_SLACK
    return ("PASS" if ok else "FAIL"), (
        f"pinned {pinned / 1e6:.1f} MB (bound {pinned_bound / 1e6:.1f}), "
        f"device {device / 1e6:.1f} MB (bound {device_bound / 1e6:.1f})")


def overlap_verdict(alone_s: float, loader_s: float, feeder_s: float,
                    dataloader_s: float | None) -> tuple[str, str]:
    """Seconds per step: on a resident batch, the loader alone (per batch, no model),
    fed by feeder, fed by DataLoader. Overlapped, a fed step costs the slower of the
    step and the loader; serialized, about their sum."""
    bound = max(alone_s, loader_s)
    ratio = feeder_s / bound if bound > 0 else float("inf")
    detail = (f"step {1e3 * alone_s:.1f} ms alone, loader {1e3 * loader_s:.1f} ms per batch "
              f"alone, {1e3 * feeder_s:.1f} ms fed by feeder (x{ratio:.2f} the slower)")
    if dataloader_s is not None:
        detail += f", {1e3 * dataloader_s:.1f} ms by DataLoader(pin_memory=True)"
    return ("PASS" if ratio <= 1 + OVERLAP_SLACK else "FAIL"), detail


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


@contextlib.contextmanager
def pinned_ledgers(hosts: list):
    """Collect every :class:`PinnedHost` made inside (the feeder's own page-locked
    memory: batch buffers, the isolated engine's registered shared arrays)."""
    real = PinnedHost.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        hosts.append(self)
    PinnedHost.__init__ = init
    try:
        yield
    finally:
        PinnedHost.__init__ = real


def check_busy_teardown(args):
    stats = getattr(torch.cuda, "host_memory_stats", None)
    gc.collect()
    base = stats()["allocated_bytes.current"] if stats else None
    source = MemorySource(64)
    notes, hosts = [], []
    for isolation in ("thread", "process"):
        with slowed_copies(SPIN * 10), pinned_ledgers(hosts):  # the side stream is busy for long
            f = make(source, device="cuda", isolation=isolation, num_buffers=2)
            it = iter(f)
            next(it)
            engine = engine_of(f)
            locked = sum(h.locked_bytes for h in hosts)
            t0 = time.perf_counter()
            f.close()
            took = time.perf_counter() - t0
            if isolation == "process" and engine.pinned.locked_bytes:
                return "FAIL", f"{engine.pinned.locked_bytes} bytes still registered after close()"
            notes.append(f"{isolation} close {took:.2f} s ({locked / 1e6:.1f} MB were locked)")
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
    gc.collect()
    left = sum(h.locked_bytes for h in hosts)
    notes.append(f"page-locked bytes left {left} in {len(hosts)} ledgers")
    if stats:
        cached = stats()["allocated_bytes.current"] - base
        notes.append(f"torch pinned bytes left {cached}")
        left += max(cached, 0)
    return ("FAIL" if left > 0 else "PASS"), "; ".join(notes)


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
        streams = list(side_stream_of(gpu)._streams.values())
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


# -- the checks added for the first GPU run -------------------------------------------
class FieldSource:
    """Dict samples (image, 8-bit mask PNG, boxes, label) made on read (module level:
    spawned workers import it)."""

    def __init__(self, n: int, size: int = 64) -> None:
        import cv2
        self.n, self.size = n, size
        self.image = simplejpeg.encode_jpeg(np.ascontiguousarray(make_image(size, size, 7)),
                                            quality=90, colorspace="RGB")
        mask = (np.arange(size * size).reshape(size, size) % 5).astype(np.uint8)
        self.mask = cv2.imencode(".png", mask)[1].tobytes()

    def __len__(self) -> int:
        return self.n

    def read(self, index: int):
        s = self.size
        return {"image": self.image, "mask": self.mask, "label": index,
                "boxes": np.array([[0, 0, s / 2, s / 2], [1, 1, s, s]], np.float32)[: 1 + index % 2]}


def audit_cases():
    """(name, feeder factory, what the loop does with a batch) for the synchronisation audit."""
    pairs = MemorySource(64)
    fields = FieldSource(64)
    touch = lambda batch: None  # noqa: E731 - the loop only takes the batch
    return [
        ("uint8 pairs", lambda: make(pairs, device="cuda"), touch),
        ("fp16 normalized", lambda: make(pairs, device="cuda", dtype=torch.float16,
                                         normalize=((0.5,) * 3, (0.25,) * 3)), touch),
        ("MixUp", lambda: make(pairs, device="cuda", dtype=torch.float32,
                               batch_transforms=[ops.MixUp(0.4, 64)]), touch),
        ("CutMix", lambda: make(pairs, device="cuda", dtype=torch.float32,
                                batch_transforms=[ops.CutMix(1.0, 64)]), touch),
        ("dict, masks and boxes", lambda: make(fields, device="cuda"), touch),
        ("variable size, images_and_targets",
         lambda: Feeder(pairs, 16, [], device="cuda", max_image_size=(96, 96), seed=3,
                        size_divisibility=8, timeout=120),
         lambda batch: batch.images_and_targets()),
        ("isolated engine", lambda: make(pairs, device="cuda", isolation="process"), touch),
    ]


def sync_warnings(build, use) -> int:
    """Synchronisation warnings over a steady-state pass (after a warm-up pass)."""
    import warnings
    with build() as f:
        for _ in f:
            pass
        f.set_epoch(1)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for batch in f:
                    use(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_sync_audit(args):
    return sync_verdict({name: sync_warnings(build, use) for name, build, use in audit_cases()})


def check_isolated_slowed(args):
    source = MemorySource(96)
    with make(source, device="cpu") as cpu:
        cpu.set_epoch(1)
        expect = to_host(cpu)
    with slowed_copies():
        with make(source, device="cuda", isolation="process", queue_size=1) as gpu:
            gpu.set_epoch(1)
            got = [(x.cpu().clone(), y.cpu().clone()) for x, y in gpu]
    diff = identical(expect, got)
    return ("FAIL", diff) if diff else ("PASS", f"{len(got)} batches identical to the CPU path")


def check_no_context_before_next(args):
    results = {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    for isolation in ("thread", "process"):
        code = f"""
            import json, torch
            from gpu_check import MemorySource, make
            f = make(MemorySource(48), device="cuda", isolation={isolation!r})
            early = torch.cuda.is_initialized()
            next(iter(f))
            has = getattr(torch._C, "_cuda_hasPrimaryContext", lambda i: True)
            print("RESULT", json.dumps([early, [i for i in range(torch.cuda.device_count()) if has(i)]]))
            f.close()
        """
        result = run_python(code, CUDA_VISIBLE_DEVICES=visible)
        if result.returncode != 0 or "RESULT" not in result.stdout:
            return "FAIL", f"{isolation}: " + (error_lines(result.stderr) or [result.stderr[-300:]])[-1]
        import json
        results[isolation] = json.loads(result.stdout.split("RESULT", 1)[1])
    return context_verdict(results)


@contextlib.contextmanager
def timed_copies(spans: list, cycles: int = SPIN):
    """Time every batch's copies on the side stream with CUDA events (appended to
    ``spans`` as event pairs; read them after a synchronize). A sleep kernel queued
    ahead keeps the stream busy while the copies are queued, so the span between
    the events is the copies' own time, not the transfer thread's queuing."""
    real = _transfer.SideStream.copying

    @contextlib.contextmanager
    def copying(self):
        with real(self):
            torch.cuda._sleep(cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            spans.append((start, end))
    _transfer.SideStream.copying = copying
    try:
        yield
    finally:
        _transfer.SideStream.copying = real


def big_batches(isolation: str, spans: list, measure_memory: bool = False):
    """One steady-state pass of 38.5 MB uint8 batches: (bytes, copy s, transfer CPU s,
    batches) and, with ``measure_memory``, (pinned bytes, bound, device bytes, bound)."""
    batch, side = BIG_BATCH
    source = MemorySource(batch * 4, size=64)
    f = Feeder(source, batch, [ops.RandomResizedCrop(side)], device="cuda", isolation=isolation,
               decode_threads=max(2, (os.cpu_count() or 4) - 2), seed=1, timeout=300)
    with f:
        for _ in f:
            pass
        torch.cuda.synchronize()
        before = f.stats().stage("transfer")
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        reset_host = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
        if reset_host is not None:
            reset_host()
        spans.clear()
        nbytes = 0
        f.set_epoch(1)
        with timed_copies(spans):
            for x, _ in f:
                nbytes += x.numel() * x.element_size()
        torch.cuda.synchronize()
        after = f.stats().stage("transfer")
        # The median batch's copy time, for every batch (as the plain copy's median).
        copy_s = (float(np.median([a.elapsed_time(b) for a, b in spans])) / 1e3 * len(spans)
                  if spans else 0.0)
        row = (nbytes, copy_s, after.cpu_s - before.cpu_s, len(spans))
        memory = None
        if measure_memory:  # the pool's own page-locked blocks, and torch's pinned cache
            host = getattr(torch.cuda, "host_memory_stats", lambda: {})()
            held = "allocated_bytes.peak" if reset_host is not None else "allocated_bytes.current"
            pinned = pool_of(f).pinned.locked_bytes + host.get(held, 0)
            device = torch.cuda.max_memory_allocated() - base
            pinned_bound, device_bound = memory_bounds(batch, side, f.num_buffers,
                                                       f.config.queue_size, 1)
            memory = (pinned, pinned_bound, device, device_bound)
    return row, memory


def plain_h2d_gbps(repeats: int = 20) -> float:
    """Median GB/s of one batch's bytes copied from the feeder's page-locked memory
    (:class:`PinnedHost`) with nothing else running: what the engines' copies are
    held against."""
    batch, side = BIG_BATCH
    host = PinnedHost()
    src = host.empty((batch, side, side, 3), torch.uint8)
    src.fill_(7)
    dst = torch.empty(src.shape, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    times = []
    with torch.cuda.stream(stream):
        for _ in range(repeats + 2):
            torch.cuda._sleep(SPIN // 4)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    host.unregister_all()
    return src.numel() / float(np.median(times[2:])) / 1e9


def check_h2d(args, shared):
    rows, spans = {}, []
    plain = plain_h2d_gbps()
    for isolation in ("thread", "process"):
        rows[isolation], memory = big_batches(isolation, spans, isolation == "thread")
        if memory is not None:
            shared["memory"] = memory
    return h2d_verdict(rows, plain)


def check_memory(args, shared):
    if "memory" not in shared:
        return "SKIP", "needs the H2D check"
    return memory_verdict(*shared["memory"])


def small_net() -> "torch.nn.Module":
    """A small conv net (no download): enough compute per step to hide a copy behind."""
    nn = torch.nn
    layers, cin = [], 3
    for cout in (64, 128, 256, 256):
        layers += [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                   nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000))


def timed_per_batch(batches, each, steps: int = 20, warmup: int = 5) -> float:
    """Seconds per batch of ``each(x, y)`` over ``batches``, the device's work
    included (synchronized before the first timed batch and after the last)."""
    it = iter(batches)
    t0 = None
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        each(*next(it))
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def step_time(batches, steps: int = 20, warmup: int = 5) -> float:
    """Seconds per training step of the small net over ``batches`` ((x, y) on the GPU)."""
    model = small_net().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()

    def train(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x.to(memory_format=torch.channels_last)), y % 1000)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return timed_per_batch(batches, train, steps, warmup)


class DecodedArrays(torch.utils.data.Dataset):
    """Decoded uint8 images (HWC arrays), the same for both loaders: the overlap
    check compares copies, not decoding. Also a feeder source."""

    def __init__(self, n: int, side: int) -> None:
        rng = np.random.default_rng(0)
        self.n, self.image = n, rng.integers(0, 256, (side, side, 3), dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def read(self, index: int):
        return self.image, index

    def __getitem__(self, index: int):
        return torch.from_numpy(self.image).permute(2, 0, 1), index


def loader_time(batches, steps: int = 20, warmup: int = 5) -> float:
    """Seconds per batch taken from ``batches`` with no model."""
    return timed_per_batch(batches, lambda x, y: None, steps, warmup)


def check_overlap(args):
    batch, side = BIG_BATCH
    steps, warmup = 20, 5
    x = torch.randn(batch, 3, side, side, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    alone = step_time(itertools.repeat((x, y)), steps, warmup)
    arrays = DecodedArrays(batch * 4, side)
    with Feeder(arrays, batch, [], image_size=(side, side), device="cuda",
                dtype=torch.float16, normalize=((0.45,) * 3, (0.25,) * 3),
                decode_threads=max(2, (os.cpu_count() or 4) - 2), seed=1, timeout=300) as f:
        def fed():
            epoch = 0
            while True:
                f.set_epoch(epoch)
                yield from f
                epoch += 1
        loader_s = loader_time(fed(), steps, warmup)
        feeder_s = step_time(fed(), steps, warmup)
    loader = torch.utils.data.DataLoader(arrays, batch_size=batch, num_workers=4, pin_memory=True,
                                         persistent_workers=True)
    m = torch.tensor([0.45] * 3, device="cuda").view(1, 3, 1, 1)
    sd = torch.tensor([0.25] * 3, device="cuda").view(1, 3, 1, 1)

    def moved():
        while True:
            for images, labels in loader:
                images = images.cuda(non_blocking=True).half().div_(255).sub_(m).div_(sd)
                yield images, labels.cuda(non_blocking=True)
    dataloader_s = step_time(moved(), steps, warmup)
    return overlap_verdict(alone, loader_s, feeder_s, dataloader_s)


CHECKS = [
    ("gpu suite (pytest tests/cuda)", check_suite, False),
    ("copy slowed on the side stream", check_slowed_copy, True),
    ("transfer CPU / wall", check_transfer_cpu, True),
    ("set_device after build", check_set_device_after_build, False),
    ("teardown while the side stream is busy", check_busy_teardown, False),
    ("40 passes against a user stream", check_user_stream, False),
    ("exit mid-epoch", check_exit_mid_epoch, False),
    ("synchronisation audit", check_sync_audit, False),
    ("isolated engine, copies slowed", check_isolated_slowed, False),
    ("no context on GPU 0 before next()", check_no_context_before_next, False),
    ("H2D GB/s", check_h2d, True),
    ("pinned and device memory", check_memory, True),
    ("fed step against step and loader alone", check_overlap, False),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-suite", action="store_true", help="leave out pytest tests/cuda")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the suite's output")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: torch.cuda.is_available() is False; this check is for a CUDA machine",
              file=sys.stderr)
        print_table([(name, "SKIP", "no CUDA device", 0.0) for name, _, _ in CHECKS])
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
    print_table(rows)
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


def print_table(rows) -> None:
    """The result table: one row per check (name, PASS/FAIL/SKIP, seconds, detail)."""
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'check':<{width}}  {'result':<6}  {'s':>6}  detail")
    for name, status, detail, seconds in rows:
        print(f"{name:<{width}}  {status:<6}  {seconds:>6.1f}  {detail}", flush=True)

if __name__ == "__main__":
    sys.exit(main())
