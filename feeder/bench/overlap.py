"""``overlap``: do the host-to-device copies overlap the model's compute? (CUDA only)

Each loader feeds a real training step (:mod:`feeder.bench.model`) on the GPU.
After a warm-up, ``--batches`` steps run under ``torch.profiler`` (CPU and CUDA
activity); the trace is saved (``overlap_<loader>.trace.json.gz``, open it in
Perfetto or chrome://tracing) and summarised from its events:

* the host-to-device copies: how many, their time per batch, the streams they
  ran on, and whether any came from pageable (unpinned) memory;
* the compute stream: the stream with the most kernel time (the model's);
* the share of copy time during which a kernel ran on another stream, that is
  the copy hidden behind compute. A copy on the compute stream itself is
  serialised with the model's kernels and counts as not overlapped.

feeder copies on its own side stream; DataLoader with ``pin_memory=True`` and
``non_blocking=True`` copies on the training loop's stream, so its copies wait
for the previous step's kernels and the next step waits for them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any, Iterable

import torch

from . import report
from .loaders import LOADER_KINDS, Loader

log = logging.getLogger(__name__)

COLUMNS = [
    ("loader", "loader", "{}"),
    ("setting", "setting", "{}"),
    ("images_per_s", "img/s profiled", "{:.0f}"),
    ("consumer_wait", "loop waited", "{:.1%}"),
    ("copies", "H2D copies", "{:d}"),
    ("copy_ms_per_batch", "copy ms/batch", "{:.3f}"),
    ("copy_streams", "copy stream ids", "{}"),
    ("compute_stream", "compute stream", "{}"),
    ("on_compute_stream", "copies on compute stream", "{:d}"),
    ("overlapped", "copy time under compute", "{:.0%}"),
    ("pageable", "pageable copies", "{:d}"),
]

# The profiler records the torch calls of every thread of the training process:
# feeder's threads are slowed with the step, DataLoader's worker processes are not.
PROFILED_NOTE = ("img/s profiled: taken under torch.profiler, which records the torch calls of "
                 "every thread of the training process (feeder's threads, not DataLoader's "
                 "workers); not a speed comparison: `feeder-bench compare --device cuda "
                 "--model` measures that.")


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _covered(start: float, end: float, union: list[tuple[float, float]]) -> float:
    """Length of [start, end] inside the (sorted, disjoint) intervals of ``union``."""
    total = 0.0
    for a, b in union:
        if b <= start:
            continue
        if a >= end:
            break
        total += min(b, end) - max(a, start)
    return total


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Summarise a Chrome-trace event list from ``torch.profiler`` (see the module doc).

    Copies are complete events (``"ph": "X"``) whose name holds ``Memcpy HtoD``;
    kernels are complete events of category ``kernel``. Times are microseconds.

    Returns:
        copies, copy_us, copy_streams, kernels, kernel_us, compute_stream,
        on_compute_stream (copies on it), overlapped_us, overlapped (share of
        copy time under a kernel on another stream; None without copies),
        pageable (copies from pageable memory).
    """
    copies, kernels = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        stream = (e.get("args") or {}).get("stream")
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), stream, e.get("name", ""))
        if "Memcpy HtoD" in span[3]:
            copies.append(span)
        elif e.get("cat") == "kernel":
            kernels.append(span)
    per_stream: dict[Any, float] = {}
    for start, end, stream, _ in kernels:
        per_stream[stream] = per_stream.get(stream, 0.0) + (end - start)
    compute = max(per_stream, key=lambda s: per_stream[s]) if per_stream else None
    overlapped = 0.0
    elsewhere: dict[Any, list[tuple[float, float]]] = {}  # kernel time off each copy stream
    for start, end, stream, _ in copies:
        if stream not in elsewhere:
            elsewhere[stream] = _union((a, b) for a, b, s, _ in kernels if s != stream)
        overlapped += _covered(start, end, elsewhere[stream])
    copy_us = sum(end - start for start, end, _, _ in copies)
    return {
        "copies": len(copies), "copy_us": copy_us,
        "copy_streams": sorted({str(s) for _, _, s, _ in copies}),
        "kernels": len(kernels), "kernel_us": sum(per_stream.values()),
        "compute_stream": compute,
        "on_compute_stream": sum(1 for _, _, s, _ in copies if compute is not None and s == compute),
        "overlapped_us": overlapped,
        "overlapped": overlapped / copy_us if copy_us > 0 else None,
        "pageable": sum(1 for *_, name in copies if "Pageable" in name),
    }


def profile_loader(kind: str, root: str, batch_size: int, workers: int, batches: int, warmup: int,
                   trace_path: str, seed: int = 0, device: str = "cuda") -> dict[str, Any]:
    """Feed :class:`~feeder.bench.model.ModelStep` from one loader; profile ``batches`` steps.

    Writes the gzipped Chrome trace to ``trace_path`` and returns :func:`summarize`'s
    figures plus images/s and the share of time the loop waited for a batch.
    ``device="cpu"`` runs the same steps without CUDA activity (no copies).
    """
    from torch.profiler import ProfilerActivity, profile

    from .model import ModelStep

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step = ModelStep(device)
    loader = Loader(kind, root, batch_size, workers=workers, device=device, seed=seed)
    wait_s = 0.0
    images = 0
    try:
        it = _batches(loader)
        for _ in range(warmup):
            step(*next(it))
        step.synchronize()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(batches):
                tw = time.perf_counter()
                x, y = next(it)
                wait_s += time.perf_counter() - tw
                step(x, y)
                images += x.shape[0]
            step.synchronize()
            wall_s = time.perf_counter() - t0
    finally:
        loader.close()
    with tempfile.TemporaryDirectory(prefix="feeder-bench-") as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f:
            data = f.read()
    with gzip.open(trace_path, "wb") as f:
        f.write(data)
    summary = summarize(json.loads(data)["traceEvents"])
    summary.update(images_per_s=images / wall_s, consumer_wait=wait_s / wall_s, wall_s=wall_s,
                   batches=batches, copy_ms_per_batch=summary["copy_us"] / 1e3 / batches,
                   trace=trace_path)
    return summary


def _batches(loader: Loader):
    epoch = 0
    while True:
        yield from loader.epoch(epoch)
        epoch += 1


def run(args: argparse.Namespace) -> int:
    """The ``overlap`` subcommand."""
    unknown = [k for k in args.loaders if k not in LOADER_KINDS]
    if unknown:
        print(f"feeder-bench overlap: unknown loader {unknown[0]!r}; choose from {', '.join(LOADER_KINDS)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("feeder-bench overlap: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for kind in args.loaders:
        setting = "auto" if kind == "feeder" else f"num_workers={args.workers}"
        report.progress(f"overlap: {kind} ({setting}), {args.warmup} warm-up + {args.batches} profiled steps")
        trace = os.path.join(args.out, f"overlap_{kind}.trace.json.gz")
        s = profile_loader(kind, args.dir, args.batch_size, args.workers, args.batches, args.warmup, trace,
                           seed=args.seed)
        s.update(loader=kind, setting=setting, copy_streams=" ".join(s["copy_streams"]))
        rows.append(s)
    gpu = torch.cuda.get_device_name(0)
    print(report.format_table(rows, COLUMNS, title=(
        f"overlap on {args.dir}: ResNet-style training step on {gpu}, batch {args.batch_size}, "
        f"{args.batches} profiled steps after {args.warmup}\nmachine: "
        f"{report.describe_machine(report.machine_info())}")))
    print(PROFILED_NOTE)
    report.write_outputs(args.out, "overlap", rows, {"dir": args.dir, "batches": args.batches,
                                                     "warmup": args.warmup, "gpu": gpu})
    return 0
