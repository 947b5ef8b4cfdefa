"""The doctor's measurements: storage, the CPU work per image, the loader alone, the
model on synthetic input, and the model fed by the feeder (threads, worker process,
``"tune"``). Each phase is bounded in time and fills fields of a
:class:`~feeder.doctor.verdict.Measurements`."""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .. import Feeder, ImageFolder, TarShards, ops
from ..errors import SampleError, UserCodeError, call_user
from ..sources import describe
from ..work.augment import Chain
from ..engine.config import Config, reads_may_block
from ..work.decode import jpeg_decoder
from ..work.sample import pixels
from ..engine.read import nbytes
from ..work.rng import sample_key
from ..engine.threads import available_cores
from ..engine.steps import SampleWork
from .verdict import Fed, Measurements

log = logging.getLogger(__name__)
_now = time.perf_counter


# -- what the command line names -------------------------------------------------------

def load_object(spec: str, what: str) -> Any:
    """``module:name`` -> the object (a source, a transform list, a step function).

    Raises:
        ValueError: the module cannot be found or has no such name.
        UserCodeError: importing the module raised (``what`` names the argument).
    """
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what}: expected MODULE:NAME, got {spec!r}")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{spec!r}: cannot import module {module!r}: {exc}") from exc
    except Exception as exc:  # the module's own code failed: the user's, said as such
        raise UserCodeError(f"{what}: importing {module!r} raised {type(exc).__name__}: {exc}") from exc
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{spec!r}: module {module!r} has no {name!r}") from None
    return obj


def _is_object_spec(data: str) -> bool:
    return ":" in data and "://" not in data and not os.path.exists(data)


def open_source(data: str) -> tuple[Any, str]:
    """What a ``Feeder`` would read for ``DATA``, and its kind (``folder``,
    ``shards``, ``remote-shards``, ``object``). Remote shards are read without the
    local cache: the doctor measures the first epoch's condition."""
    if _is_object_spec(data):
        obj = load_object(data, f"DATA {data}")
        if isinstance(obj, type) or (callable(obj) and not callable(getattr(obj, "read", None))):
            obj = call_user(f"DATA {data}", obj)  # a class or a factory
        if not (hasattr(obj, "__len__") and callable(getattr(obj, "read", None))):
            raise ValueError(f"{data!r} is not a source (needs __len__ and read(index))")
        call_user(f"DATA {data}: len()", len, obj)
        return obj, "object"
    if "://" in data:
        return TarShards(data, cache_dir=False), "remote-shards"
    if data.endswith((".json", ".tar")) or "{" in data:
        try:
            return TarShards(data), "shards"
        except FileNotFoundError as exc:  # a mistyped DATA, said as a missing folder is
            raise ValueError(f"DATA {data!r}: {exc.strerror or exc}"
                             + (f": {exc.filename!r}" if exc.filename not in (None, data) else "")) from None
    if os.path.isdir(data):
        if any(name.endswith(".tar") for name in os.listdir(data)):
            return TarShards(data), "shards"
        try:
            return ImageFolder(data), "folder"
        except FileNotFoundError as exc:  # no image in it: a bad DATA, said as the others
            raise ValueError(f"DATA {data!r}: {exc}") from None
    raise ValueError(f"DATA {data!r}: not a folder, a shard spec, a URL or MODULE:NAME")


def open_transforms(spec: str) -> list[Any]:
    """``--transforms``: ``train``, ``eval`` or ``MODULE:NAME`` of a list of
    transforms (or of a function returning one).

    Raises:
        ValueError: ``spec`` names no list of callables.
        UserCodeError: the function named raised.
    """
    if spec == "train":
        return [ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()]
    if spec == "eval":
        return [ops.Resize(256), ops.CenterCrop(224)]
    what = f"--transforms {spec}"
    obj = load_object(spec, what)
    if callable(obj) and not isinstance(obj, (list, tuple)):
        obj = call_user(what, obj)
    if not isinstance(obj, (list, tuple)) or not all(callable(t) for t in obj):
        raise ValueError(f"{what} gave {_short(obj)}, not a list of transforms (callables)")
    return list(obj)


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


class SimulatedStep:
    """``--step-ms``: a step that takes ``ms`` and leaves the CPU free, as a GPU step
    does while the host waits for it."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        time.sleep(self.ms / 1e3)


def open_model(spec: str | None, step_ms: float | None, device: str) -> tuple[Callable | None, str | None]:
    if spec is not None and step_ms is not None:
        raise ValueError("give --model or --step-ms, not both")
    if step_ms is not None:
        if not (math.isfinite(step_ms) and step_ms > 0):
            raise ValueError(f"--step-ms must be a finite number > 0, got {step_ms}")
        return SimulatedStep(step_ms), f"simulated {step_ms:g} ms step"
    if spec is None:
        return None, None
    if spec == "builtin":
        from ..bench.model import ModelStep

        return ModelStep(device), "feeder's built-in ResNet-style step"
    what = f"--model {spec}"
    fn = load_object(spec, what)
    if not callable(fn):
        raise ValueError(f"{what} is {_short(fn)}, not callable")

    def step(images: torch.Tensor, labels: torch.Tensor) -> Any:
        return call_user(what, fn, images, labels)

    return step, spec


# -- helpers -----------------------------------------------------------------------------

def image_data(sample: Any) -> Any:
    """What the decode step gets of ``sample``'s image: its encoded bytes, or the
    pixels of an image given decoded (an array, a tensor, a PIL image)."""
    data = sample[0] if isinstance(sample, tuple) else sample.get("image") if isinstance(sample, dict) else sample
    if isinstance(data, bytes):
        return data
    arr = pixels(data)
    return arr if arr is not None else bytes(data)


def _median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def _p90_ms(values: list[float]) -> float | None:
    return 1e3 * float(np.percentile(values, 90)) if values else None


class Timeline:
    """CPU use of this process (cores busy) and images delivered, per phase over time."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.t0 = _now()
        self._last = (_now(), time.process_time(), 0)
        self.phase = ""

    def start(self, phase: str) -> None:
        self.phase = phase
        self._last = (_now(), time.process_time(), 0)

    def tick(self, images: int = 0, every: float = 0.25) -> None:
        now, cpu, n = _now(), time.process_time(), self._last[2] + images
        dt = now - self._last[0]
        if dt < every:
            self._last = (self._last[0], self._last[1], n)
            return
        self.rows.append({"t": round(now - self.t0, 3), "phase": self.phase,
                          "cpu_cores": round((cpu - self._last[1]) / dt, 3),
                          "img_s": round(n / dt, 1)})
        self._last = (now, cpu, 0)


# -- the phases ----------------------------------------------------------------------------

def order(source: Any, kind: str) -> list[int]:
    """Sample indices in the order the feeder reads them: shard by shard for shards,
    a seeded shuffle otherwise."""
    n = len(source)
    if kind in ("shards", "remote-shards"):
        return list(range(n))
    return np.random.default_rng(0).permutation(n).tolist()


def storage(m: Measurements, source: Any, indices: list[int], budget_s: float,
            timeline: Timeline, tick: Callable[[], None]) -> list[Any]:
    """Per-sample read latency on one thread (first reads, then the same again), and
    the read rate with the feeder's read concurrency. Returns samples read, for the
    CPU phase, as ``(index, description, sample)``.

    Raises:
        UserCodeError: a read raised (the message names DATA and the sample).
    """
    timeline.start("storage")

    def read(index: int) -> Any:
        return call_user(f"DATA {m.data}: reading sample {index} ({describe(source, index)})",
                         source.read, index)

    first: list[float] = []
    kept: list[Any] = []
    size = 0
    deadline = _now() + budget_s / 3
    pos = 0
    while pos < len(indices) and (_now() < deadline or len(first) < 5) and len(first) < 400:
        t = _now()
        sample = read(indices[pos])
        first.append(_now() - t)
        size += nbytes(image_data(sample))
        if len(kept) < 64:
            kept.append((indices[pos], describe(source, indices[pos]), sample))
        pos += 1
        timeline.tick(1)
    again: list[float] = []
    for i in indices[:min(len(first), 50)]:
        t = _now()
        read(i)
        again.append(_now() - t)
    m.read_ms_first = 1e3 * first[0] if first else None
    m.read_ms = _median_ms(first)
    m.read_ms_p90 = _p90_ms(first)
    m.read_ms_again = _median_ms(again)
    m.bytes_per_sample = size / max(1, len(first))
    tick()
    # Concurrent reads of samples not read yet, as the feeder's read stage (or its
    # decode threads, with read_threads=0) would issue them.
    threads = m.read_threads or m.decode_threads
    m.storage_threads = threads
    rest = indices[pos:] or indices
    lock = threading.Lock()
    state = {"next": 0, "done": 0, "bytes": 0}
    stop_at = _now() + budget_s / 2

    def reader() -> None:
        while _now() < stop_at:
            with lock:
                k = state["next"]
                if k >= len(rest):
                    return
                state["next"] += 1
            b = nbytes(image_data(read(rest[k])))
            with lock:
                state["done"] += 1
                state["bytes"] += b

    t0 = _now()
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="doctor-read") as pool:
        futures = [pool.submit(reader) for _ in range(threads)]
        while not all(f.done() for f in futures):
            concurrent.futures.wait(futures, timeout=0.25)
            timeline.tick()
        for f in futures:
            f.result()
    elapsed = _now() - t0
    m.storage_rate = state["done"] / elapsed if elapsed > 0 else None
    m.storage_mib_s = state["bytes"] / 2**20 / elapsed if elapsed > 0 else None
    tick()
    return kept


def cpu_work(m: Measurements, samples: list[tuple[int, str, Any]], transforms: list[Any],
             budget_s: float, timeline: Timeline, max_pixels: int) -> None:
    """Decode and transform cost per image on one thread, and the ceiling (x cores).

    Raises:
        SampleError: a sample failed to decode or transform (the error names it,
            as the feeder's would).
    """
    timeline.start("cpu")
    # One SampleWork over the repeated samples: after the first round its JPEG
    # region decodes stop after the crop (their bytes were read to their end
    # once: feeder.work.verified), as in a training run's epochs after the first.
    # Each file's index sized as a feeder over these samples would size it.
    work = SampleWork(Chain(list(transforms), None, max_pixels), max_pixels, files=len(samples))
    h, w = work.image_size
    out = np.empty((h, w, 3), np.uint8)
    decode: list[float] = []
    transform: list[float] = []
    import cv2

    saved = cv2.getNumThreads()
    cv2.setNumThreads(1)  # as in the feeder's threads
    try:
        deadline = _now() + budget_s
        k = 0
        while samples and (_now() < deadline or len(decode) < 3) and len(decode) < 2000:
            index, name, sample = samples[k % len(samples)]
            data = image_data(sample)
            key = sample_key(0, k // len(samples), k % len(samples))
            t0 = _now()
            try:
                img, ctx = work.decode(data, key)
            except Exception as exc:
                raise SampleError("decode", index, name, exc) from exc
            t1 = _now()
            try:
                work.transform(img, key, ctx, out)
            except Exception as exc:
                raise SampleError("augment", index, name, exc) from exc
            t2 = _now()
            if k >= 2:  # the first calls warm the code paths
                decode.append(t1 - t0)
                transform.append(t2 - t1)
            k += 1
            timeline.tick(1)
    finally:
        cv2.setNumThreads(saved)
    m.decode_ms = _median_ms(decode)
    m.transform_ms = _median_ms(transform)
    cost = (m.decode_ms or 0.0) + (m.transform_ms or 0.0)
    m.ceiling_rate = m.cores * 1e3 / cost if cost > 0 else None


def _batches(f: Feeder) -> Iterator[tuple[Any, Any]]:
    epoch = 0
    while True:
        f.set_epoch(epoch)
        yield from f
        epoch += 1


def feeder_options(kind: str, device: str) -> dict[str, Any]:
    return {"shuffle": "shards" if kind in ("shards", "remote-shards") else True, "seed": 0,
            "device": device}


def loader_alone(m: Measurements, source: Any, kind: str, transforms: list[Any], budget_s: float,
                 timeline: Timeline) -> None:
    """The feeder with ``"auto"`` threads and nothing else: its rate and stage use."""
    timeline.start("loader alone")
    with Feeder(source, m.batch_size, transforms, **feeder_options(kind, m.device)) as f:
        it = _batches(f)
        next(it)  # the first batch: start-up, not the rate
        n, t0, cpu0 = 0, _now(), time.process_time()
        stats0 = f.stats()
        while _now() - t0 < budget_s:
            x, _ = next(it)
            n += x.shape[0]
            timeline.tick(x.shape[0])
        elapsed = _now() - t0
        cpu = time.process_time() - cpu0
        stats = f.stats()
    m.loader_rate = n / elapsed if elapsed > 0 else None
    m.loader_cpu_cores = cpu / elapsed if elapsed > 0 else None
    m.stage_utilization = {s.name: round(s.utilization, 4) for s in stats.stages if s.threads}
    transfer0, transfer = stats0.stage("transfer"), stats.stage("transfer")
    batches = transfer.items - transfer0.items
    if batches > 0:
        m.transfer_ms = 1e3 * (transfer.busy_s - transfer0.busy_s) / batches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_step(m: Measurements, step: Callable, transforms: list[Any], budget_s: float,
                   timeline: Timeline, max_pixels: int) -> list[float]:
    """The step on a batch already on the device: the rate the loader must reach.
    On CUDA timed with CUDA events."""
    timeline.start("model (synthetic input)")
    h, w = Chain(list(transforms), None, max_pixels).image_size
    device = torch.device(m.device)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (m.batch_size, 3, h, w), dtype=torch.uint8, generator=g)
    images = images.contiguous(memory_format=torch.channels_last).to(device)
    labels = torch.randint(0, 10, (m.batch_size,), generator=g).to(device)
    times: list[float] = []
    step(images, labels)  # warm-up (allocations, cudnn autotuning)
    _sync(device)
    deadline = _now() + budget_s
    while (_now() < deadline or len(times) < 3) and len(times) < 1000:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(images, labels)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = _now()
            step(images, labels)
            times.append(_now() - t)
        timeline.tick(m.batch_size)
    m.step_ms = _median_ms(times)
    m.model_rate = 1e3 * m.batch_size / m.step_ms if m.step_ms else None
    if device.type == "cuda":
        try:
            m.gpu_utilization = float(torch.cuda.utilization(device))
        except Exception:  # noqa: BLE001 - needs pynvml; optional
            m.notes.append("GPU utilization: torch.cuda.utilization() did not answer (pynvml missing?)")
    return times


def fed(m: Measurements, setting: str, source: Any, kind: str, step: Callable,
        transforms: list[Any], budget_s: float, timeline: Timeline, synthetic_ms: float) -> Fed:
    """The step fed by the feeder: the loop's wait share and the step's slowdown."""
    timeline.start(f"fed ({setting})")
    options = feeder_options(kind, m.device)
    if setting == "process":
        options["isolation"] = "process"
    if setting == "tune":
        options["decode_threads"] = "tune"
    device = torch.device(m.device)
    waits: list[float] = []
    steps: list[float] = []
    # "tune" needs its windows' worth of batches to settle (see feeder.engine.tune); a slow
    # step gets up to four times the budget for them.
    least = 3
    if setting == "tune":
        from ..engine import tune as _tune

        # The pass's first batch is untimed, and a shrink is judged on the batch
        # that completes WARMUP + SHRINK_WINDOW; a few more show it held.
        least = _tune.WARMUP + _tune.SHRINK_WINDOW + _tune.GROW_WINDOW
    cap = max(budget_s, 4 * budget_s)
    with Feeder(source, m.batch_size, transforms, **options) as f:
        # The loop's wait for data is what the feeder records as such (blocked on
        # an empty output queue), not the whole time in next(): the rest of next()
        # is the loop's own Python, which the loader's threads slow down as they
        # slow the step (waiting for the GIL), so it counts with the step.
        book = f._engine.book
        it = _batches(f)
        x, y = next(it)
        step(x, y)
        _sync(device)
        t_start = _now()
        images = 0
        while ((_now() - t_start < budget_s or len(steps) < least)
               and (_now() - t_start < cap or len(steps) < 3)):
            waited = book.consumer_wait_s
            t0 = _now()
            x, y = next(it)
            wait = book.consumer_wait_s - waited
            step(x, y)
            _sync(device)
            t2 = _now()
            waits.append(wait)
            steps.append(max(0.0, t2 - t0 - wait))
            images += x.shape[0]
            timeline.tick(x.shape[0])
        elapsed = _now() - t_start
        stats = f.stats()
    active = stats.active() if setting == "tune" else f.config.decode_threads
    if setting == "tune":
        m.tune_history = [(round(t, 3), n) for t, stage, n in stats.active_threads if stage == "decode"]
        if len(steps) + 1 < least:
            m.notes.append(f'decode_threads="tune" ran {len(steps)} batches, fewer than the {least} '
                           f"it needs to settle (a longer --seconds gives it more)")
    step_ms = 1e3 * statistics.median(steps)
    return Fed(setting=setting, batches=len(steps), rate=images / elapsed,
               wait_share=sum(waits) / elapsed, step_ms=step_ms,
               interference=step_ms / synthetic_ms if synthetic_ms > 0 else 1.0,
               active_threads=None if active is None else int(active))


def new_measurements(data: str, source: Any, kind: str, batch_size: int, device: str,
                     transforms_spec: str) -> Measurements:
    cfg = Config.build(reads_may_block(source), batch_size=batch_size, device=device)
    decoder = jpeg_decoder()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return Measurements(load_average=load, data=data, source_kind=kind, samples=len(source), batch_size=batch_size,
                        cores=available_cores(), device=device, transforms=transforms_spec,
                        decode_threads=int(cfg.decode_threads), read_threads=int(cfg.read_threads),
                        jpeg_decoder=str(decoder.get("decoder")),
                        region_decode=bool(decoder.get("region_decode")))
