"""The verdict: a plain function of the measurements, no clock, no threads.

:class:`Measurements` is everything ``feeder-doctor`` measured (it is also the
JSON the doctor writes); :func:`decide` names the bottleneck, the numbers that
decided it and the fix in feeder's terms.

**Noise.** Every figure the verdict rests on is measured in ``ROUNDS`` (5) or
more repeats: the model's step on synthetic input and each fed setting in
interleaved rounds (a fed step is compared with the synthetic step of its own
round, so a machine whose speed drifts between phases does not make a ratio),
the other figures in consecutive parts of their phase. A figure is its median,
its spread the lowest and highest repeat. A rule holds when it holds in every
round but at most ``OUTLIERS`` (1 in each 5), and fails when it holds in at most
that many. A slower step also holds when a rank test over all rounds (the fed
steps against the synthetic ones, exact Mann-Whitney) leaves it at most a
``RANK_P`` (5%) chance of being noise and the medians differ by more than the
limit: a CPU step's own speed can swing from round to round more than the
pairing cancels. When the first ``ROUNDS`` disagree, the doctor runs up to
``EXTRA_ROUNDS`` (5) more; if the repeats still fall on both sides of a
threshold, the verdict is ``inconclusive``, says which figure straddled which
threshold, and what to run for longer. A fix is advised only when the doctor measured it helping: its
loop's rate above the threads' rate in every repeat (its lowest above their
highest); what was not measured is listed as something to try.

**Load.** The CPU time other processes used while the doctor ran (and the load
average before and after) is measured; when other work used more than
``LOADED_CORES`` (0.5) of a core or ``LOADED_SHARE`` (25%) of the cores,
whichever is more, the verdict warns of it first.

The rules, in order (each must hold in every round but one):

1. **cores** (a model was given): the model's step uses the CPU (at least
   ``CPU_HEAVY``, 0.5 of a core on synthetic input, 1.5 on CUDA; on a loaded
   machine, or ``HEAVY_OF_FREE``, half the cores other processes left it), and the
   step's cores, the cores the loader needs to feed it (CPU cost per image x
   the model's rate) and the other processes' cores add up to more than
   ``SHARED`` (90%) of the cores; and in every round the loop loses time, to a
   slower step or to waiting for data (or the rank test finds the step slower);
   or, beside other work (more than ``LOADED_CORES``), even the step's lowest
   round, the loader's need and the others' cores exceed ``SHARED`` of the
   cores: the synthetic step then already ran short of cores.
2. **interference** (a model was given): the training step fed by the feeder's
   threads is more than ``INTERFERENCE_LIMIT`` (1.10x) slower than the same
   step on synthetic input in the same round, and that slowdown costs the loop
   more time per batch than its wait for data does.
3. **model**: the loop waits for data at most ``WAIT_OK`` (5%) of its time
   (and its step is not slowed as in rule 2).
4. Otherwise (the loop waits more than 5% in every round, or no model was
   given) the loader is the limit, and the part of it that limits it is named:

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

5. **inconclusive**: rules 1-3 hold in two or more rounds, and fail in two or more.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

BOTTLENECKS = ("storage", "decode", "transforms", "transfer", "interference", "cores", "model",
               "inconclusive")

# Repeats of each figure. With 5, a setting no better than the threads is above
# them in every round by chance once in 252 runs (3 would give once in 20).
ROUNDS = 5
# Rounds a verdict's rule may disagree in, per ROUNDS rounds (one round of five
# that a burst of other work slowed must not make every verdict inconclusive);
# none for a fix.
OUTLIERS = 1
# Rounds of the model the doctor adds, at most, when the first ROUNDS disagree.
EXTRA_ROUNDS = 5
WAIT_OK = 0.05
INTERFERENCE_LIMIT = 1.10
BUSY = 0.85
NEAR = 2.0
STORAGE_SHORT = 0.8
FAR_SHORT = 0.25
UNDER_CEILING = 0.6
CPU_SHORT = 0.7
LOADED_CORES = 0.5
# cores: a loader that needs less than this many cores to feed the step is not
# given whole cores of its own (a split or a pinning would take a whole core from
# the step for a fraction's use).
SMALL_NEED = 0.5
LOADED_SHARE = 0.25
CPU_HEAVY = 0.5
CPU_HEAVY_CUDA = 1.5
SHARED = 0.9
# On a loaded machine, the share of the cores other processes left that a step
# takes to count as CPU-heavy.
HEAVY_OF_FREE = 0.5
# The chance a rank test may leave for "the fed steps are slower than the
# synthetic ones" to be noise (one-sided): with 5 rounds a side it holds when at
# most 4 of the 25 pairs of a synthetic and a fed round have the fed one faster.
RANK_P = 0.05


@dataclass(frozen=True)
class Spread:
    """A figure measured in repeats: their median, lowest and highest."""

    median: float
    lo: float
    hi: float
    n: int

    def text(self, fmt: str = ".3g", scale: float = 1.0, unit: str = "") -> str:
        return (f"{scale * self.median:{fmt}}{unit} [{scale * self.lo:{fmt}}-"
                f"{scale * self.hi:{fmt}}, {self.n} repeats]")


def spread(values: list[float] | None) -> Spread | None:
    """The spread of ``values`` (finite ones), or None with fewer than ``ROUNDS``."""
    vals = [float(v) for v in values or () if v is not None and math.isfinite(v)]
    if len(vals) < ROUNDS:
        return None
    return Spread(statistics.median(vals), min(vals), max(vals), len(vals))


def _rank_counts(n: int, m: int) -> list[int]:
    """How many of the ``C(n+m, n)`` orderings of ``n`` and ``m`` values give each
    Mann-Whitney count ``U`` (0..n*m): the statistic's exact distribution, no ties."""
    # ways[i][j][u]: orderings of i and j values with count u, built one value at a time
    ways = [[[1] if i == 0 or j == 0 else [] for j in range(m + 1)] for i in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            # the largest value is one of the i (it beats all j: u grows by j) or of the j
            a, b = ways[i - 1][j], ways[i][j - 1]
            row = [0] * (i * j + 1)
            for u, c in enumerate(a):
                row[u + j] += c
            for u, c in enumerate(b):
                row[u] += c
            ways[i][j] = row
    return ways[n][m]


def slower(base: list[float], other: list[float]) -> float | None:
    """The one-sided chance (exact Mann-Whitney rank test) of ``other`` being
    at least this much above ``base`` if both were repeats of one figure: small when
    ``other``'s repeats lie above ``base``'s. Ties count a half; None with fewer
    than ``ROUNDS`` finite values on a side."""
    a = [v for v in base if v is not None and math.isfinite(v)]
    b = [v for v in other if v is not None and math.isfinite(v)]
    if len(a) < ROUNDS or len(b) < ROUNDS:
        return None
    # U: pairs in which base's value is the larger (few when other is slower)
    u = sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in a for y in b)
    counts = _rank_counts(len(a), len(b))
    return sum(counts[: math.floor(u) + 1]) / sum(counts)


@dataclass
class Fed:
    """The model fed by one feeder setting (an entry of :attr:`Measurements.fed`).

    Attributes:
        setting: ``"threads"``, ``"process"`` or ``"tune"``.
        batches: Batches timed.
        rate: Images per second the loop consumed (median of the rounds).
        wait_share: Fraction of the loop's time spent waiting in ``next()``.
        step_ms: Median step time (its wait for data excluded), ms.
        interference: ``step_ms`` over the synthetic-input step's median.
        active_threads: Decode threads active at the end (``"tune"``), else the count.
        rate_rounds: ``rate`` of each round (``"tune"``: of each part of its run).
        wait_share_rounds: ``wait_share`` of each round.
        step_ms_rounds: ``step_ms`` of each round.
        interference_rounds: Each round's step over the synthetic step of the
            same round (``"tune"``: over the synthetic median).
    """

    setting: str
    batches: int
    rate: float
    wait_share: float
    step_ms: float
    interference: float
    active_threads: int | None = None
    rate_rounds: list[float] = field(default_factory=list)
    wait_share_rounds: list[float] = field(default_factory=list)
    step_ms_rounds: list[float] = field(default_factory=list)
    interference_rounds: list[float] = field(default_factory=list)


@dataclass
class Measurements:
    """Every figure the doctor measured, in the units their names say.

    Rates are images (samples) per second; ``None`` where a part was not measured
    (no model given, a phase skipped). ``*_rounds`` hold the repeats of a figure
    (see the module docstring); the figure itself is their median."""

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
    seconds: float | None = None  # --seconds
    # storage
    read_ms: float | None = None
    read_ms_p90: float | None = None
    read_ms_first: float | None = None
    read_ms_again: float | None = None
    bytes_per_sample: float | None = None
    storage_threads: int | None = None
    storage_rate: float | None = None
    storage_rate_rounds: list[float] = field(default_factory=list)
    storage_mib_s: float | None = None
    # CPU work, single thread
    decode_ms: float | None = None
    decode_ms_rounds: list[float] = field(default_factory=list)
    transform_ms: float | None = None
    transform_ms_rounds: list[float] = field(default_factory=list)
    # Most samples had the chain's crop, resize and flip fused into their decode
    # (counted in decode_ms, as the engine runs them).
    fused: bool = False
    ceiling_rate: float | None = None
    # the loader alone, "auto" threads
    loader_rate: float | None = None
    loader_rate_rounds: list[float] = field(default_factory=list)
    loader_cpu_cores: float | None = None  # CPU this process used while the loader ran alone
    load_average: float | None = None  # the machine's 1-minute load average at the start
    load_average_end: float | None = None  # ... and at the end
    # Cores' worth of CPU time other processes (not the doctor, not its workers)
    # used: the machine's busy time less this process tree's, by phase and over the run.
    other_cores: dict[str, float] = field(default_factory=dict)
    other_cores_run: float | None = None
    stage_utilization: dict[str, float] = field(default_factory=dict)
    transfer_ms: float | None = None
    # the model on synthetic input
    model: str | None = None
    step_ms: float | None = None
    step_ms_rounds: list[float] = field(default_factory=list)
    step_cpu_cores: float | None = None  # CPU the process used while the synthetic step ran
    step_cpu_cores_rounds: list[float] = field(default_factory=list)
    torch_threads: int | None = None  # torch.get_num_threads()
    model_rate: float | None = None
    gpu_utilization: float | None = None
    # the model fed by the feeder
    fed: dict[str, Fed] = field(default_factory=dict)
    tune_history: list[tuple[float, int]] = field(default_factory=list)
    tune_pass_batches: int | None = None  # batches in one pass of the "tune" run
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
        fixes: What to change, most useful first, in feeder's terms: each one
            either follows from the bottleneck measured or was measured helping.
        why: One sentence.
        spreads: For the numbers measured in repeats: name -> [lowest, highest].
        warnings: What the reader must know first (other work competing for the CPU).
        tries: What was not measured but may help (``inconclusive``: what to run).
        unhelpful: Settings measured that did not help beyond the noise.
    """

    bottleneck: str
    numbers: dict[str, Any]
    fixes: list[str]
    why: str
    spreads: dict[str, list[float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    tries: list[str] = field(default_factory=list)
    unhelpful: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"warning: {w}" for w in self.warnings]
        out += [f"bottleneck: {self.bottleneck}", f"  why: {self.why}"]
        for k, v in self.numbers.items():
            s = self.spreads.get(k)
            out.append(f"  {k}: {_fmt(v)}" + (f" [{_fmt(s[0])}-{_fmt(s[1])}]" if s else ""))
        out += [f"  fix: {fix}" for fix in self.fixes]
        out += [f"  try: {t}" for t in self.tries]
        out += [f"  measured, not advised: {u}" for u in self.unhelpful]
        return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _r(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, 4)


class _Numbers:
    """The numbers of a verdict and the spreads of those measured in repeats."""

    def __init__(self) -> None:
        self.numbers: dict[str, Any] = {}
        self.spreads: dict[str, list[float]] = {}

    def add(self, name: str, value: float | None, rounds: list[float] | None = None) -> None:
        """``value``, or where it was measured in rounds their median (the figure the
        report prints, with the lowest and highest in brackets)."""
        self.numbers[name] = _r(value)
        s = spread(rounds)
        if s is not None:
            self.numbers[name] = _r(s.median)
            self.spreads[name] = [_r(s.lo), _r(s.hi)]

    def verdict(self, bottleneck: str, fixes: list[str], why: str, **more: Any) -> Verdict:
        return Verdict(bottleneck, self.numbers, fixes, why, self.spreads, **more)


def _pct(s: Spread) -> str:
    return s.text(".1f", 100, "%")


def loaded(m: Measurements) -> str | None:
    """The warning when other work competed for the CPU during the run, else None."""
    limit = max(LOADED_CORES, LOADED_SHARE * m.cores)
    loads = [f"{x:.1f}" for x in (m.load_average, m.load_average_end) if x is not None]
    load = f"load average {' then '.join(loads)} on {m.cores} cores" if loads else f"{m.cores} cores"
    other = m.other_cores_run
    if other is None:
        if m.load_average is None or m.load_average <= limit:
            return None
        return (f"other work competes for the CPU ({load} before the doctor started): every "
                f"figure below was measured beside it")
    if other <= limit and max(m.other_cores.values(), default=0.0) <= max(2 * limit, 1.0):
        return None
    worst = max(m.other_cores, key=m.other_cores.get) if m.other_cores else None
    return (f"other work competes for the CPU: other processes (or the host, taking this "
            f"machine's CPU time: steal) used {other:.2f} of the {m.cores} cores during the run"
            + (f" (up to {m.other_cores[worst]:.2f} during {worst})" if worst else "")
            + f"; {load}. Every figure below was measured beside it: a verdict that depends "
            "on the cores may differ on a quiet machine")


def decide(m: Measurements) -> Verdict:
    """The bottleneck of the measured set-up; see the module docstring for the rules."""
    v = _decide(m)
    warning = loaded(m)
    if warning is not None:
        v.warnings.insert(0, warning)
    return v


def _decide(m: Measurements) -> Verdict:
    fed = m.fed.get("threads")
    loader = m.loader_rate or (fed.rate if fed else 0.0)
    out = _Numbers()
    out.add("loader alone img/s", loader, m.loader_rate_rounds)
    if m.model_rate is not None:
        out.add("model needs img/s", m.model_rate,
                [1e3 * m.batch_size / s for s in m.step_ms_rounds if s and s > 0])
    if fed is not None and m.step_ms:
        v = _model_side(m, fed, loader, out)
        if v is not None:
            return v
    elif m.model_rate is not None and loader >= m.model_rate * (1 + WAIT_OK) and fed is None:
        # A model without a fed run (should not happen from the CLI): judge by rates.
        return out.verdict("model", [], f"the loader alone ({loader:.0f} img/s) outruns the model "
                                        f"({m.model_rate:.0f} img/s)", tries=['decode_threads="tune"'])
    return _loader_side(m, loader, out)


@dataclass
class _Round:
    ratio: float  # fed step over the same round's synthetic step
    lost_step_s: float  # what the slower step costs a batch
    lost_wait_s: float  # what the wait for data costs a batch
    wait_share: float

    @property
    def slowed(self) -> bool:
        return self.ratio > INTERFERENCE_LIMIT and self.lost_step_s > self.lost_wait_s

    @property
    def waiting(self) -> bool:
        return self.wait_share > WAIT_OK


def _rounds(m: Measurements, fed: Fed) -> list[_Round]:
    n = min(len(m.step_ms_rounds), len(fed.step_ms_rounds), len(fed.wait_share_rounds),
            len(fed.rate_rounds))
    out = []
    for synth, step, wait, rate in zip(m.step_ms_rounds[:n], fed.step_ms_rounds, fed.wait_share_rounds,
                                       fed.rate_rounds):
        if not (synth and synth > 0 and rate and rate > 0):
            continue
        out.append(_Round(step / synth, (step - synth) / 1e3, wait * m.batch_size / rate, wait))
    return out


def _outliers(flags: list[bool]) -> int:
    return max(1, len(flags) * OUTLIERS // ROUNDS)


def _most(flags: list[bool]) -> bool:
    """The rule holds in every round but at most ``OUTLIERS`` in each ``ROUNDS``."""
    return sum(flags) >= len(flags) - _outliers(flags)


def _few(flags: list[bool]) -> bool:
    """The rule holds in at most ``OUTLIERS`` rounds in each ``ROUNDS``."""
    return sum(flags) <= _outliers(flags)


def _count(flags: list[bool]) -> str:
    return f"{sum(flags)} of {len(flags)} rounds"


def _compare(m: Measurements, setting: str, base: Fed) -> tuple[bool, str] | None:
    """Whether ``setting`` was measured helping (its loop's rate above the threads'
    in every repeat), and the figures that say so; None where it was not measured."""
    f = m.fed.get(setting)
    if f is None:
        return None
    label = 'isolation="process"' if setting == "process" else f'decode_threads="{setting}"'
    a, b = spread(f.rate_rounds), spread(base.rate_rounds)
    if a is None or b is None:
        return False, f"{label}: measured in fewer than {ROUNDS} repeats, its help unknown"
    ratio = spread(f.interference_rounds)
    step = (f"; its step {ratio.text('.2f', unit='x')} the synthetic one" if ratio is not None else "")
    text = f"{label}: the loop ran at {a.text('.0f', unit=' img/s')} against {b.text('.0f', unit=' img/s')} with threads{step}"
    if a.lo > b.hi:
        return True, text
    return False, text + ": not faster beyond the noise"


def _measured_fixes(m: Measurements, fed: Fed, settings: tuple[str, ...]) -> tuple[list[str], list[str]]:
    fixes, unhelpful = [], []
    for setting in settings:
        res = _compare(m, setting, fed)
        if res is not None:
            (fixes if res[0] else unhelpful).append(res[1])
    return fixes, unhelpful


def _tune_note(m: Measurements) -> str | None:
    tune = m.fed.get("tune")
    if tune is None or tune.active_threads is None:
        return None
    return (f'decode_threads="tune" ended at {tune.active_threads} of {m.decode_threads} '
            f"threads with a wait share of {100 * tune.wait_share:.1f}%")


def _inconclusive(m: Measurements, out: _Numbers, reasons: list[str]) -> Verdict:
    longer = f"--seconds {2 * m.seconds:g}" if m.seconds else "a longer --seconds"
    tries = [f"run the doctor for longer ({longer}): more batches in each round narrow the spread"]
    if loaded(m) is not None:
        tries.append("run it when the machine is quieter: other processes' CPU use moves every "
                     "figure from round to round")
    return out.verdict("inconclusive", [], "the repeats disagree: " + "; ".join(reasons), tries=tries)


def _model_side(m: Measurements, fed: Fed, loader: float, out: _Numbers) -> Verdict | None:
    """The verdict when a model was given: cores, interference, model, inconclusive,
    or None for the loader's side."""
    rounds = _rounds(m, fed)
    out.add("loop wait share (threads)", fed.wait_share, [r.wait_share for r in rounds])
    out.add("step fed / synthetic", fed.interference, [r.ratio for r in rounds])
    if len(rounds) < ROUNDS:
        return _inconclusive(m, out, [f"the model was measured in {len(rounds)} round(s), fewer than "
                                      f"the {ROUNDS} that give its spread"])
    ratio = spread([r.ratio for r in rounds])
    wait = spread([r.wait_share for r in rounds])
    assert ratio is not None and wait is not None
    slowed = [r.slowed for r in rounds]
    waiting = [r.waiting for r in rounds]
    # All rounds together: a step whose own speed swings from round to round (a CPU
    # step on shared cores) can be slower fed in most rounds' medians and yet not in
    # four pairs of five; the rank test asks whether the fed steps lie above the
    # synthetic ones beyond chance.
    chance = slower(m.step_ms_rounds, fed.step_ms_rounds)
    pooled = (chance is not None and chance <= RANK_P and m.step_ms is not None
              and fed.step_ms is not None and fed.step_ms > INTERFERENCE_LIMIT * m.step_ms)
    if chance is not None:
        out.numbers["chance the fed step is as fast"] = round(chance, 3)
    # Do the step and the loader compete for the same cores?
    cost_ms = (m.decode_ms or 0.0) + (m.transform_ms or 0.0)
    need = m.model_rate * cost_ms / 1e3 if m.model_rate and cost_ms else None
    heavy_at = CPU_HEAVY_CUDA if m.device.startswith("cuda") else CPU_HEAVY
    step_cpu = m.step_cpu_cores
    other = m.other_cores_run or 0.0
    beside = (m.other_cores or {}).get("model (synthetic input)", other)
    if beside > max(LOADED_CORES, LOADED_SHARE * m.cores):
        # Other processes held the cores while the step ran alone: it got what they
        # left, and is CPU-heavy when it took most of that.
        heavy_at = min(heavy_at, HEAVY_OF_FREE * max(m.cores - beside, 0.0))
    shared = (step_cpu is not None and step_cpu >= heavy_at and need is not None
              and step_cpu + need + other > SHARED * m.cores)
    if shared:
        hurt = [s or w for s, w in zip(slowed, waiting)]
        # Beside other work the synthetic step already ran short of cores, so a fed
        # step no slower than it says nothing of the cores: when even the step's
        # lowest round, the loader's need and the others' use exceed the machine,
        # the cores are the limit whatever the rounds show.
        lowest = min(m.step_cpu_cores_rounds or [step_cpu or 0.0])
        crowded = (beside > max(LOADED_CORES, LOADED_SHARE * m.cores)
                   and lowest + (need or 0.0) + other > SHARED * m.cores)
        if _most(hurt) or pooled or crowded:
            return _cores(m, fed, out, ratio, wait, need or 0.0, cost_ms, hurt, chance)
        if not _few(hurt):
            return _inconclusive(m, out, [
                f"the step and the loader share the cores, and the loop lost time to it (a step "
                f"slower than {INTERFERENCE_LIMIT:.2f}x its synthetic one, or a wait above "
                f"{100 * WAIT_OK:.0f}%) in {_count(hurt)}: step {ratio.text('.2f', unit='x')}, "
                f"wait {_pct(wait)}"])
        return _model(m, fed, loader, out)
    lost_step = statistics.median(r.lost_step_s for r in rounds)
    lost_wait = statistics.median(r.lost_wait_s for r in rounds)
    if _most(slowed) or (pooled and lost_step > lost_wait):
        return _interference(m, fed, out, rounds, ratio, chance)
    if _few(slowed) and _few(waiting):
        return _model(m, fed, loader, out)
    if _few(slowed) and _most(waiting):
        return None
    reasons = []
    if not _few(slowed) and not _most(slowed):
        reasons.append(f"the step fed by the threads is {ratio.text('.2f', unit='x')} its synthetic "
                       f"time: slower than {INTERFERENCE_LIMIT:.2f}x, at more cost than the wait, in "
                       f"{_count(slowed)}")
    if not _few(waiting) and not _most(waiting):
        reasons.append(f"the loop waits for data {_pct(wait)} of its time: above "
                       f"{100 * WAIT_OK:.0f}% in {_count(waiting)}")
    if not reasons:  # slowed in none, waiting in every round and slowed in some: both limit it
        reasons.append(f"the loop both waits ({_pct(wait)}) and runs a slower step "
                       f"({ratio.text('.2f', unit='x')}) in different rounds")
    return _inconclusive(m, out, reasons)


def _pooled(flags: list[bool], chance: float | None) -> str:
    """How many rounds a rule held in, and the rank test over all rounds."""
    text = _count(flags)
    if chance is not None:
        text += (f"; over all rounds the fed steps lie above the synthetic ones with a "
                 f"{100 * chance:.1f}% chance of noise (rank test)")
    return text


def _interference(m: Measurements, fed: Fed, out: _Numbers, rounds: list[_Round],
                  ratio: Spread, chance: float | None = None) -> Verdict:
    proc = m.fed.get("process")
    if proc is not None:
        out.add("step fed / synthetic (process)", proc.interference, proc.interference_rounds)
        out.add("loop wait share (process)", proc.wait_share, proc.wait_share_rounds)
    fixes, unhelpful = _measured_fixes(m, fed, ("process", "tune"))
    tries = []
    if proc is None:
        tries.append('isolation="process": the loader\'s threads in a worker process share no GIL '
                     "with the step (not measured here: run without --no-process to measure it)")
    if not any(f.startswith('decode_threads="tune"') for f in fixes):
        note = _tune_note(m)
        tries.append('fewer decode_threads: fewer threads compete with the training thread for the '
                     "GIL while it launches its work" + (f" ({note})" if note else ""))
    tries.append("fewer Python-level ops per step (torch.compile, CUDA graphs, fused optimizers) "
                 "make the step less sensitive to other threads")
    lost_step = statistics.median(r.lost_step_s for r in rounds)
    lost_wait = statistics.median(r.lost_wait_s for r in rounds)
    return out.verdict("interference", fixes,
                       f"the training step runs {ratio.text('.2f', unit='x')} slower fed by the "
                       f"feeder's threads than on synthetic input in the same round, costing "
                       f"{1e3 * lost_step:.1f} ms a batch, more than the {1e3 * lost_wait:.1f} ms "
                       f"it waits for data, in {_pooled([r.slowed for r in rounds], chance)}",
                       tries=tries,
                       unhelpful=unhelpful)


def _cores(m: Measurements, fed: Fed, out: _Numbers, ratio: Spread, wait: Spread, need: float,
           cost_ms: float, hurt: list[bool], chance: float | None) -> Verdict:
    other = m.other_cores_run
    out.add("step CPU cores (synthetic input)", m.step_cpu_cores, m.step_cpu_cores_rounds)
    out.add("cores the loader needs at the model's rate", need)
    if other is not None:
        out.add("cores other processes used", other)
    out.numbers["cores"] = m.cores
    if m.torch_threads is not None:
        out.numbers["torch threads"] = m.torch_threads
    out.numbers["decode_threads"] = m.decode_threads
    proc = m.fed.get("process")
    if proc is not None:
        out.add("loop img/s (threads)", fed.rate, fed.rate_rounds)
        out.add("loop img/s (process)", proc.rate, proc.rate_rounds)
    fixes, unhelpful = _measured_fixes(m, fed, ("process", "tune"))
    loader_cores = max(1, math.ceil(need))
    step_cores = max(1, m.cores - loader_cores)
    feeding = (f"feeding the model needs about {need:.2f} cores ({cost_ms:.2f} ms an image x "
               f"{m.model_rate or 0:.0f} img/s)")
    if need < SMALL_NEED:
        # A whole core taken from the step for a loader that needs a fraction of
        # one slows the step more than the loader's competition did.
        tries = [f"decode_threads=1 and torch's threads left on every core: {feeding}, a "
                 f"fraction of one core, so splitting whole cores would take more from the "
                 f"step than the loader takes from it"]
    else:
        tries = [f"split the cores: torch.set_num_threads({step_cores}) in the training process "
                 f"and decode_threads={loader_cores}: {feeding}, and torch's "
                 f"{m.torch_threads or 'default'} threads take every core otherwise"]
    if m.cores >= 2 and need >= SMALL_NEED:
        lo = ",".join(str(c) for c in range(loader_cores))
        hi = ",".join(str(c) for c in range(loader_cores, m.cores)) or lo
        tries.append(f"pin them apart (Linux): os.sched_setaffinity(0, {{{lo}}}) before each pass's "
                     f"first next(), which starts the loader's threads (or its worker, with "
                     f"isolation=\"process\") that inherit it, then os.sched_setaffinity(0, {{{hi}}}) "
                     "in the training thread")
    if proc is None:
        tries.append('isolation="process": the loader in a worker process, which can be pinned and '
                     "niced apart (not measured here: run without --no-process)")
    if m.device == "cpu":
        tries.append("the step on a GPU leaves the cores to the loader")
    tune = m.fed.get("tune")
    tuned = [f for f in fixes if f.startswith('decode_threads="tune"')]
    if tuned and tune is not None and tune.active_threads < m.decode_threads:
        # "tune" measured the split's loader half: fewer decode threads fed the loop
        # faster. The fix is the split, with that run as its evidence.
        fixes.remove(tuned[0])
        fixes.insert(0, f"{tries.pop(0)} (measured: {tuned[0]}, ending at {tune.active_threads} "
                        f"of {m.decode_threads} decode threads)")
    if other is not None and other > max(LOADED_CORES, LOADED_SHARE * m.cores):
        tries.insert(0, f"free cores: other processes used {other:.2f} of the {m.cores}")
    return out.verdict(
        "cores", fixes,
        f"the model's step and the loader compete for the same {m.cores} cores: the step used "
        f"{m.step_cpu_cores:.2f} cores on synthetic input and feeding it needs about {need:.2f} "
        f"more" + (f", while other processes used {other:.2f}" if other else "")
        + f"; fed by the threads the step ran {ratio.text('.2f', unit='x')} its synthetic time and "
        f"the loop waited {_pct(wait)} of its time; the loop lost time in {_pooled(hurt, chance)}",
        tries=tries, unhelpful=unhelpful)


def _model(m: Measurements, fed: Fed, loader: float, out: _Numbers) -> Verdict:
    fixes, tries, unhelpful = [], [], []
    tune = m.fed.get("tune")
    note = _tune_note(m)
    if tune is not None and note is not None and tune.active_threads < m.decode_threads:
        a, b = spread(tune.rate_rounds), spread(fed.rate_rounds)
        if a is not None and b is not None and a.hi >= b.lo:
            fixes.append(note + f", the loop at {a.text('.0f', unit=' img/s')} against "
                         f"{b.text('.0f', unit=' img/s')} with every thread: the others only "
                         "compete with the training process")
        else:
            unhelpful.append(note + (f", but the loop ran slower ({a.text('.0f', unit=' img/s')} "
                                     f"against {b.text('.0f', unit=' img/s')})" if a and b else
                                     f", measured in fewer than {ROUNDS} repeats"))
    else:
        tries.append('decode_threads="tune": the feeder parks the threads the model does not need'
                     + (f" ({note}: it found none to park)" if note else ""))
    fixes.append(f"the loader has {loader / m.model_rate:.1f}x the model's rate to spare: "
                 "speed the step up (mixed precision, channels_last, torch.compile, a larger "
                 "batch if the GPU is not full), or give the spare CPU to heavier augmentation")
    wait = spread(fed.wait_share_rounds)
    return out.verdict("model", fixes,
                       f"the training loop waits for data only "
                       f"{_pct(wait) if wait else f'{100 * fed.wait_share:.1f}%'} of its time, "
                       f"and its step is not slowed: the model's step ({m.step_ms:.1f} ms) sets "
                       "the pace", tries=tries, unhelpful=unhelpful)


def _loader_side(m: Measurements, loader: float, out: _Numbers) -> Verdict:
    """The loader is the limit: which part of it?"""
    ceiling = m.ceiling_rate
    cost_ms = (m.decode_ms or 0.0) + (m.transform_ms or 0.0)
    out.add("CPU ceiling img/s", ceiling)
    transfer_util = m.stage_utilization.get("transfer")
    transfer_rate = (1e3 * m.batch_size / m.transfer_ms) if m.transfer_ms else None
    if transfer_util is not None and (transfer_util >= BUSY
                                      or (transfer_rate is not None and transfer_rate < 1.3 * loader
                                          and (ceiling is None or transfer_rate < ceiling))):
        out.add("transfer thread busy", transfer_util)
        out.add("transfer ms/batch", m.transfer_ms)
        return out.verdict("transfer", [
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
        out.add("storage img/s", storage, m.storage_rate_rounds)
        out.add("read ms (one thread, median)", m.read_ms)
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
        return out.verdict("storage", fixes,
                           f"reading alone gives {storage:.0f} img/s, about what the loader delivers "
                           f"({loader:.0f} img/s), while the CPU could decode {ceiling or 0:.0f} img/s")
    out.add("decode ms/img", m.decode_ms, m.decode_ms_rounds)
    out.add("transforms ms/img", m.transform_ms, m.transform_ms_rounds)
    fixes: list[str] = []
    tries: list[str] = []  # not measured (see "Fixes are measured")
    if ceiling and loader < UNDER_CEILING * ceiling:
        got = m.loader_cpu_cores
        if got is not None and got < CPU_SHORT * min(m.cores, m.decode_threads):
            out.add("loader CPU cores", got)
            fixes.append(f"free cores: the loader reaches {loader:.0f} of the {ceiling:.0f} img/s the "
                         f"cores could decode, but this process got only {got:.2f} of {m.cores} cores"
                         + (f" (load average {m.load_average:.1f})" if m.load_average is not None else "")
                         + ": other processes use the CPU, and more threads will not help")
        elif m.decode_threads < m.cores:
            tries.append(f"more decode_threads (now {m.decode_threads}, on {m.cores} cores): the "
                         f"loader reaches {loader:.0f} of the {ceiling:.0f} img/s the cores could "
                         f"decode")
        else:
            # Threads on every core already: more of them only hand the GIL over
            # more often (Performance: small images; thread_count.py measured it).
            tries.append(f"the loader reaches {loader:.0f} of the {ceiling:.0f} img/s the cores "
                         f"could decode with a decode thread per core already: one process's "
                         f"threads lose the rest handing the GIL over per sample, and more "
                         f"threads would hand it over more (see the performance guide, small "
                         f"images); cheaper work per sample, below, raises both")
    dec, tra = spread(m.decode_ms_rounds), spread(m.transform_ms_rounds)
    close = (" (decode and transforms are within each other's noise: both count)"
             if dec is not None and tra is not None and dec.lo <= tra.hi and tra.lo <= dec.hi else "")
    if (m.transform_ms or 0.0) > (m.decode_ms or 0.0):
        fixes += ["cheaper transforms: fewer or lighter ops, crop before resizing "
                  "(RandomResizedCrop/Resize + CenterCrop first, so the rest runs on the small image)",
                  "move per-batch work to the device: normalize=(mean, std), batch_transforms "
                  "(MixUp, CutMix) run after the copy",
                  "more cores for this process (the CPU ceiling is cost x cores)"]
        return out.verdict("transforms", fixes,
                           f"the CPU work limits the loader and the transforms are most of it "
                           f"({m.transform_ms:.2f} of {cost_ms:.2f} ms an image){close}",
                           tries=tries)
    if not m.region_decode:
        fixes.append("the region decoder (libjpeg-turbo headers at install: see the README) "
                     "decodes only the crop")
    fixes += ["re-encode the images smaller (feeder-pack --max-side 512): decode cost grows with "
              "the pixels stored",
              "more cores for this process (the CPU ceiling is cost x cores)"]
    return out.verdict("decode", fixes,
                       f"the CPU work limits the loader and decoding is most of it "
                       f"({m.decode_ms or 0:.2f} of {cost_ms:.2f} ms an image){close}",
                       tries=tries)
