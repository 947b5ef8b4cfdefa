"""``compare``: the feeder against DataLoader, on the same data, work and cores.

Two phases, both alternating the loaders so that drift in the machine's speed
(thermal, other tenants) lands on all of them alike:

1. *Scan*: every DataLoader ``num_workers`` in ``--workers-grid`` and every
   feeder ``decode x augment`` point in ``--threads-grid``, ``--scan-repeats``
   times each, to pick each loader's best setting.
2. *Rounds*: ``--repeats`` rounds, each measuring in a rotated order the idle
   baseline, the ceiling, the parallel ceiling (the same work in one process
   per core at once), the best DataLoader+PIL, the best DataLoader+cv2, the
   feeder on ``"auto"`` and the feeder at its best grid point. The finalists
   are re-measured here, so the scan's luckiest run does not bias the result.

Reported per row: median images/s, CPU seconds per image, time to first batch,
peak PSS of the process tree and PSS above the idle baseline of the same
round. Ratios between rows are computed within each round, then the median is
taken: a ratio of medians would mix rounds run at different machine speeds.
The parallel ceiling against each DataLoader row is the most any loader could
reach against it in that round.

The last table puts each feeder row against each DataLoader row as a user
weighs them: how much faster, how soon the first batch comes, how much memory
each adds. ``--targets`` adds the project's acceptance targets, measured
against these rows, with the parallel ceiling as the machine's bound.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ..engine.threads import auto_threads, available_cores
from . import report
from .loaders import has_pil
from .measure import RunResult, run_child
from .report import median

log = logging.getLogger(__name__)

MIB = 2**20

ROW_COLUMNS = [
    ("row", "loader", "{}"),
    ("setting", "setting", "{}"),
    ("images_per_s", "img/s", "{:.0f}"),
    ("cpu_ms_per_image", "CPU ms/img", "{:.2f}"),
    ("first_batch_s", "1st batch s", "{:.2f}"),
    ("peak_pss_mib", "peak PSS MiB", "{:.0f}"),
    ("pss_added_mib", "above idle MiB", "{:.0f}"),
    ("of_ceiling", "of ceiling", "{:.0%}"),
    ("of_parallel", "of parallel", "{:.0%}"),
]

SCAN_COLUMNS = [
    ("kind", "loader", "{}"),
    ("setting", "setting", "{}"),
    ("images_per_s", "img/s", "{:.0f}"),
    ("cpu_ms_per_image", "CPU ms/img", "{:.2f}"),
    ("first_batch_s", "1st batch s", "{:.2f}"),
    ("best", "best", "{}"),
]

RATIO_COLUMNS = [
    ("feeder", "feeder", "{}"),
    ("versus", "against", "{}"),
    ("throughput", "speed", "{:.2f}x"),
    ("first_batch_both", "first batch, s", "{}"),
    ("first_batch", "ratio", "{:.2f}x"),
    ("pss_added_both", "memory above idle, MiB", "{}"),
    ("pss_added", "ratio", "{:.2f}x"),
    ("cpu_per_image", "CPU per image", "{:.2f}x"),
]

TARGET_COLUMNS = [
    ("target", "target", "{}"),
    ("measured", "measured", "{:.2f}"),
    ("threshold", "needs", "{}"),
    ("met", "met", "{}"),
    ("bound", "machine bound", "{:.2f}"),
]


def parse_ints(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_threads(text: str) -> list[tuple[int, int]]:
    """``"2x1,4x2"`` -> ``[(2, 1), (4, 2)]`` (decode x augment threads)."""
    points = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            d, a = item.lower().split("x")
            points.append((int(d), int(a)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"threads grid items are DECODExAUGMENT, like 2x1; got {item!r}") from None
    return points


def _setting(spec: dict[str, Any]) -> str:
    if spec["kind"] == "feeder":
        return f"decode={spec['decode_threads']} augment={spec['augment_threads']} queue={spec['queue_size']}"
    return f"num_workers={spec['workers']}"


def _measure(spec: dict[str, Any], label: str) -> RunResult:
    res = run_child(spec)
    if res.ok:
        pss = f", peak PSS {res.peak_pss / MIB:.0f} MiB" if res.peak_pss else ""
        mode = spec.get("mode")
        rate = (f"{res.extra.get('ceiling_images_per_s', 0):.0f} img/s ceiling"
                if mode in ("ceiling", "ceiling-parallel")
                else "idle" if mode == "idle" else f"{res.images_per_s:.0f} img/s")
        report.progress(f"  {label}: {rate}{pss}")
    else:
        report.progress(f"  {label}: FAILED ({res.error[:300]})")
    return res


def scan(args: argparse.Namespace, base: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Phase 1: every grid point; returns the scan rows and the best spec per loader kind."""
    candidates: list[dict[str, Any]] = []
    kinds = (["dl-pil"] if has_pil() else []) + ["dl-cv2"]
    if not has_pil():
        report.progress("Pillow is not installed: the DataLoader+PIL baseline is left out")
    for kind in kinds:
        for w in args.workers_grid:
            candidates.append({**base, "kind": kind, "workers": w, "name": f"{kind} w={w}"})
    for d, a in args.threads_grid:
        candidates.append({**base, "kind": "feeder", "decode_threads": d, "augment_threads": a,
                           "queue_size": args.queue_size, "name": f"feeder {d}x{a}"})
    results: dict[int, list[RunResult]] = {i: [] for i in range(len(candidates))}
    total = args.scan_repeats * len(candidates)
    k = 0
    for r in range(args.scan_repeats):
        order = list(range(len(candidates)))
        if r % 2:
            order.reverse()  # alternate direction so no setting always runs first
        for i in order:
            k += 1
            results[i].append(_measure(candidates[i], f"scan {k}/{total} {candidates[i]['name']}"))
    rows = []
    best: dict[str, dict[str, Any]] = {}
    best_rate: dict[str, float] = {}
    for i, spec in enumerate(candidates):
        ok = [x for x in results[i] if x.ok]
        rate = median([x.images_per_s for x in ok])
        row = {"kind": spec["kind"], "setting": _setting(spec), "images_per_s": rate,
               "cpu_ms_per_image": 1e3 * median([x.cpu_per_image_s for x in ok]),
               "first_batch_s": median([x.first_batch_s for x in ok]),
               "runs": len(ok), "best": ""}
        rows.append(row)
        if ok and rate > best_rate.get(spec["kind"], -1.0):
            best_rate[spec["kind"]] = rate
            best[spec["kind"]] = spec
    for row, spec in zip(rows, candidates):
        if best.get(spec["kind"]) is spec:
            row["best"] = "*"
    return rows, best


def _both(a: float | None, b: float | None, fmt: str) -> str | None:
    """``"0.12 vs 0.40"``; None when either is missing."""
    if a is None or b is None or a != a or b != b:
        return None
    return f"{fmt.format(a)} vs {fmt.format(b)}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def run(args: argparse.Namespace) -> int:
    """The ``compare`` subcommand."""
    base = {"mode": "loader", "root": args.dir, "batch_size": args.batch_size, "epochs": args.epochs,
            "device": args.device, "seed": args.seed, "model": args.model}
    cores = available_cores()
    auto_d, auto_a = auto_threads(cores)
    report.progress(f"compare: scan of {len(args.workers_grid)} worker counts and "
                    f"{len(args.threads_grid)} thread points, {args.scan_repeats} repeat(s)")
    scan_rows, best = scan(args, base)

    finalists: list[tuple[str, dict[str, Any]]] = [
        ("idle", {"mode": "idle", "idle_s": 1.0, "name": "idle"}),
        ("ceiling", {"mode": "ceiling", "root": args.dir, "limit": args.ceiling_images, "name": "ceiling"}),
        ("parallel ceiling", {"mode": "ceiling-parallel", "root": args.dir, "limit": args.ceiling_images,
                              "processes": cores, "name": "parallel ceiling"}),
    ]
    if "dl-pil" in best:
        finalists.append(("DataLoader+PIL", best["dl-pil"]))
    if "dl-cv2" in best:
        finalists.append(("DataLoader+cv2", best["dl-cv2"]))
    finalists.append(("feeder auto", {**base, "kind": "feeder", "decode_threads": auto_d,
                                      "augment_threads": auto_a, "queue_size": args.queue_size,
                                      "name": "feeder auto"}))
    if "feeder" in best:
        finalists.append(("feeder best grid", best["feeder"]))

    rounds: list[dict[str, RunResult]] = []
    for r in range(args.repeats):
        report.progress(f"compare: round {r + 1}/{args.repeats}")
        shift = r % len(finalists)
        order = finalists[shift:] + finalists[:shift]
        got: dict[str, RunResult] = {}
        for label, spec in order:
            got[label] = _measure(spec, label)
        rounds.append(got)

    def per_round(label: str, fn) -> list[float]:
        vals = []
        for got in rounds:
            res = got.get(label)
            if res is not None and res.ok:
                v = fn(got, res)
                if v is not None:
                    vals.append(v)
        return vals

    def added(got: dict[str, RunResult], res: RunResult) -> float | None:
        idle = got.get("idle")
        if res.peak_pss is None or idle is None or not idle.ok or idle.peak_pss is None:
            return None
        return float(res.peak_pss - idle.peak_pss)

    def ceiling_rate(got: dict[str, RunResult]) -> float | None:
        c = got.get("ceiling")
        return c.extra.get("ceiling_images_per_s") if c is not None and c.ok else None

    def parallel_rate(got: dict[str, RunResult]) -> float | None:
        c = got.get("parallel ceiling")  # its images over the span of all its processes
        return c.images_per_s if c is not None and c.ok else None

    rows: list[dict[str, Any]] = []
    for label, spec in finalists:
        if label == "idle":
            rows.append({"row": "idle baseline", "setting": "imports only",
                         "peak_pss_mib": median(per_round(label, lambda g, x: x.peak_pss)) / MIB})
            continue
        if label == "ceiling":
            rows.append({"row": "ceiling", "setting": f"{cores} cores x 1-thread rate",
                         "images_per_s": median(per_round(label, lambda g, x: ceiling_rate(g))),
                         "cpu_ms_per_image": 1e3 * median(per_round(label, lambda g, x: x.cpu_per_image_s)),
                         "of_ceiling": 1.0})
            continue
        if label == "parallel ceiling":
            rows.append({"row": label, "setting": f"{cores} processes at once",
                         "images_per_s": median(per_round(label, lambda g, x: x.images_per_s)),
                         "cpu_ms_per_image": 1e3 * median(per_round(label, lambda g, x: x.cpu_per_image_s)),
                         "of_ceiling": median(per_round(label, lambda g, x: _ratio(x.images_per_s,
                                                                                  ceiling_rate(g)))),
                         "of_parallel": 1.0})
            continue
        pss = median(per_round(label, lambda g, x: x.peak_pss))
        rows.append({
            "row": label, "setting": _setting(spec), "kind": spec["kind"],
            "images_per_s": median(per_round(label, lambda g, x: x.images_per_s)),
            "cpu_ms_per_image": 1e3 * median(per_round(label, lambda g, x: x.cpu_per_image_s)),
            "first_batch_s": median(per_round(label, lambda g, x: x.first_batch_s)),
            "peak_pss_mib": pss / MIB,
            "pss_added_mib": median(per_round(label, added)) / MIB,
            "of_ceiling": median(per_round(label, lambda g, x: _ratio(x.images_per_s, ceiling_rate(g)))),
            "of_parallel": median(per_round(label, lambda g, x: _ratio(x.images_per_s, parallel_rate(g)))),
            "consumer_wait_s": median(per_round(label, lambda g, x: x.extra.get("consumer_wait_s"))),
            "consumer_wait": median(per_round(label, lambda g, x: _ratio(x.extra.get("consumer_wait_s"),
                                                                         x.wall_s))),
            "images": median(per_round(label, lambda g, x: x.images)),
            "repeats_images_per_s": per_round(label, lambda g, x: x.images_per_s),
        })

    by_row = {r["row"]: r for r in rows}
    ratio_rows: list[dict[str, Any]] = []
    feeder_labels = [lb for lb, _ in finalists if lb.startswith("feeder")]
    dl_labels = [lb for lb, _ in finalists if lb.startswith("DataLoader")]
    for f in feeder_labels + ["parallel ceiling"]:
        for d in dl_labels:
            def pr(fn):
                vals = []
                for got in rounds:
                    a, b = got.get(f), got.get(d)
                    if a is not None and b is not None and a.ok and b.ok:
                        v = fn(got, a, b)
                        if v is not None:
                            vals.append(v)
                return median(vals)

            row = {"feeder": f, "versus": d,
                   "throughput": pr(lambda g, a, b: _ratio(a.images_per_s, b.images_per_s))}
            if f != "parallel ceiling":  # the bound: only its rate compares
                row.update(
                    cpu_per_image=pr(lambda g, a, b: _ratio(a.cpu_per_image_s, b.cpu_per_image_s)),
                    first_batch=pr(lambda g, a, b: _ratio(a.first_batch_s, b.first_batch_s)),
                    pss_added=pr(lambda g, a, b: _ratio(added(g, a), added(g, b))),
                    first_batch_both=_both(by_row[f].get("first_batch_s"), by_row[d].get("first_batch_s"),
                                           "{:.2f}"),
                    pss_added_both=_both(by_row[f].get("pss_added_mib"), by_row[d].get("pss_added_mib"),
                                         "{:.0f}"))
            ratio_rows.append(row)

    targets = _targets(rows, ratio_rows, rounds) if args.targets else []
    machine = report.machine_info()
    title = (f"compare on {args.dir}: batch {args.batch_size}, {args.epochs} epoch(s), RandomResizedCrop(224)"
             f" + flip, uint8, device {args.device}; median of {args.repeats} rounds\n"
             f"machine: {report.describe_machine(machine)}")
    print(report.format_table(scan_rows, SCAN_COLUMNS, title="scan (best setting per loader marked *)"))
    columns = ROW_COLUMNS
    if args.model:  # the loop does real work: how long it waited for data is the figure that matters
        columns = ROW_COLUMNS[:3] + [("consumer_wait", "loop waited", "{:.1%}")] + ROW_COLUMNS[3:]
    print(report.format_table(rows, columns, title=title))
    print(report.format_table(ratio_rows, RATIO_COLUMNS,
                              title="feeder against DataLoader: speed (images/s, higher is better), the "
                                    "first batch and the memory above idle (feeder vs DataLoader, and "
                                    "their ratio: lower is better), CPU per image (lower is better); "
                                    "ratios are medians of per-round ratios; the parallel ceiling's row "
                                    "is the most any loader could reach"))
    if args.targets:
        print(report.format_table(targets, TARGET_COLUMNS,
                                  title="the project's acceptance targets, for feeder on \"auto\" "
                                        "(machine bound: the parallel ceiling's figure)"))
    meta = {"dir": args.dir, "batch_size": args.batch_size, "epochs": args.epochs, "repeats": args.repeats,
            "scan_repeats": args.scan_repeats, "workers_grid": args.workers_grid,
            "threads_grid": args.threads_grid, "queue_size": args.queue_size, "device": args.device,
            "model": args.model, "auto": [auto_d, auto_a],
            "raw_rounds": [{lb: {"ok": x.ok, "images": x.images, "wall_s": x.wall_s, "cpu_s": x.cpu_s,
                                 "first_batch_s": x.first_batch_s, "peak_pss": x.peak_pss,
                                 "extra": x.extra, "error": x.error}
                            for lb, x in got.items()} for got in rounds]}
    tables = {"scan": scan_rows, "ratios": ratio_rows}
    if args.targets:
        tables["targets"] = targets
    report.write_outputs(args.out, "compare", rows, meta, extra_tables=tables)
    _plot(args.out, rows)
    return 0


def _targets(rows: list[dict[str, Any]], ratio_rows: list[dict[str, Any]],
             rounds: list[dict[str, RunResult]]) -> list[dict[str, Any]]:
    """The project's performance targets, for the feeder on ``"auto"``, against the measurements."""
    by = {r["row"]: r for r in rows}
    ratio = {(r["feeder"], r["versus"]): r for r in ratio_rows}
    out = []

    def add(name: str, measured: float | None, threshold: str, ok: bool | None,
            bound: float | None = None) -> None:
        out.append({"target": name, "measured": measured, "threshold": threshold,
                    "met": "-" if ok is None else ("yes" if ok else "NO"), "bound": bound})

    auto = by.get("feeder auto", {})
    m = auto.get("of_ceiling")
    add("feeder auto img/s / ceiling", m, ">= 0.90", None if m is None else m >= 0.9,
        by.get("parallel ceiling", {}).get("of_ceiling"))
    for dl, need in (("DataLoader+cv2", 1.25), ("DataLoader+PIL", 2.0)):
        r = ratio.get(("feeder auto", dl))
        if r is None:
            continue
        add(f"img/s vs {dl}", r["throughput"], f">= {need}", r["throughput"] >= need,
            ratio.get(("parallel ceiling", dl), {}).get("throughput"))
        add(f"1st batch vs {dl}", r["first_batch"], "<= 0.5", r["first_batch"] <= 0.5)
        add(f"added PSS vs {dl}", r["pss_added"], "<= 0.5",
            None if r["pss_added"] is None else r["pss_added"] <= 0.5)
    vals = []
    for got in rounds:
        a, b = got.get("feeder auto"), got.get("feeder best grid")
        if a is not None and b is not None and a.ok and b.ok and b.images_per_s > 0:
            vals.append(a.images_per_s / b.images_per_s)
    if vals:
        m = median(vals)
        add("feeder auto / best grid img/s", m, ">= 0.90", m >= 0.9)
    return out


def _plot(out_dir: str, rows: list[dict[str, Any]]) -> None:
    plt = report.pyplot()
    if plt is None:
        return
    import os

    shown = [r for r in rows if r.get("images_per_s") is not None and "ceiling" not in r["row"]]
    ceiling = next((r["images_per_s"] for r in rows if r["row"] == "ceiling"), None)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [f"{r['row']}\n{r['setting']}" for r in shown]
    ax.barh(names, [r["images_per_s"] for r in shown], color="tab:blue")
    parallel = next((r["images_per_s"] for r in rows if r["row"] == "parallel ceiling"), None)
    if ceiling:
        ax.axvline(ceiling, color="tab:red", linestyle="--", label=f"ceiling {ceiling:.0f} img/s")
    if parallel:
        ax.axvline(parallel, color="tab:orange", linestyle=":",
                   label=f"parallel ceiling {parallel:.0f} img/s")
    if ceiling or parallel:
        ax.legend(loc="lower right", fontsize=7)
    ax.set_xlabel("images/s (median of rounds)")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "compare.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    report.progress(f"wrote {path}")
