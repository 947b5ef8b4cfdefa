"""``interference``: how much does the loader slow the training thread's own step?

A loader that works in threads of the training process competes with the
training thread for the GIL: every torch call the step makes gives the GIL up
and takes it back, and each time a loader thread may hold it. A loader in
other processes (DataLoader's workers) competes only for the machine. This
command times the training thread's step itself, excluding its wait in
``next()``, while each loader feeds it and while the same loader sits idle.

The steps (``--steps``):

* ``proxy``: a launch-bound step, ``--proxy-ops`` tiny in-place torch ops on a
  256-element tensor on the device: each op is a short C call that releases and
  retakes the GIL, as a kernel launch does (on CUDA, each is a real launch).
* ``model``: one SGD step of the ResNet-style network of
  :mod:`feeder.bench.model` on the first ``--model-batch`` images of each batch
  (the whole batch on CUDA by default, 2 images on the CPU, where the step is
  compute-bound and slow). On CUDA the step is synchronized, so its time
  includes every kernel it launched.

The rows (``--loaders``, :data:`LOADERS`):

* ``alone``: no loader, a synthetic batch prepared beforehand: its fed and idle
  windows differ only in time, so its ratio is the method's noise floor.
* ``work-thread``: one plain Python thread per loader core doing only the
  per-sample work (``ImageFolder.read`` + :func:`~feeder.bench.loaders.sample_work`:
  the engine's own decode and transform) into preallocated batches handed over
  a ``queue.Queue``: the least any in-process thread loader can cost.
* ``feeder``: :class:`feeder.Feeder` with ``decode_threads`` = loader cores,
  transforms inline (the thread engine).
* ``feeder-process``: the same with ``isolation="process"``: the pass's threads
  in one worker process (started while the training thread is pinned to the
  loader cores, so it inherits them), only the transfer in this one.
* ``dataloader``: ``DataLoader`` with ``num_workers`` = loader cores over the
  same per-sample work (``dl-cv2`` of :mod:`feeder.bench.loaders`),
  ``persistent_workers=True``.

A new row is one entry of :data:`LOADERS`: a loader kind and its options (the
``feeder`` kind passes ``options`` to ``Feeder``, so an engine option is a
one-line row).

Roles are pinned to cores where the machine has enough (``--loop-cores``,
``--loader-cores``; default one each). Linux affinity is per thread and a new
thread or process inherits its creator's, so the child process pins its main
(training) thread to the loop cores at once, and pins that thread to the loader
cores only while it builds a loader and calls ``iter()`` on it (which starts
feeder's pass threads, DataLoader's worker processes and, on CUDA, its
pin-memory thread), then back. DataLoader's ``worker_init_fn`` also pins each
worker with ``os.sched_setaffinity``. The training thread's torch runs on
``--loop-cores`` threads.

Every run is a fresh child process (``feeder.bench.runner``, mode
``interference``) without memory sampling (reading a process's PSS takes its
memory-map lock). A round runs every row for every step, in an order rotated
from round to round.

**Windows, not whole runs.** A shared machine's speed drifts by up to 2x
between seconds, so step times of separate runs cannot be compared. Within a
run, after ``--warmup`` batches and ``--capacity-s`` of back-to-back batches
(the loader's capacity), the loop alternates ``--windows`` *fed* windows with
*idle* ones, each ``--window-s`` of steps (:class:`~feeder.bench.fedloop.Windows`). In a fed window
the loop takes a batch every ``batch / (feed_share x capacity)`` seconds and
steps continuously on it between batches, so the loader works all through the
window and the training thread does not sleep in ``next()`` between steps
unless a batch is late (the first step after such a sleep is slow by itself,
loader or not; it is not timed, and counted as a **stall**). Before an idle
window the loop keeps stepping without taking batches until the loader has run
dry (its CPU use below 5% of a core over 0.2 s: :class:`~feeder.bench.fedloop.LoaderCPU`), then times
the same steps with the loader present and idle. Each fed window is compared
with the mean of its two idle neighbours (seconds apart, so drift cancels):

* **loop fed/idle** (the headline): the loop's busy seconds per step, its work
  in ``next()`` and its slow steps included, its sleep waiting for late batches
  not: how much slower the training loop runs;
* **step mean**: the mean timed step. GIL waits make a tail of slow steps (up
  to the interpreter's 5 ms switch interval each), which a mean counts;
* **median**: the median timed step, which that tail does not move.

Each is the median over every fed window of every round; **rounds** the range
of the rounds' own medians of the loop measure; **p99** the slow tail of the
steps. **next() CPU** is the training thread's own work per batch taken.
**loader CPU** is the loader's share of a core in fed and (at most) in idle
windows; **img/s** what it delivered in fed windows.

**Raw data stays out of the results folder.** ``--out`` gets the report
(``interference.csv``, and ``interference.json`` with the command, machine,
settings and rows: kilobytes); every step time of every window (megabytes) is
written gzip-compressed to ``--raw-out`` (default
``$FEEDER_CACHE/bench/interference-<UTC time>.json.gz``, else under
``~/.cache/feeder/bench/``), whose path the summary records. ``--report
FILE`` recomputes the table from such a raw file, compressed or not (also a
full ``interference.json`` of an earlier version).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

import torch

from . import report
from .measure import run_child
from .report import median
from .fedloop import STEPS, split_cores

log = logging.getLogger(__name__)

# The rows: name -> loader kind and options (None: no loader, the baseline).
# ``feeder`` rows pass ``options`` to Feeder as keyword arguments.
LOADERS: dict[str, dict[str, Any] | None] = {
    "alone": None,
    "work-thread": {"kind": "work-thread"},
    "feeder": {"kind": "feeder", "options": {}},
    "feeder-process": {"kind": "feeder", "options": {"isolation": "process"}},
    "dataloader": {"kind": "dl-cv2"},
}

COLUMNS = [
    ("step", "step", "{}"),
    ("loader", "loader", "{}"),
    ("setting", "setting", "{}"),
    ("slowdown", "loop fed/idle", "{:.3f}x"),
    ("slowdown_range", "rounds", "{}"),
    ("step_mean", "step mean", "{:.3f}x"),
    ("step_median", "median", "{:.3f}x"),
    ("idle_ms", "idle ms", "{:.2f}"),
    ("fed_ms", "fed ms", "{:.2f}"),
    ("idle_p99_ms", "p99 idle", "{:.2f}"),
    ("fed_p99_ms", "fed", "{:.2f}"),
    ("next_ms", "next() CPU ms", "{:.2f}"),
    ("images_per_s", "img/s", "{:.0f}"),
    ("loader_busy", "loader CPU fed", "{:.0%}"),
    ("loader_idle", "idle", "{:.0%}"),
    ("stalls", "stalls", "{:d}"),
    ("pairs", "pairs", "{:d}"),
]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _loop_s(window: dict[str, Any]) -> float:
    """The loop's busy seconds per step in a window: its steps (the slow ones after a
    late batch too) and its work in ``next()``, not its sleep there waiting for a
    late batch (that is the loader's capacity, not its interference). An idle
    window has no ``next()``: its steps' mean."""
    if "batches" not in window:  # an idle window
        return _mean(window["steps"])
    return (window["span_s"] - window["slept_s"]) / (len(window["steps"]) + window["stalls"])


def pair_ratios(extra: dict[str, Any], measure: str = "median") -> list[float]:
    """Each fed window over the mean of its two idle neighbours, by ``measure``:

    * ``loop``: the loop's busy seconds per step (:func:`_loop_s`): what the
      training loop's own rate loses, its work taking batches included (needs
      ``slept_s``, recorded since that measure exists: none for older runs);
    * ``mean``: the mean timed step: GIL waits are a tail of slow steps, which a
      mean counts and a median does not;
    * ``median``: the median timed step.
    """
    of = {"loop": _loop_s, "mean": lambda w: _mean(w["steps"]),
          "median": lambda w: statistics.median(w["steps"])}[measure]
    if measure == "loop" and not all("slept_s" in w for w in extra["fed"]):
        return []
    idle = [of(w) if w["steps"] else float("nan") for w in extra["idle"]]
    dry = [w.get("drained", True) for w in extra["idle"]]
    # A fed window next to an idle one that never ran dry has no clean reference.
    return [of(w) / ((idle[k] + idle[k + 1]) / 2)
            for k, w in enumerate(extra["fed"]) if w["steps"] and dry[k] and dry[k + 1]]


# -- the parent: rounds, ratios, report -----------------------------------------------

def _setting(name: str, spec: dict[str, Any]) -> str:
    """The row's loader settings in words (``spec``: the run's base spec or saved meta)."""
    row = LOADERS[name]
    if row is None:
        return "synthetic batch"
    n = spec.get("loader_threads") or len(spec.get("loader_cores") or [None])
    if row["kind"] == "work-thread":
        return f"{n} thread(s), work only"
    if row["kind"] == "feeder":
        extra = "".join(f" {k}={v}" for k, v in (row.get("options") or {}).items())
        return f"decode_threads={n} augment_threads=0{extra}"
    return f"num_workers={n}"


def _p90(values: list[float]) -> float:
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(0.9 * len(vals)))] if vals else float("nan")


def _p99(values: list[float]) -> float:
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(0.99 * len(vals)))] if vals else float("nan")


def summarize(rounds: list[dict[tuple[str, str], dict[str, Any]]], steps: list[str],
              loaders: list[str], batch_size: int = 1) -> list[dict[str, Any]]:
    """The table's rows from the runs of every round.

    ``rounds[r][(step, loader)]`` is that run's report (``ok``, ``images``,
    ``wall_s``, ``extra`` with its ``idle`` and ``fed`` windows). A row's
    ``slowdown`` is the median over every fed window of every round of its
    ``loop`` :func:`pair_ratios` (``step_mean``, ``step_median``: the same by the
    other measures); ``slowdown_range`` the range of the rounds' own medians.
    """
    rows = []
    for step in steps:
        for name in loaders:
            runs = [got[(step, name)] for got in rounds if got.get((step, name), {}).get("ok")]
            by = {m: [pair_ratios(r["extra"], m) for r in runs] for m in ("loop", "mean", "median")}
            ratios = {m: [x for rr in per_round for x in rr] for m, per_round in by.items()}
            medians = [statistics.median(rr) for rr in by["loop"] if rr]
            idle = [x for r in runs for w in r["extra"]["idle"] for x in w["steps"]]
            fed = [x for r in runs for w in r["extra"]["fed"] for x in w["steps"]]
            fed_windows = [w for r in runs for w in r["extra"]["fed"]]
            # (``batches`` per window; runs saved before it was recorded: images / batch size)
            batches = sum(w.get("batches", w["images"] / batch_size) for w in fed_windows)
            rates = [r["images"] / r["wall_s"] for r in runs if r["images"] and r["wall_s"] > 0]
            busy = [w["loader_cpu"] for w in fed_windows]
            rest = [w["loader_cpu"] for r in runs for w in r["extra"]["idle"][1:]]
            # The training thread's own work in next() (its CPU there; runs saved before
            # that was recorded: none).
            next_cpu = (sum(w["next_cpu_s"] for w in fed_windows)
                        if fed_windows and all("next_cpu_s" in w for w in fed_windows) else None)
            rows.append({
                "step": step, "loader": name,
                "idle_ms": 1e3 * _mean(idle) if idle else None,
                "fed_ms": 1e3 * _mean(fed) if fed else None,
                "slowdown": median(ratios["loop"]) if ratios["loop"] else None,
                "slowdown_range": f"{min(medians):.2f}-{max(medians):.2f}" if medians else None,
                "step_mean": median(ratios["mean"]) if ratios["mean"] else None,
                "step_median": median(ratios["median"]) if ratios["median"] else None,
                "idle_p99_ms": 1e3 * _p99(idle) if idle else None,
                "fed_p99_ms": 1e3 * _p99(fed) if fed else None,
                "next_ms": (1e3 * next_cpu / batches if batches and next_cpu is not None
                            and name != "alone" else None),
                "images_per_s": median(rates) if rates else None,
                "loader_busy": median(busy) if busy and name != "alone" else None,
                "loader_idle": max(rest) if rest and name != "alone" else None,
                "stalls": sum(w["stalls"] for w in fed_windows),
                "pairs": len(ratios["mean"]), "runs": len(runs),
                "undrained": sum(1 for r in runs for w in r["extra"]["idle"] if not w["drained"]),
                "per_round_slowdown": medians,
                "capacity_images_per_s": [r["extra"]["capacity_images_per_s"] for r in runs],
            })
    return rows


def run(args: argparse.Namespace) -> int:
    """The ``interference`` subcommand."""
    if args.report:
        return rereport(args)
    if not args.dir:
        raise SystemExit("interference: give a dataset folder (DIR), or --report FILE")
    unknown = [s for s in args.steps if s not in STEPS] + [x for x in args.loaders if x not in LOADERS]
    if unknown:
        raise SystemExit(f"interference: unknown step or loader {unknown[0]!r}; steps: "
                         f"{', '.join(STEPS)}; loaders: {', '.join(LOADERS)}")
    loaders = ["alone"] + [x for x in args.loaders if x != "alone"]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_batch = args.model_batch or (args.batch_size if device == "cuda" else 2)
    cores = sorted(os.sched_getaffinity(0))
    loop_cores, loader_cores = split_cores(cores, args.loop_cores, args.loader_cores)
    pinning = (f"training thread on core(s) {loop_cores}, loader on core(s) {loader_cores}"
               if loop_cores is not None else
               f"not pinned: {len(cores)} core(s) available, "
               f"{args.loop_cores} + {args.loader_cores} needed")
    report.progress(f"interference: {pinning}; device {device}")
    base = {"mode": "interference", "root": args.dir, "batch_size": args.batch_size,
            "queue_size": args.queue_size, "seed": args.seed, "device": device,
            "proxy_ops": args.proxy_ops, "model_batch": model_batch, "warmup": args.warmup,
            "windows": args.windows, "window_s": args.window_s, "feed_share": args.feed_share,
            "capacity_s": args.capacity_s, "loop_cores": loop_cores, "loader_cores": loader_cores,
            "loader_threads": args.loader_cores}
    rounds: list[dict[tuple[str, str], dict[str, Any]]] = []
    for r in range(args.rounds):
        got: dict[tuple[str, str], dict[str, Any]] = {}
        for step in args.steps:
            shift = r % len(loaders)
            for name in loaders[shift:] + loaders[:shift]:
                spec = {**base, "step": step, "loader": LOADERS[name],
                        "name": f"{step} {name}"}
                res = run_child(spec, memory=False)
                got[(step, name)] = {"ok": res.ok, "images": res.images, "wall_s": res.wall_s,
                                     "cpu_s": res.cpu_s, "extra": res.extra, "error": res.error}
                if res.ok:
                    loop, mean = pair_ratios(res.extra, "loop"), pair_ratios(res.extra, "mean")
                    rate = f", {res.images_per_s:.0f} img/s" if res.images else ""
                    text = (f"loop fed/idle {statistics.median(loop):.3f}x, step mean "
                            f"{statistics.median(mean):.3f}x over {len(mean)} windows"
                            if loop and mean else "no window with timed steps")
                    report.progress(f"  round {r + 1}/{args.rounds} {step} {name}: {text}{rate}")
                else:
                    report.progress(f"  round {r + 1}/{args.rounds} {step} {name}: "
                                    f"FAILED ({res.error[:300]})")
        rounds.append(got)
    meta = {"dir": args.dir, "device": device, "steps": list(args.steps), "loaders": loaders,
            "rounds": args.rounds, "batch_size": args.batch_size, "queue_size": args.queue_size,
            "proxy_ops": args.proxy_ops, "windows": args.windows, "window_s": args.window_s,
            "feed_share": args.feed_share, "capacity_s": args.capacity_s,
            "model_batch": model_batch, "warmup": args.warmup,
            "loop_cores": loop_cores, "loader_cores": loader_cores, "pinning": pinning,
            "loader_threads": args.loader_cores, "failed_runs": sum(1 for got in rounds for x in got.values() if not x["ok"]),
            "raw_rounds": [{f"{s} {n}": x for (s, n), x in got.items()} for got in rounds]}
    machine = report.machine_info()
    raw_path = args.raw_out or default_raw_path()
    _report(meta, args.out, machine, raw_path=raw_path)
    return 1 if meta["failed_runs"] else 0


def default_raw_path() -> str:
    """Where a run's raw measurements go without ``--raw-out``: a new file under the
    feeder cache folder (``$FEEDER_CACHE``, else ``~/.cache/feeder``), outside any
    repository, so that a results folder under version control keeps only the report."""
    from ..storage.remote import cache_root

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return os.path.join(cache_root(None) or ".", "bench", f"interference-{stamp}-{os.getpid()}.json.gz")


def write_raw(path: str, doc: dict[str, Any]) -> None:
    """Write the whole run (``doc``: command, machine, meta with ``raw_rounds``, rows) to
    ``path``: gzip-compressed unless the name ends in ``.json`` (the step times
    compress about 4x). Written to a temporary name and renamed, so a reader never
    sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    opener = open if path.endswith(".json") else gzip.open
    with opener(tmp, "wt") as f:
        json.dump(doc, f, default=str)
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    """A JSON file, plain or gzip-compressed (told by its first bytes, not its name)."""
    compressed = False
    try:
        with open(path, "rb") as f:
            compressed = f.read(2) == b"\x1f\x8b"
        opener = gzip.open if compressed else open
        with opener(path, "rt") as f:
            return json.load(f)
    except (OSError, EOFError, ValueError) as exc:
        raise SystemExit(f"interference --report: {path} is not a readable "
                         f"{'gzip-compressed ' if compressed else ''}JSON file: {exc}") from exc


def _report(meta: dict[str, Any], out: str | None, machine: dict[str, Any],
            source: str | None = None, raw_path: str | None = None) -> None:
    """Print the table of a run's measurements (``meta``) and write its files: the
    report to ``out`` (the summary JSON without the per-step data), the whole run
    to ``raw_path`` when given."""
    rounds = [{tuple(key.split(" ", 1)): x for key, x in got.items()} for got in meta["raw_rounds"]]
    rows = summarize(rounds, meta["steps"], meta["loaders"], meta["batch_size"])
    for row in rows:
        row["setting"] = _setting(row["loader"], meta)
    step_text = {"proxy": f"proxy = {meta['proxy_ops']} tiny in-place ops",
                 "model": f"model = ResNet-style SGD step on {meta['model_batch']} image(s)"}
    title = (f"interference on {meta['dir']}: the training loop's time per step and its step "
             f"time, fed against idle; {', '.join(step_text[s] for s in meta['steps'])}; "
             f"device {meta['device']}; batch {meta['batch_size']}; {meta['pinning']}; "
             f"{meta['rounds']} rounds of {meta['windows']} fed windows of {meta['window_s']:g} s, "
             f"each against the idle windows either side (the loader present, run dry); "
             f"fed at {meta['feed_share']:.0%} of the loader's capacity\n"
             f"machine: {report.describe_machine(machine)}")
    if source:
        title += f"\nrecomputed from the measurements saved in {source}"
    print(report.format_table(rows, COLUMNS, title=title))
    summary = {k: v for k, v in meta.items() if k != "raw_rounds"}
    if raw_path:
        write_raw(raw_path, {"command": " ".join(["feeder-bench", *sys.argv[1:]]), "machine": machine,
                             "meta": meta, "rows": rows})
        summary["raw"] = os.path.abspath(raw_path)
        report.progress(f"wrote the raw measurements to {raw_path}")
    elif source:
        summary["raw"] = source
    if out:
        report.write_outputs(out, "interference", rows, summary, machine=machine)


def rereport(args: argparse.Namespace) -> int:
    """``interference --report FILE``: the table of a saved run, by the current measures."""
    doc = read_json(args.report)
    meta = doc.get("meta", {}) if isinstance(doc, dict) else {}
    if "raw_rounds" not in meta or not all("idle" in x.get("extra", {}) for got in meta["raw_rounds"]
                                           for x in got.values() if x.get("ok")):
        where = (f"; it is a summary, its run's raw measurements were written to {meta['raw']}"
                 if isinstance(meta.get("raw"), str) else "")
        raise SystemExit(f"interference --report: {args.report} holds no windowed interference "
                         f"measurements (meta.raw_rounds with idle and fed windows){where}")
    _report(meta, args.out, doc.get("machine") or report.machine_info(), source=args.report,
            raw_path=args.raw_out)
    return 0


def add_parser(sub: Any, default_out_help: str) -> None:
    """The ``interference`` subcommand's arguments (``default_out_help``: where results
    go without ``--out``, as the command line module words it)."""
    def names(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    p = sub.add_parser("interference", help="the training thread's step time alone and while each "
                                            "loader feeds it (GIL interference)")
    p.add_argument("dir", nargs="?", help="ImageFolder dataset root (root/<class>/<image>)")
    p.add_argument("--out", default=None,
                   help=f"folder for CSV/JSON results (default: a new folder, {default_out_help})")
    p.add_argument("--report", default=None, metavar="FILE",
                   help="measure nothing: print the table of a run's saved raw measurements "
                        "(.json or .json.gz, as --raw-out writes them; and write it to --out) by "
                        "the current measures")
    p.add_argument("--raw-out", default=None, metavar="PATH",
                   help="file for the run's raw per-step measurements, gzip-compressed unless it "
                        "ends in .json (default: a new file under $FEEDER_CACHE/bench or "
                        "~/.cache/feeder/bench, outside the results folder)")
    p.add_argument("--seed", type=int, default=0, help="shuffle and augmentation seed")
    p.add_argument("--steps", type=names, default=list(STEPS),
                   help=f"training steps to time (default {','.join(STEPS)})")
    p.add_argument("--loaders", type=names, default=[x for x in LOADERS if x != "alone"],
                   help=f"loaders to feed it; alone is always measured (default "
                        f"{','.join(x for x in LOADERS if x != 'alone')})")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--queue-size", type=int, default=4, help="batches queued ahead (default 4)")
    p.add_argument("--proxy-ops", type=int, default=400, help="tiny ops per proxy step (default 400)")
    p.add_argument("--windows", type=int, default=8,
                   help="fed windows per run, each between two idle ones (default 8)")
    p.add_argument("--window-s", type=float, default=1.0, help="seconds of steps per window (default 1)")
    p.add_argument("--feed-share", type=float, default=0.7,
                   help="fed windows take batches at this share of the loader's capacity (default 0.7)")
    p.add_argument("--capacity-s", type=float, default=1.5,
                   help="seconds of back-to-back batches that measure the capacity (default 1.5)")
    p.add_argument("--model-batch", type=int, default=0,
                   help="images per model step (default: the batch on CUDA, 2 on the CPU)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--loop-cores", type=int, default=1, help="cores of the training thread (default 1)")
    p.add_argument("--loader-cores", type=int, default=1,
                   help="cores of the loader, and its threads or workers (default 1)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
