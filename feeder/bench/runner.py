"""The child side of a measurement: ``python -m feeder.bench.runner SPEC_JSON REPORT_PATH``.

One process per measured run, so each loader starts cold and owns exactly the
processes whose memory the parent sums. Every mode imports the same libraries
(this module's imports), which is what makes the ``idle`` mode a fair memory
baseline for the others.

Modes (``spec["mode"]``):

* ``idle``: import everything, then sleep ``idle_s`` seconds (memory baseline).
* ``loader``: build a :class:`~feeder.bench.loaders.Loader` (or, for the kinds
  ``dali`` and ``spdl``, another library's loader: :mod:`feeder.bench.peers`)
  and run ``epochs`` epochs, the consumer optionally spending ``step_ms`` per
  batch (sleeping, as a GPU step would leave the CPU free) or running a model
  step on CUDA.
* ``ceiling``: the single-thread cost of the per-sample work (see :mod:`feeder.bench.ceiling`).
* ``ceiling-parallel``: that work in one process per core at once.
* ``interference``: the training thread's step times, alone or fed by a loader
  (see :mod:`feeder.bench.interference`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import cv2  # noqa: F401 - imported in every mode, for the idle baseline
import numpy as np  # noqa: F401
import simplejpeg  # noqa: F401
import torch

from . import ceiling
from .loaders import CROP, Loader, has_pil
from .measure import cpu_seconds, now

if has_pil():
    import PIL.Image  # noqa: F401 - the dl-pil baseline's library, loaded in every mode

log = logging.getLogger(__name__)

PEER_KINDS = ("dali", "spdl")  # other libraries' loaders (feeder.bench.peers), imported in their runs only


def _run_loader(spec: dict[str, Any]) -> dict[str, Any]:
    epochs = int(spec.get("epochs", 1))
    step_ms = float(spec.get("step_ms", 0.0))
    step = None
    if spec.get("model"):
        from .model import ModelStep

        step = ModelStep(spec.get("device", "cpu"))
    limit = spec.get("limit")
    limit = None if limit is None else int(limit)
    size = int(spec.get("size", CROP))
    if spec["kind"] in PEER_KINDS:
        from .peers import import_peer, peer_loader

        # Before the clock starts, as this module imports torch and feeder's libraries.
        import_peer(spec["kind"])
    cpu0 = cpu_seconds()
    t0 = now()
    if spec["kind"] in PEER_KINDS:
        loader: Any = peer_loader(spec["kind"], spec["root"], int(spec["batch_size"]), size=size,
                                  seed=int(spec.get("seed", 0)), limit=limit)
    elif spec["kind"] == "bare":
        from .bare import BareLoader

        loader = BareLoader(spec["root"], size, seed=int(spec.get("seed", 0)), limit=limit)
    else:
        loader = Loader(spec["kind"], spec["root"], int(spec["batch_size"]),
                        workers=int(spec.get("workers", 0)),
                        decode_threads=spec.get("decode_threads", "auto"),
                        augment_threads=spec.get("augment_threads", "auto"),
                        queue_size=int(spec.get("queue_size", 4)), device=spec.get("device", "cpu"),
                        full_decode=bool(spec.get("full_decode", False)), seed=int(spec.get("seed", 0)),
                        persistent_workers=epochs > 1, evaluation=bool(spec.get("evaluation", False)),
                        feeder_options=spec.get("feeder_options"), size=size, limit=limit)
    first_batch_s = None
    images = 0
    wait_s = 0.0
    checksum = 0
    # When each epoch's last batch arrived (seconds from building the loader)
    # and the images up to then: the rate after the first epoch, whose start-up
    # and first reads a long run pays once, is (images[-1] - images[0]) /
    # (ends[-1] - ends[0]); with the CPU seconds of the process and its children
    # by then, the CPU per image over those epochs.
    epoch_end_s: list[float] = []
    epoch_images: list[int] = []
    epoch_cpu_s: list[float] = []
    try:
        for epoch in range(epochs):
            it = loader.epoch(epoch)
            while True:
                tw = now()
                try:
                    batch, labels = next(it)
                except StopIteration:
                    break
                wait_s += now() - tw
                if first_batch_s is None:
                    first_batch_s = now() - t0
                images += batch.shape[0]
                # Touch one pixel per batch so no loader can hand out unfilled memory unnoticed.
                checksum += int(labels[0]) + int(batch[0, 0, 0, 0])
                if step is not None:
                    step(batch, labels)
                elif step_ms > 0:
                    time.sleep(step_ms / 1000.0)
            epoch_end_s.append(now() - t0)
            epoch_images.append(images)
            epoch_cpu_s.append(cpu_seconds() - cpu0)
        if step is not None:
            step.synchronize()
        wall_s = now() - t0
        extra = loader.stats()
    finally:
        loader.close()
    cpu_s = cpu_seconds() - cpu0
    extra["consumer_wait_s"] = wait_s
    extra["checksum"] = checksum
    extra["epoch_end_s"] = epoch_end_s
    extra["epoch_images"] = epoch_images
    extra["epoch_cpu_s"] = epoch_cpu_s
    if step is not None:
        extra["model_steps"] = step.steps
    return {"images": images, "wall_s": wall_s, "cpu_s": cpu_s,
            "first_batch_s": first_batch_s or 0.0, "extra": extra}


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement described by ``spec``; return its report (JSON-serialisable)."""
    mode = spec.get("mode", "loader")
    if mode == "idle":
        t0 = now()
        time.sleep(float(spec.get("idle_s", 1.0)))
        return {"images": 0, "wall_s": now() - t0, "cpu_s": 0.0, "first_batch_s": 0.0, "extra": {}}
    if mode == "ceiling":
        c = ceiling.measure(spec["root"], limit=int(spec.get("limit", 500)),
                            full_decode=bool(spec.get("full_decode", False)))
        return {"images": c.images, "wall_s": c.total_s, "cpu_s": c.cpu_s, "first_batch_s": 0.0,
                "extra": c.as_dict()}
    if mode == "ceiling-parallel":
        p = ceiling.measure_parallel(spec["root"], processes=int(spec.get("processes", 0)) or None,
                                     limit=int(spec.get("limit", 500)),
                                     full_decode=bool(spec.get("full_decode", False)))
        return {"images": p.images, "wall_s": p.span_s, "cpu_s": p.cpu_s, "first_batch_s": 0.0,
                "extra": p.as_dict()}
    if mode == "loader":
        return _run_loader(spec)
    if mode == "interference":
        from . import fedloop

        return fedloop.child(spec)
    raise ValueError(f"unknown runner mode {mode!r}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m feeder.bench.runner SPEC_JSON REPORT_PATH", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    torch.manual_seed(int(spec.get("seed", 0)))
    try:
        report = execute(spec)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole group: feeder-bench says it once
        return 130
    with open(argv[1], "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
