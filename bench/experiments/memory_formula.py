"""What a feeder holds resident, per component, against the memory page's formula.

For each dataset and epoch count, a fresh process imports what every loader
imports (torch, numpy, OpenCV, simplejpeg: the idle baseline of
``feeder-bench compare``), reads its PSS, then runs a default Feeder
(RandomResizedCrop + flip, uint8, CPU) for the epochs while a thread samples
its PSS every 20 ms. It prints the peak PSS above the baseline (what the
feeder added), ``stats().memory`` at the end (batch buffers, scratch, decode
buffers, JPEG table, JPEG indexes) and the formula of ``docs/design/memory.md``:
the components, plus the files held (``FILES_PER_DECODE_THREAD`` x
``decode_threads`` x the mean file size), plus ``ENGINE_MIB``, the engine's own
fixed cost (thread stacks, the allocator's arenas, library pages first
touched), and the formula's error against what was measured.

    python bench/experiments/memory_formula.py imagenet-like=DIR1:224:64 small=DIR2:64:256 \\
        large=DIR3:224:64 --epochs 1,3

Each ``NAME=DIR:CROP:BATCH`` is an ImageFolder, the RandomResizedCrop side and the
batch size. Run with ``PYTHONPATH=`` another checkout to measure that tree (one
from before ``stats().memory`` gets its components from the engine, the JPEG
tables and ring as the kernel holds them resident).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

MIB = 1 << 20
#: The engine's own resident memory beyond its buffers, tables, indexes and
#: the files it holds (thread stacks, the allocator's arenas, library pages
#: first touched), and how many files per decode thread are held: read and
#: being decoded, or freed into an arena that keeps their memory. Both fitted
#: to this script's runs on the three sets, one and three epochs (see
#: docs/design/memory.md).
ENGINE_MIB = 6.0
FILES_PER_DECODE_THREAD = 4


def _pss() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")


def _components(f) -> dict[str, int]:
    """The components from the engine itself, for a tree from before
    ``stats().memory`` (run this script with PYTHONPATH=that tree): the JPEG
    tables and ring as the kernel holds them resident."""
    from feeder.bench.measure import resident_bytes

    engine = f._engine
    buf = engine.pool.buffer(next(iter(engine.pool._ledger)))
    per_buffer = buf.images.nbytes + buf.labels.nbytes + buf.indices.nbytes
    verified = engine.work.verified
    maps = [m for m in (getattr(verified, n, None) for n in ("_table", "_where")) if m is not None]
    ring = getattr(verified, "_ring", None)
    return {"batch_buffers": engine.pool.allocated * per_buffer,
            "scratch": sum(a.nbytes for a in engine.scratch._free),
            "decode_buffers": sum(b.nbytes for b in engine.work.buffers._free),
            "jpeg_table": sum(resident_bytes(m) or 0 for m in maps),
            "jpeg_indexes": (resident_bytes(ring) or 0) if ring is not None else 0}


def child(root: str, crop: int, batch: int, epochs: int) -> None:
    import cv2  # noqa: F401 - the imports every loader has count as the baseline
    import numpy as np  # noqa: F401
    import simplejpeg  # noqa: F401
    import torch  # noqa: F401

    import feeder
    from feeder import Feeder, ImageFolder, ops

    source = ImageFolder(root)
    base = _pss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], _pss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with Feeder(source, batch, [ops.RandomResizedCrop(crop), ops.RandomHorizontalFlip()],
                shuffle=True, seed=0) as f:
        for epoch in range(epochs):
            f.set_epoch(epoch)
            for _ in f:
                pass
        peak[0] = max(peak[0], _pss())
        stop.set()
        sampler.join(5)
        stats = f.stats()
        parts = (vars(stats.memory).copy() if hasattr(stats, "memory") else _components(f))
        threads = f.config.decode_threads
    files = len(source)
    size = sum(os.path.getsize(p) for p in source.paths) / max(1, files)
    print(json.dumps({"added": peak[0] - base, **parts, "files": files, "mean_file": size, "decode_threads": threads, "region_decode": feeder.info()["jpeg"]["region_decode"]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sets", nargs="+", help="NAME=DIR:CROP:BATCH")
    p.add_argument("--epochs", default="1,3")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        root, crop, batch, epochs = args.child
        child(root, int(crop), int(batch), int(epochs))
        return
    print(f"{'set':<14}{'epochs':>7}{'added':>8}{'batch':>8}{'scratch':>8}{'decode':>8}"
          f"{'table':>8}{'indexes':>8}{'files':>8}{'formula':>9}{'error':>7}")
    for spec in args.sets:
        name, rest = spec.split("=", 1)
        root, crop, batch = rest.rsplit(":", 2)
        for epochs in (int(e) for e in args.epochs.split(",")):
            rows = []
            for _ in range(args.rounds):
                out = subprocess.run([sys.executable, __file__, "x", "--child", root, crop, batch,
                                      str(epochs)], capture_output=True, text=True, timeout=900)
                if out.returncode:
                    sys.exit(f"{name}: child failed: {out.stderr.strip().splitlines()[-1:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]
                   if isinstance(rows[0][k], (int, float)) and not isinstance(rows[0][k], bool)}
            parts = ("batch_buffers", "scratch", "decode_buffers", "jpeg_table", "jpeg_indexes")
            held = FILES_PER_DECODE_THREAD * med["decode_threads"] * med["mean_file"]
            formula = sum(med[k] for k in parts) + held + ENGINE_MIB * MIB
            err = formula / med["added"] - 1
            print(f"{name:<14}{epochs:>7}{med['added'] / MIB:>8.1f}"
                  + "".join(f"{med[k] / MIB:>8.1f}" for k in parts)
                  + f"{held / MIB:>8.1f}{formula / MIB:>9.1f}{100 * err:>+6.0f}%", flush=True)
    print(f"(MiB, medians of {args.rounds} rounds; added: peak PSS above the idle process; "
          f"files: {FILES_PER_DECODE_THREAD} x decode_threads x the mean file size; formula: "
          f"the components + files + {ENGINE_MIB:.0f} MiB engine)")


if __name__ == "__main__":
    main()
