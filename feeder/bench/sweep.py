"""``sweep``: throughput and starvation over a grid of feeder settings.

The grid is decode threads x augment threads x queue size, each point run
for ``--epochs`` epochs in this process, optionally with a simulated training
step: the consumer sleeps ``--step-ms`` per batch, as it would while a GPU
works (sleeping releases the GIL and the core, as waiting on CUDA does). Then
the table shows both images/s and starvation, the share of the elapsed time
the training loop waited inside ``next()`` (``Stats.consumer_wait_s`` over the
elapsed time). The point ``"auto"`` resolves to is measured as its own row and
marked on the plot.

Every point runs ``--repeats`` times (3 by default), the rounds alternating
their order so that drift in the machine's speed lands on all points alike.
A row shows the median and the spread (lowest to highest run). A point whose
highest run reaches the best point's lowest is *within noise* of the best:
on this machine, in this run, the two cannot be told apart, and the table
marks it ``~best`` (and the plot draws the best point's spread as a band).
One run per point has no spread: then only the best point is marked.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import time
from typing import Any

from .. import Feeder, ImageFolder
from ..engine.config import DEFAULTS
from ..engine.threads import auto_threads, available_cores
from . import report
from .loaders import transforms
from .measure import cpu_seconds, now
from .report import median

log = logging.getLogger(__name__)

COLUMNS = [
    ("step_ms", "step ms", "{:g}"),
    ("decode_threads", "decode", "{:d}"),
    ("augment_threads", "augment", "{:d}"),
    ("queue_size", "queue", "{:d}"),
    ("auto", "auto", "{}"),
    ("images_per_s", "img/s", "{:.0f}"),
    ("spread", "spread img/s", "{}"),
    ("vs_best", "vs best", "{}"),
    ("starvation", "starved", "{:.1%}"),
    ("cpu_ms_per_image", "CPU ms/img", "{:.2f}"),
    ("bottleneck", "busiest stage", "{}"),
]


def measure_point(source: ImageFolder, batch_size: int, decode: int, augment: int, queue: int,
                  epochs: int, step_ms: float, seed: int = 0) -> dict[str, Any]:
    """Run one grid point in this process; return its figures.

    Returns:
        ``images_per_s``, ``starvation`` (consumer wait / elapsed), ``cpu_ms_per_image``,
        ``bottleneck`` and the raw seconds.
    """
    step_s = step_ms / 1000.0
    cpu0 = cpu_seconds()
    t0 = now()
    images = 0
    with Feeder(source, batch_size, transforms(), shuffle=True, decode_threads=decode, augment_threads=augment,
                queue_size=queue, seed=seed) as feeder:
        for _ in range(epochs):
            for batch, _labels in feeder:
                images += batch.shape[0]
                if step_s > 0:
                    time.sleep(step_s)
        elapsed = now() - t0
        stats = feeder.stats()
    cpu_s = cpu_seconds() - cpu0
    return {"images": images, "elapsed_s": elapsed, "images_per_s": images / elapsed,
            "consumer_wait_s": stats.consumer_wait_s, "starvation": stats.consumer_wait_s / elapsed,
            "cpu_ms_per_image": 1e3 * cpu_s / max(1, images), "bottleneck": stats.bottleneck}


def mark_equivalent(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mark the best row and the rows within noise of it; return the best row.

    Each row holds ``images_per_s`` (the median) and ``low``/``high`` (its
    lowest and highest run). The best is the highest median; a row is within
    noise of it when its ``high`` reaches the best's ``low``: the runs of the
    two overlap. Sets ``vs_best`` to ``"best"``, ``"~best"`` or ``""``.
    """
    best = max(rows, key=lambda r: r["images_per_s"])
    for r in rows:
        r["vs_best"] = "best" if r is best else ("~best" if r["high"] >= best["low"] else "")
    return best


def _name(row: dict[str, Any]) -> str:
    return f"{row['decode_threads']}x{row['augment_threads']} q{row['queue_size']}"


def run(args: argparse.Namespace) -> int:
    """The ``sweep`` subcommand."""
    source = ImageFolder(args.dir)
    auto_d, auto_a = auto_threads(available_cores())
    auto_q = DEFAULTS["queue_size"]
    points = list(itertools.product(args.step_ms, args.decode, args.augment, args.queue))
    for step in args.step_ms:
        if (step, auto_d, auto_a, auto_q) not in points:
            points.append((step, auto_d, auto_a, auto_q))
    # One untimed epoch first: the page cache and the code paths are then as
    # warm for the first point as for the last.
    report.progress("sweep: warm-up epoch")
    measure_point(source, args.batch_size, auto_d, auto_a, auto_q, 1, 0.0)
    results: dict[tuple, list[dict[str, Any]]] = {p: [] for p in points}
    total = len(points) * args.repeats
    k = 0
    for r in range(args.repeats):
        order = points if r % 2 == 0 else points[::-1]
        for p in order:
            k += 1
            step, d, a, q = p
            res = measure_point(source, args.batch_size, d, a, q, args.epochs, step, seed=args.seed)
            results[p].append(res)
            report.progress(f"sweep {k}/{total}: step {step:g} ms, decode {d}, augment {a}, queue {q}: "
                            f"{res['images_per_s']:.0f} img/s, starved {res['starvation']:.1%}")
    rows = []
    for p in sorted(points):
        step, d, a, q = p
        rs = results[p]
        rates = [x["images_per_s"] for x in rs]
        rows.append({"step_ms": step, "decode_threads": d, "augment_threads": a, "queue_size": q,
                     "auto": "auto" if (d, a, q) == (auto_d, auto_a, auto_q) else "",
                     "images_per_s": median(rates), "low": min(rates), "high": max(rates),
                     "spread": f"{min(rates):.0f}-{max(rates):.0f}",
                     "starvation": median([x["starvation"] for x in rs]),
                     "cpu_ms_per_image": median([x["cpu_ms_per_image"] for x in rs]),
                     "bottleneck": rs[len(rs) // 2]["bottleneck"],
                     "repeats_images_per_s": [x["images_per_s"] for x in rs]})
    best_rows = []
    for step in args.step_ms:
        at = [r for r in rows if r["step_ms"] == step]
        best = mark_equivalent(at)
        auto = next(r for r in at if r["auto"])
        best_rows.append({"step_ms": step, "best": _name(best), "best_images_per_s": best["images_per_s"],
                          "best_spread": best["spread"],
                          "within_noise": " ".join(_name(r) for r in at if r["vs_best"] == "~best") or "-",
                          "auto_images_per_s": auto["images_per_s"],
                          "auto_of_best": auto["images_per_s"] / best["images_per_s"],
                          "auto_vs_best": auto["vs_best"] or "below"})
    machine = report.machine_info()
    print(report.format_table(rows, COLUMNS, title=(
        f"sweep on {args.dir}: batch {args.batch_size}, {args.epochs} epoch(s) per point, median of "
        f"{args.repeats} (spread: lowest-highest run; ~best: within noise of the best); "
        f"auto = decode {auto_d}, augment {auto_a}, queue {auto_q}\n"
        f"machine: {report.describe_machine(machine)}")))
    print(report.format_table(best_rows, [("step_ms", "step ms", "{:g}"), ("best", "best point", "{}"),
                                          ("best_images_per_s", "best img/s", "{:.0f}"),
                                          ("best_spread", "spread", "{}"),
                                          ("within_noise", "within noise of the best", "{}"),
                                          ("auto_images_per_s", "auto img/s", "{:.0f}"),
                                          ("auto_of_best", "auto/best", "{:.0%}"),
                                          ("auto_vs_best", "auto is", "{}")],
                              title="the best grid point, the points within its noise, and auto"))
    if args.repeats < 2:
        print("one run per point: no spread, so no point can be told within noise of the best; "
              "use --repeats 3 or more before choosing a setting")
    report.write_outputs(args.out, "sweep", rows, {
        "dir": args.dir, "batch_size": args.batch_size, "epochs": args.epochs, "repeats": args.repeats,
        "auto": {"decode_threads": auto_d, "augment_threads": auto_a, "queue_size": auto_q}},
        extra_tables={"auto": best_rows})
    _plot(args.out, rows, (auto_d, auto_a, auto_q), args.step_ms)
    return 0


def _plot(out_dir: str, rows: list[dict[str, Any]], auto: tuple[int, int, int], steps: list[float]) -> None:
    plt = report.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(steps), figsize=(5 * len(steps), 3.8), squeeze=False)
    for ax, step in zip(axes[0], steps):
        at = [r for r in rows if r["step_ms"] == step]
        lines = sorted({(r["augment_threads"], r["queue_size"]) for r in at})
        best = max(at, key=lambda r: r["images_per_s"])
        ax.axhspan(best["low"], best["high"], color="tab:green", alpha=0.15,
                   label=f"best ({_name(best)}): its runs' spread")
        for aug, q in lines:
            pts = sorted((r["decode_threads"], r["images_per_s"], r["low"], r["high"]) for r in at
                         if (r["augment_threads"], r["queue_size"]) == (aug, q))
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                        yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]], marker="o", capsize=3,
                        label=f"{'inline augment' if aug == 0 else f'augment {aug}'}, queue {q}")
        near = [r for r in at if r.get("vs_best") in ("best", "~best")]
        ax.plot([r["decode_threads"] for r in near], [r["images_per_s"] for r in near], marker="o",
                markersize=11, markerfacecolor="none", markeredgecolor="tab:green", linestyle="none",
                label="within noise of the best")
        a = next((r for r in at if r["auto"]), None)
        if a is not None:
            ax.plot([a["decode_threads"]], [a["images_per_s"]], marker="*", markersize=16, color="red",
                    linestyle="none", label=f"auto ({auto[0]}x{auto[1]}, queue {auto[2]})")
        ax.set_title(f"consumer step {step:g} ms/batch")
        ax.set_xlabel("decode threads")
        ax.set_xticks(sorted({r["decode_threads"] for r in at}))
        ax.set_ylabel("images/s (median, bar: lowest-highest run)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "sweep.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    report.progress(f"wrote {path}")
