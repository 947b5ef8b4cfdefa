"""The verdict: a plain function of the measurements, no clock, no threads.

:class:`Measurements` is everything ``feeder-doctor`` measured (it is also the
JSON the doctor writes); :func:`decide` names the bottleneck, the numbers that
decided it and the fix in feeder's terms. The rules, in order:

1. **interference** (a model was given): the training step fed by the feeder's
   threads is more than ``INTERFERENCE_LIMIT`` (1.10x) slower than the same
   step on synthetic input, and that slowdown costs the loop more time per batch
   than its wait for data does.
2. **model**: the loop waits for data at most ``WAIT_OK`` (5%) of its time.
3. Otherwise the loader is the limit (always so without a model), and the part
   of it that limits it is named:

   * **transfer**: the transfer thread is busy ``BUSY`` (85%) of the time or
     more, or could move batches at most 1.3x as fast as the loader delivers
     them (and slower than the cores could decode);
   * **storage**: reading with the feeder's read concurrency gives less than
     ``STORAGE_SHORT`` (0.8x) of what the cores could decode, and either at most
     ``NEAR`` (2x) the loader's rate or less than ``FAR_SHORT`` (0.25x) of the
     cores' rate (storage that slow limits whatever else does);
   * **transforms** or **decode**: the CPU work per image, whichever part of it
     costs more (single thread). When the loader is below ``UNDER_CEILING``
     (60%) of the CPU ceiling, the fix starts with more threads, or, when the
     process got less than ``CPU_SHORT`` (70%) of the cores its threads could
     use, with freeing cores (other processes use them).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

BOTTLENECKS = ("storage", "decode", "transforms", "transfer", "interference", "model")

WAIT_OK = 0.05
INTERFERENCE_LIMIT = 1.10
BUSY = 0.85
NEAR = 2.0
STORAGE_SHORT = 0.8
FAR_SHORT = 0.25
UNDER_CEILING = 0.6
CPU_SHORT = 0.7


@dataclass
class Fed:
    """The model fed by one feeder setting (an entry of :attr:`Measurements.fed`).

    Attributes:
        setting: ``"threads"``, ``"process"`` or ``"tune"``.
        batches: Batches timed.
        rate: Images per second the loop consumed.
        wait_share: Fraction of the loop's time spent waiting in ``next()``.
        step_ms: Median step time (its wait for data excluded), ms.
        interference: ``step_ms`` over the synthetic-input step's median.
        active_threads: Decode threads active at the end (``"tune"``), else the count.
    """

    setting: str
    batches: int
    rate: float
    wait_share: float
    step_ms: float
    interference: float
    active_threads: int | None = None


@dataclass
class Measurements:
    """Every figure the doctor measured, in the units their names say.

    Rates are images (samples) per second; ``None`` where a part was not measured
    (no model given, a phase skipped)."""

    data: str
    source_kind: str
    samples: int
    batch_size: int
    cores: int
    device: str
    transforms: str
    decode_threads: int
    read_threads: int
    jpeg_decoder: str = "simplejpeg"
    region_decode: bool = False
    # storage
    read_ms: float | None = None
    read_ms_p90: float | None = None
    read_ms_first: float | None = None
    read_ms_again: float | None = None
    bytes_per_sample: float | None = None
    storage_threads: int | None = None
    storage_rate: float | None = None
    storage_mib_s: float | None = None
    # CPU work, single thread
    decode_ms: float | None = None
    transform_ms: float | None = None
    ceiling_rate: float | None = None
    # the loader alone, "auto" threads
    loader_rate: float | None = None
    loader_cpu_cores: float | None = None  # CPU this process used while the loader ran alone
    load_average: float | None = None  # the machine's 1-minute load average at the start
    stage_utilization: dict[str, float] = field(default_factory=dict)
    transfer_ms: float | None = None
    # the model on synthetic input
    model: str | None = None
    step_ms: float | None = None
    model_rate: float | None = None
    gpu_utilization: float | None = None
    # the model fed by the feeder
    fed: dict[str, Fed] = field(default_factory=dict)
    tune_history: list[tuple[float, int]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Measurements":
        d = dict(d)
        d["fed"] = {k: Fed(**v) for k, v in d.get("fed", {}).items()}
        d["tune_history"] = [tuple(x) for x in d.get("tune_history", [])]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, path: str) -> "Measurements":
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        return cls.from_dict(doc.get("measurements", doc))


@dataclass
class Verdict:
    """What the doctor concludes.

    Attributes:
        bottleneck: One of :data:`BOTTLENECKS`.
        numbers: The figures that decided it (name -> value, with units in the name).
        fixes: What to change, most useful first, in feeder's terms.
        why: One sentence.
    """

    bottleneck: str
    numbers: dict[str, Any]
    fixes: list[str]
    why: str

    def lines(self) -> list[str]:
        out = [f"bottleneck: {self.bottleneck}", f"  why: {self.why}"]
        out += [f"  {k}: {_fmt(v)}" for k, v in self.numbers.items()]
        out += [f"  fix: {fix}" for fix in self.fixes]
        return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _r(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, 4)


def decide(m: Measurements) -> Verdict:
    """The bottleneck of the measured set-up; see the module docstring for the rules."""
    fed = m.fed.get("threads")
    loader = m.loader_rate or (fed.rate if fed else 0.0)
    nums: dict[str, Any] = {"loader alone img/s": _r(loader)}
    if m.model_rate is not None:
        nums["model needs img/s"] = _r(m.model_rate)
    tune = m.fed.get("tune")
    tune_note = (f'decode_threads="tune" ended at {tune.active_threads} of {m.decode_threads} '
                 f"threads with a wait share of {100 * tune.wait_share:.1f}%"
                 if tune is not None and tune.active_threads is not None else None)
    tune_fewer = tune_note is not None and tune.active_threads < m.decode_threads

    if fed is not None and m.step_ms:
        nums["loop wait share (threads)"] = _r(fed.wait_share)
        nums["step fed / synthetic"] = _r(fed.interference)
        batch_s = m.batch_size / fed.rate if fed.rate > 0 else 0.0
        lost_to_interference = (fed.step_ms - m.step_ms) / 1e3
        lost_to_wait = fed.wait_share * batch_s
        if fed.interference > INTERFERENCE_LIMIT and lost_to_interference > lost_to_wait:
            proc = m.fed.get("process")
            fixes = []
            if proc is not None:
                nums["step fed / synthetic (process)"] = _r(proc.interference)
                nums["loop wait share (process)"] = _r(proc.wait_share)
                if proc.interference < fed.interference:
                    fixes.append(f'isolation="process": the step is {proc.interference:.2f}x the '
                                 f"synthetic one there, against {fed.interference:.2f}x with threads "
                                 f"(loop wait {100 * proc.wait_share:.1f}%)")
            fixes.append('decode_threads="tune" (or fewer decode_threads): fewer threads compete '
                         "with the training thread for the GIL while it launches its work"
                         + (f"; {tune_note}" if tune_note else ""))
            fixes.append("fewer Python-level ops per step (torch.compile, CUDA graphs, fused "
                         "optimizers) make the step less sensitive to other threads")
            return Verdict("interference", nums, fixes,
                           f"the training step runs {fed.interference:.2f}x slower fed by the "
                           f"feeder's threads than on synthetic input, costing "
                           f"{1e3 * lost_to_interference:.1f} ms a batch, more than the "
                           f"{1e3 * lost_to_wait:.1f} ms it waits for data")
        if fed.wait_share <= WAIT_OK:
            fixes = []
            if tune_fewer:
                fixes.append(tune_note + ": the others only compete with the training process")
            elif tune_note:
                fixes.append('decode_threads="tune": the feeder parks the threads the model does not '
                             f"need ({tune_note[len('decode_threads=' + chr(34) + 'tune' + chr(34)) + 1:]})")
            else:
                fixes.append('decode_threads="tune": the feeder parks the threads the model does not need')
            fixes.append(f"the loader has {loader / m.model_rate:.1f}x the model's rate to spare: "
                         "speed the step up (mixed precision, channels_last, torch.compile, a larger "
                         "batch if the GPU is not full), or give the spare CPU to heavier augmentation")
            return Verdict("model", nums, fixes,
                           f"the training loop waits for data only {100 * fed.wait_share:.1f}% of its "
                           f"time: the model's step ({m.step_ms:.1f} ms) sets the pace")
    elif m.model_rate is not None and loader >= m.model_rate * (1 + WAIT_OK) and fed is None:
        # A model without a fed run (should not happen from the CLI): judge by rates.
        return Verdict("model", nums, ['decode_threads="tune"'],
                       f"the loader alone ({loader:.0f} img/s) outruns the model "
                       f"({m.model_rate:.0f} img/s)")

    # The loader is the limit: which part of it?
    ceiling = m.ceiling_rate
    cost_ms = (m.decode_ms or 0.0) + (m.transform_ms or 0.0)
    nums["CPU ceiling img/s"] = _r(ceiling)
    transfer_util = m.stage_utilization.get("transfer")
    transfer_rate = (1e3 * m.batch_size / m.transfer_ms) if m.transfer_ms else None
    if transfer_util is not None and (transfer_util >= BUSY
                                      or (transfer_rate is not None and transfer_rate < 1.3 * loader
                                          and (ceiling is None or transfer_rate < ceiling))):
        nums["transfer thread busy"] = _r(transfer_util)
        nums["transfer ms/batch"] = _r(m.transfer_ms)
        return Verdict("transfer", nums, [
            "deliver uint8 and convert on the device: leave dtype/normalize to the "
            "device-side conversion (normalize=(mean, std) runs after the copy) instead "
            "of converting on the CPU",
            'memory_format="channels_last" (the default; "contiguous" makes a copy on the device)',
            "a larger batch: fewer, larger copies",
            "batch_transforms run in the transfer thread: move heavy ones into the model step"],
            f"the transfer thread is busy {100 * transfer_util:.0f}% of the time "
            f"({m.transfer_ms or 0:.1f} ms a batch)")
    storage = m.storage_rate
    if storage is not None:
        nums["storage img/s"] = _r(storage)
        nums["read ms (one thread, median)"] = _r(m.read_ms)
    if (storage is not None and (ceiling is None or storage < STORAGE_SHORT * ceiling)
            and (storage <= NEAR * loader or (ceiling is not None and storage < FAR_SHORT * ceiling))):
        fixes = []
        if not m.read_threads:
            fixes.append("read_threads=16 or more: reads wait in the decode threads now; a read "
                         "stage overlaps them")
        elif m.storage_threads and m.read_ms and storage < 0.5 * m.storage_threads * 1e3 / m.read_ms:
            fixes.append(f"the storage does not scale with concurrent reads ({storage:.0f} img/s "
                         f"with {m.storage_threads} readers, {1e3 / m.read_ms:.0f} img/s with one): "
                         "its bandwidth or a lock is the limit, more read_threads will not help")
        else:
            fixes.append(f"more read_threads (now {m.read_threads}): reads at {m.read_ms:.1f} ms need "
                         f"about {math.ceil(max(loader, 1.0) * 2 * (m.read_ms or 0) / 1e3)} in flight")
        if m.source_kind in ("folder", "object"):
            fixes.append("pack into shards (feeder-pack DIR OUT): sequential reads of large files "
                         "instead of one small file per sample")
        if m.bytes_per_sample:
            fixes.append(f"re-encode smaller (feeder-pack --max-side 512): "
                         f"{m.bytes_per_sample / 1024:.0f} KiB a sample now; fewer bytes to move")
        if m.source_kind == "remote-shards":
            fixes.append("keep the local cache on (TarShards(cache_dir=...), the default): the "
                         "epochs after the first read from local disk")
        return Verdict("storage", nums, fixes,
                       f"reading alone gives {storage:.0f} img/s, about what the loader delivers "
                       f"({loader:.0f} img/s), while the CPU could decode {ceiling or 0:.0f} img/s")
    nums["decode ms/img"] = _r(m.decode_ms)
    nums["transforms ms/img"] = _r(m.transform_ms)
    fixes = []
    if ceiling and loader < UNDER_CEILING * ceiling:
        got = m.loader_cpu_cores
        if got is not None and got < CPU_SHORT * min(m.cores, m.decode_threads):
            nums["loader CPU cores"] = _r(got)
            fixes.append(f"free cores: the loader reaches {loader:.0f} of the {ceiling:.0f} img/s the "
                         f"cores could decode, but this process got only {got:.2f} of {m.cores} cores"
                         + (f" (load average {m.load_average:.1f})" if m.load_average is not None else "")
                         + ": other processes use the CPU, and more threads will not help")
        else:
            fixes.append(f"more decode_threads (now {m.decode_threads}): the loader reaches "
                         f"{loader:.0f} of the {ceiling:.0f} img/s the cores could decode")
    if (m.transform_ms or 0.0) > (m.decode_ms or 0.0):
        fixes += ["cheaper transforms: fewer or lighter ops, crop before resizing "
                  "(RandomResizedCrop/Resize + CenterCrop first, so the rest runs on the small image)",
                  "move per-batch work to the device: normalize=(mean, std), batch_transforms "
                  "(MixUp, CutMix) run after the copy",
                  "more cores for this process (the CPU ceiling is cost x cores)"]
        return Verdict("transforms", nums, fixes,
                       f"the CPU work limits the loader and the transforms are most of it "
                       f"({m.transform_ms:.2f} of {cost_ms:.2f} ms an image)")
    if not m.region_decode:
        fixes.append("the region decoder (libjpeg-turbo headers at install: see the README) "
                     "decodes only the crop")
    fixes += ["re-encode the images smaller (feeder-pack --max-side 512): decode cost grows with "
              "the pixels stored",
              "more cores for this process (the CPU ceiling is cost x cores)"]
    return Verdict("decode", nums, fixes,
                   f"the CPU work limits the loader and decoding is most of it "
                   f"({m.decode_ms or 0:.2f} of {cost_ms:.2f} ms an image)")
