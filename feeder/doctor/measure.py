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
from ..errors import FieldError, SampleError, SourceError, UserCodeError, call_user
from ..sources import describe
from ..ops.chain import Chain
from ..engine.config import Config
from ..engine.threads import reads_may_block
from ..decode.status import jpeg_decoder
from ..sample import parse_sample, pixels
from ..engine.read import nbytes
from ..sample.rng import sample_key
from ..engine.threads import available_cores
from ..engine.steps import SampleWork
from .verdict import ROUNDS, Fed, Measurements

log = logging.getLogger(__name__)
_now = time.perf_counter

# The fewest steps a round of the synthetic step or of a fed setting times (a
# slow step stretches the round up to four times its budget for them): a round's
# median must not rest on one or two steps a loaded machine slowed.
ROUND_BATCHES = 5


# -- what the command line names -------------------------------------------------------

def load_object(spec: str, what: str, words: str = "") -> Any:
    """``module:name`` -> the object (a source, a transform list, a step function).
    ``words``: the argument's other values, for the message when ``spec`` is no
    ``module:name`` (``"train or eval"``).

    Raises:
        ValueError: the module cannot be found or has no such name.
        UserCodeError: importing the module raised (``what`` names the argument).
    """
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what}: expected {words + ' or ' if words else ''}MODULE:NAME, got {spec!r}")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{spec!r}: cannot import module {module!r}: {exc} (looked in the current "
                         f"folder and on sys.path)") from exc
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
    obj = load_object(spec, what, "train, eval")
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
    fn = load_object(spec, what, "builtin")
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


def sample_bytes(m: Measurements, source: Any, index: int, sample: Any) -> int:
    """The size of ``sample``'s image (:func:`image_data`); a sample it cannot take
    (a read that returned no sample) is checked as a feeder checks it, and named.

    Raises:
        UserCodeError: not a sample (the message names DATA and the sample).
    """
    try:
        return nbytes(image_data(sample))
    except Exception:
        try:  # what the feeder checks of a sample, named as it names it
            parse_sample(sample, source, index)
        except (SourceError, FieldError) as exc:
            raise UserCodeError(f"DATA {m.data}: reading sample {index} ({describe(source, index)}): "
                                f"{exc}") from exc
        raise


def _median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def _p90_ms(values: list[float]) -> float | None:
    return 1e3 * float(np.percentile(values, 90)) if values else None


def parts(values: list[Any], n_parts: int = ROUNDS) -> list[list[Any]]:
    """``values`` cut into ``n_parts`` consecutive runs of (nearly) equal length; none
    when there are fewer values than parts."""
    n = len(values)
    if n < n_parts:
        return []
    return [values[n * k // n_parts:n * (k + 1) // n_parts] for k in range(n_parts)]


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_s() -> float | None:
    """CPU seconds every core of the machine has been busy since boot (``/proc/stat``),
    None where there is no such file."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is counted in user);
    # steal, the host running others on this machine's CPUs, counts as busy: it
    # competes for the cores as other processes do
    return (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / _TICK


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of process ``pid`` from ``/proc/<pid>/stat``; None
    when it is gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
        rest = text[text.rfind(")") + 2:].split()
        return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK  # ppid, utime + stime
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """The live processes below ``root`` (the isolated engine's worker): a scan of
    ``/proc``, some milliseconds; none where there is no ``/proc``."""
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for pid in entries:
        st = _stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, ())
    return found


def tree_cpu_s(pids: list[int] | None = None) -> float:
    """CPU seconds of this process, its ended children and its live ones (a worker
    process of ``isolation="process"`` counts as the doctor's): those of ``pids``,
    or all found by :func:`descendants`."""
    t = os.times()
    live = descendants(os.getpid()) if pids is None else pids
    return (time.process_time() + t.children_user + t.children_system
            + sum(st[1] for st in map(_stat, live) if st is not None))


class Timeline:
    """CPU use of this process and its workers (cores busy), of the other processes,
    and images delivered, per phase over time; the totals per phase give
    :attr:`Measurements.other_cores` (:meth:`finish`)."""

    # Seconds between scans of /proc for the worker process, in a phase that has one
    # (a scan holds the GIL for milliseconds: other phases scan at their ends only).
    SCAN_S = 1.0

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.t0 = _now()
        self.phase = ""
        self.totals: dict[str, list[float]] = {}  # phase -> [wall s, own CPU s, machine busy s]
        self._phase_at: tuple[float, float, float | None] | None = None
        self._known: list[int] = []
        self._scanned = -math.inf
        self._last = self._sample(True) + (0,)

    def _sample(self, scan: bool = False) -> tuple[float, float, float | None]:
        now = _now()
        if scan or ("process" in self.phase and now - self._scanned >= self.SCAN_S):
            self._known, self._scanned = descendants(os.getpid()), now
        return _now(), tree_cpu_s(self._known), machine_busy_s()

    def start(self, phase: str) -> None:
        self._close()
        self.phase = phase
        self._phase_at = self._sample(True)
        self._last = self._phase_at + (0,)

    def _close(self) -> None:
        if self._phase_at is None:
            return
        now, cpu, busy = self._sample(True)
        t0, cpu0, busy0 = self._phase_at
        row = self.totals.setdefault(self.phase, [0.0, 0.0, 0.0])
        row[0] += now - t0
        row[1] += cpu - cpu0
        row[2] += (busy - busy0) if busy is not None and busy0 is not None else math.nan
        self._phase_at = None

    def finish(self, m: Measurements) -> None:
        """End the current phase; record the other processes' CPU use in ``m``."""
        self._close()
        self.record(m)

    def record(self, m: Measurements) -> None:
        """Record in ``m`` the other processes' CPU use over the phases ended so far."""
        rows = [(name, r) for name, r in self.totals.items() if r[0] > 0 and math.isfinite(r[2])]
        m.other_cores = {name: round(max(0.0, (r[2] - r[1]) / r[0]), 3) for name, r in rows}
        wall = sum(r[0] for _, r in rows)
        if wall > 0:
            m.other_cores_run = round(max(0.0, sum(r[2] - r[1] for _, r in rows) / wall), 3)

    def tick(self, images: int = 0, every: float = 0.25) -> None:
        now = _now()
        n = self._last[3] + images
        dt = now - self._last[0]
        if dt < every:
            self._last = self._last[:3] + (n,)
            return
        now, cpu, busy = self._sample()
        dt = now - self._last[0]
        row = {"t": round(now - self.t0, 3), "phase": self.phase,
               "cpu_cores": round((cpu - self._last[1]) / dt, 3), "img_s": round(n / dt, 1)}
        if busy is not None and self._last[2] is not None:
            row["other_cores"] = round(max(0.0, (busy - self._last[2]) / dt - row["cpu_cores"]), 3)
        self.rows.append(row)
        self._last = (now, cpu, busy, 0)


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
        size += sample_bytes(m, source, indices[pos], sample)
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
            b = sample_bytes(m, source, rest[k], read(rest[k]))
            with lock:
                state["done"] += 1
                state["bytes"] += b

    t0 = _now()
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="doctor-read") as pool:
        futures = [pool.submit(reader) for _ in range(threads)]
        marks = [(t0, 0)]  # (time, samples read): the rate over each part of the phase
        while not all(f.done() for f in futures):
            concurrent.futures.wait(futures, timeout=min(0.25, budget_s / 12))
            marks.append((_now(), state["done"]))
            timeline.tick()
        for f in futures:
            f.result()
    elapsed = _now() - t0
    marks.append((t0 + elapsed, state["done"]))
    m.storage_rate = state["done"] / elapsed if elapsed > 0 else None
    m.storage_rate_rounds = rates_by_parts(marks)
    m.storage_mib_s = state["bytes"] / 2**20 / elapsed if elapsed > 0 else None
    tick()
    return kept


def rates_by_parts(marks: list[tuple[float, int]]) -> list[float]:
    """The rate (count per second) over each of ``ROUNDS`` equal parts of the time
    ``marks`` (time, cumulative count) span, from the marks nearest their edges."""
    if len(marks) < ROUNDS + 1:
        return []
    t0, t1 = marks[0][0], marks[-1][0]
    edges = [min(marks, key=lambda mk: abs(mk[0] - (t0 + (t1 - t0) * k / ROUNDS)))
             for k in range(ROUNDS + 1)]
    return [round((b[1] - a[1]) / (b[0] - a[0]), 3) for a, b in zip(edges, edges[1:])
            if b[0] > a[0]]


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
    # once: feeder.decode.verified), as in a training run's epochs after the first.
    # Each file's index sized as a feeder over these samples would size it.
    work = SampleWork(Chain(list(transforms), None, max_pixels), max_pixels, files=len(samples))
    h, w = work.image_size
    out = np.empty((h, w, 3), np.uint8)
    decode: list[float] = []
    transform: list[float] = []
    fused = 0
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
                # As the engine's decode threads do: a JPEG's crop, resize and
                # flip fused into its decode (img None), where the chain allows.
                img, ctx = work.decode_into(data, key, out)
            except Exception as exc:
                raise SampleError("decode", index, name, exc) from exc
            t1 = _now()
            try:
                if img is None:
                    work.finish_into(key, out)
                    fused += 1
                else:
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
    m.fused = fused > k // 2
    m.decode_ms_rounds = [round(_median_ms(part) or 0.0, 4) for part in parts(decode)]
    m.transform_ms_rounds = [round(_median_ms(part) or 0.0, 4) for part in parts(transform)]
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
        cpu0 = tree_cpu_s([])  # threads only: no worker process
        n, t0 = 0, _now()
        stats0 = f.stats()
        marks = [(t0, 0)]
        while _now() - t0 < budget_s or len(marks) < 2 * ROUNDS + 1:
            x, _ = next(it)
            n += x.shape[0]
            marks.append((_now(), n))
            timeline.tick(x.shape[0])
        elapsed = _now() - t0
        cpu = tree_cpu_s([]) - cpu0
        stats = f.stats()
    m.loader_rate = n / elapsed if elapsed > 0 else None
    m.loader_rate_rounds = rates_by_parts(marks)
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
    """One round of the step on a batch already on the device: the rate the loader
    must reach. On CUDA timed with CUDA events. Appends the round's median to
    ``m.step_ms_rounds`` (``m.step_ms`` is the rounds' median) and the cores' worth
    of CPU the process used to ``m.step_cpu_cores_rounds``; returns the round's step
    times (s)."""
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
    cpu0 = tree_cpu_s([])  # the step runs in this process
    t_start = _now()
    deadline = t_start + budget_s
    while (_now() < deadline or len(times) < ROUND_BATCHES) and len(times) < 1000:
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
    wall = _now() - t_start
    cpu = tree_cpu_s([]) - cpu0
    m.step_cpu_cores_rounds.append(round(cpu / wall, 3) if wall > 0 else 0.0)
    m.step_cpu_cores = statistics.median(m.step_cpu_cores_rounds)
    m.step_ms_rounds.append(round(_median_ms(times) or 0.0, 4))
    m.step_ms = statistics.median(m.step_ms_rounds)
    m.model_rate = 1e3 * m.batch_size / m.step_ms if m.step_ms else None
    m.torch_threads = torch.get_num_threads()
    if device.type == "cuda" and m.gpu_utilization is None:
        try:
            m.gpu_utilization = float(torch.cuda.utilization(device))
        except Exception:  # noqa: BLE001 - needs pynvml; optional
            if not any(n.startswith("GPU utilization") for n in m.notes):
                m.notes.append("GPU utilization: torch.cuda.utilization() did not answer (pynvml missing?)")
    return times


class Repeated:
    """``source`` ``times`` over (sample ``i`` is ``source[i % len(source)]``): a pass
    long enough for a fed run's batches, so that no new pass restarts the pipeline
    (and ``"tune"``'s windows) within the run."""

    def __init__(self, source: Any, times: int) -> None:
        self.source = source
        self.times = times
        self.reads_may_block = reads_may_block(source)

    def __len__(self) -> int:
        return self.times * len(self.source)

    def read(self, index: int) -> Any:
        return self.source.read(index % len(self.source))

    def describe(self, index: int) -> str:
        return describe(self.source, index % len(self.source))


def tune_batches() -> int:
    """Batches ``decode_threads="tune"`` needs in one pass to shrink once and show it
    held: the pass's untimed first batch, its warm-up, a shrink window and a grow
    window (see :mod:`feeder.engine.tune`)."""
    from ..engine import tune as _tune

    return 1 + _tune.WARMUP + _tune.SHRINK_WINDOW + _tune.GROW_WINDOW


def fed_source(source: Any, kind: str, batch_size: int, batches: int) -> tuple[Any, int]:
    """The source a fed run reads, and the batches in one of its passes: an image
    folder or a source object repeated until a pass holds ``batches``; shards as
    they are (their order is shard by shard)."""
    n = len(source)
    if kind in ("folder", "object") and n // batch_size < batches:
        source = Repeated(source, math.ceil(batches * batch_size / n))
    return source, len(source) // batch_size


def fed(m: Measurements, setting: str, source: Any, kind: str, step: Callable,
        transforms: list[Any], budget_s: float, timeline: Timeline, synthetic_ms: float,
        least: int = 0, pieces: int = 1, cap_s: float | None = None) -> Fed:
    """The step fed by the feeder: the loop's wait share and the step's slowdown,
    over at least ``budget_s`` and ``max(least, ROUND_BATCHES)`` batches (for at
    most ``cap_s``, default four times the budget; at least 3 batches). ``pieces`` > 1 (``"tune"``'s single long run): the
    figures of each consecutive part of the run are its rounds; else the run is
    one round of the figures."""
    timeline.start(f"fed ({setting})")
    options = feeder_options(kind, m.device)
    if setting == "process":
        options["isolation"] = "process"
    if setting == "tune":
        options["decode_threads"] = "tune"
    device = torch.device(m.device)
    rows: list[tuple[float, float, float, int]] = []  # (wait s, step s, loop s, images) a batch
    cap = 4 * budget_s if cap_s is None else max(budget_s, cap_s)
    least = max(least, ROUND_BATCHES)
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
        while ((_now() - t_start < budget_s or len(rows) < least)
               and (_now() - t_start < cap or len(rows) < 3)):
            waited = book.consumer_wait_s
            t0 = _now()
            x, y = next(it)
            wait = book.consumer_wait_s - waited
            step(x, y)
            _sync(device)
            t2 = _now()
            rows.append((wait, max(0.0, t2 - t0 - wait), t2 - t0, x.shape[0]))
            timeline.tick(x.shape[0])
        stats = f.stats()
    active = stats.active() if setting == "tune" else f.config.decode_threads
    if setting == "tune":
        m.tune_history = [(round(t, 3), n) for t, stage, n in stats.active_threads if stage == "decode"]
    return _fed_figures(setting, rows, synthetic_ms, pieces,
                        None if active is None else int(active))


def _fed_figures(setting: str, rows: list[tuple[float, float, float, int]], synthetic_ms: float,
                 pieces: int, active: int | None) -> Fed:
    def figures(part: list[tuple[float, float, float, int]]) -> tuple[float, float, float]:
        loop = sum(r[2] for r in part)
        return (sum(r[3] for r in part) / loop if loop > 0 else 0.0,
                sum(r[0] for r in part) / loop if loop > 0 else 0.0,
                1e3 * statistics.median(r[1] for r in part))

    rate, wait, step_ms = figures(rows)
    cut = [figures(p) for p in parts(rows, pieces)] if pieces > 1 else [(rate, wait, step_ms)]
    return Fed(setting=setting, batches=len(rows), rate=rate, wait_share=wait, step_ms=step_ms,
               interference=step_ms / synthetic_ms if synthetic_ms > 0 else 1.0,
               active_threads=active,
               rate_rounds=[round(p[0], 3) for p in cut],
               wait_share_rounds=[round(p[1], 5) for p in cut],
               step_ms_rounds=[round(p[2], 4) for p in cut],
               interference_rounds=[round(p[2] / synthetic_ms, 4) if synthetic_ms > 0 else 1.0
                                    for p in cut])


def merge_rounds(rounds: list[Fed], synthetic_ms: list[float]) -> Fed:
    """One :class:`Fed` from the rounds of one setting: its figures the rounds'
    medians, each round's step over the synthetic step of the same round."""
    med = statistics.median
    ratios = [round(r.step_ms / s, 4) if s > 0 else 1.0 for r, s in zip(rounds, synthetic_ms)]
    last = rounds[-1]
    return Fed(setting=last.setting, batches=sum(r.batches for r in rounds),
               rate=med(r.rate for r in rounds), wait_share=med(r.wait_share for r in rounds),
               step_ms=med(r.step_ms for r in rounds), interference=med(ratios),
               active_threads=last.active_threads,
               rate_rounds=[round(r.rate, 3) for r in rounds],
               wait_share_rounds=[round(r.wait_share, 5) for r in rounds],
               step_ms_rounds=[round(r.step_ms, 4) for r in rounds], interference_rounds=ratios)


def new_measurements(data: str, source: Any, kind: str, batch_size: int, device: str,
                     transforms_spec: str) -> Measurements:
    cfg = Config.build(batch_size=batch_size, device=device).resolved(source)
    decoder = jpeg_decoder()
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return Measurements(load_average=load, data=data, source_kind=kind, samples=len(source), batch_size=batch_size,
                        cores=available_cores(), device=device, transforms=transforms_spec,
                        decode_threads=int(cfg.decode_threads), read_threads=int(cfg.read_threads),
                        jpeg_decoder=str(decoder.get("decoder")),
                        region_decode=bool(decoder.get("region_decode")))
