"""``feeder-doctor``: is the loader the bottleneck of this training set-up, and what to change.

::

    feeder-doctor DATA [--model MODULE:FUNCTION | --model builtin | --step-ms MS]
                  [--batch-size N] [--transforms train|eval|MODULE:NAME] [--device D]
                  [--seconds S] [--out DIR]

``DATA`` is what a ``Feeder`` reads: an image folder, shards (a folder of
``.tar``, a ``.json`` shard list, a brace pattern, an ``http(s)://`` or fsspec
URL) or ``MODULE:NAME`` naming a source object (or a function returning one).
In about ``--seconds`` it measures, with a progress bar:

* storage: per-sample read latency on one thread (first reads and the same
  samples again) and the read rate with the feeder's read concurrency;
* the CPU cost per image of decoding and of the transforms (one thread), and
  the machine's ceiling (cost x cores); the feeder's rate alone (``"auto"``);
* the model step on synthetic input already on the device (``--model``: your
  function, called with a batch on the device, or ``builtin``; ``--step-ms``: a
  simulated step); on CUDA timed with CUDA events;
* the model fed by the feeder: threads, ``isolation="process"`` and
  ``decode_threads="tune"``: the loop's rate and wait share and its step
  against the synthetic one (the interference). The synthetic step and the
  threads and process settings run in ``ROUNDS`` interleaved rounds (up to
  ``EXTRA_ROUNDS`` more when the first disagree on the verdict), the other
  figures over as many parts of their phase: each figure has its spread;
* the machine: the load average, and the CPU other processes used in each
  phase (the doctor's worker process counts as the doctor's).

Then :func:`feeder.doctor.verdict.decide` names the bottleneck (``storage``,
``decode``, ``transforms``, ``transfer``, ``interference``, ``cores`` or
``model``; ``inconclusive`` when the rounds disagree), the numbers that decided
it with their spreads, the fixes measured helping and what to try; a loaded
machine is said first. ``MODULE:NAME`` arguments import from the current
folder, as ``python -m`` does. ``--out`` receives ``report.txt``,
``doctor.json`` (every measurement and the verdict) and ``doctor.png`` (with
matplotlib, ``pip install 'feeder[doctor]'``).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import sys
import time
from typing import Any

from ..errors import error_line
from .verdict import BOTTLENECKS, EXTRA_ROUNDS, ROUNDS, Fed, Measurements, Verdict, decide

__all__ = ["BOTTLENECKS", "Fed", "Measurements", "Verdict", "decide", "main", "run"]

log = logging.getLogger(__name__)

# Shares of --seconds per phase (storage, CPU work, loader alone, synthetic step,
# then each fed setting; the model's and the threads' and process' shares are
# split between the rounds), chosen so each figure rests on at least a second or
# so at the default of 60 s. A slow step stretches them (see measure.ROUND_BATCHES).
SHARES = {"storage": 0.15, "cpu": 0.10, "loader": 0.20, "model": 0.10, "fed": 0.15}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="feeder-doctor",
        description="Measure storage, decoding, transforms, the model step and the feeder feeding "
                    "it; name the bottleneck and the fix.")
    p.add_argument("data", metavar="DATA",
                   help="an image folder, shards (folder of .tar, .json list, brace pattern, "
                        "http(s):// or fsspec URL), or MODULE:NAME of a source object")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", default=None,
                   help="MODULE:FUNCTION called as fn(images, labels) with a batch on the device, "
                        "or 'builtin' (feeder's ResNet-style training step)")
    g.add_argument("--step-ms", type=float, default=None, help="a simulated model step of MS ms")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--transforms", default="train",
                   help="train (RandomResizedCrop(224)+flip), eval (Resize(256)+CenterCrop(224)) "
                        "or MODULE:NAME of a transform list (default train)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--seconds", type=float, default=60.0,
                   help="about how long all the measurements take (default 60)")
    p.add_argument("--out", default=None, help="folder for report.txt, doctor.json, doctor.png "
                                               "(default: ./feeder-doctor-<date>-<time>)")
    p.add_argument("--no-process", action="store_true",
                   help='skip the isolation="process" run (it starts a worker process)')
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the full traceback instead of one line")
    return p


def _out_dir(out: str | None) -> str:
    path = out or f"feeder-doctor-{time.strftime('%Y%m%d-%H%M%S')}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out {path!r} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:  # a file on the way, no permission: before any measurement
        raise ValueError(f"--out {path!r}: cannot make the folder: {exc.strerror or exc}") from None
    return path


def _device(name: str) -> Any:
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                             f"CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"--device {name!r}: the doctor measures on cpu or cuda")
    return device


def run(args: argparse.Namespace) -> tuple[Measurements, Verdict, str]:
    """Measure, decide, write the outputs; returns them and the report text."""
    from tqdm import tqdm

    from . import measure
    from .report import plot, report_text

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not (math.isfinite(args.seconds) and args.seconds > 0):  # nan passes a plain "<= 0"
        raise ValueError(f"--seconds must be a finite number > 0, got {args.seconds}")
    _device(args.device)
    out = _out_dir(args.out)
    source, kind = measure.open_source(args.data)
    transforms = measure.open_transforms(args.transforms)
    step, model_name = measure.open_model(args.model, args.step_ms, args.device)
    if len(source) < args.batch_size:
        # Every batch would hold the whole source: the model's needed rate (taken
        # at --batch-size) would be against batches this small, and the verdict wrong.
        raise ValueError(f"{args.data} has {len(source)} samples, fewer than one batch of "
                         f"--batch-size {args.batch_size}; pass a smaller --batch-size (the "
                         f"training run's own) or more data")
    m = measure.new_measurements(args.data, source, kind, args.batch_size, args.device, args.transforms)
    m.model = model_name
    m.seconds = args.seconds
    if kind == "remote-shards":
        m.notes.append("remote shards were read without the local cache (the first epoch's condition)")
    S = args.seconds
    settings = [] if step is None else ["threads"] + ([] if args.no_process else ["process"])
    phases = ["storage", "cpu", "loader"] + (["model", *settings] * ROUNDS + ["tune"] if step else [])
    timeline = measure.Timeline(m.timeline)
    # No monitor thread: a running thread would make isolation="process" spawn, not fork.
    tqdm.monitor_interval = 0
    bar = tqdm(total=len(phases), desc="feeder-doctor", unit="phase", disable=args.quiet,
               file=sys.stderr, leave=False)
    max_pixels = 1 << 28

    def phase(name: str) -> None:
        bar.set_postfix_str(name)

    try:
        phase("storage: read latency and rate")
        samples = measure.storage(m, source, measure.order(source, kind), S * SHARES["storage"],
                                  timeline, bar.refresh)
        bar.update()
        phase("decode and transforms, one thread")
        measure.cpu_work(m, samples, transforms, S * SHARES["cpu"], timeline, max_pixels)
        bar.update()
        phase('the feeder alone, "auto" threads')
        measure.loader_alone(m, source, kind, transforms, S * SHARES["loader"], timeline)
        bar.update()
        if step is not None:
            _model_rounds(m, args, source, kind, step, transforms, settings, timeline, bar, phase,
                          max_pixels)
    finally:
        bar.close()
        timeline.finish(m)
        try:
            m.load_average_end = os.getloadavg()[0]
        except (AttributeError, OSError):
            pass
    verdict = decide(m)
    text = report_text(m, verdict)
    with open(os.path.join(out, "report.txt"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "doctor.json"), "w", encoding="utf-8") as f:
        json.dump({"command": " ".join(["feeder-doctor", *getattr(args, "argv", [])]),
                   "measurements": m.to_dict(), "verdict": vars(verdict)}, f, indent=2)
    png = plot(m, verdict, os.path.join(out, "doctor.png"))
    if png is None:
        note = "matplotlib not installed: no doctor.png (pip install 'feeder[doctor]')"
        text = text.replace("\nbottleneck:", f"\n({note})\nbottleneck:", 1)
        print(note, file=sys.stderr)
        with open(os.path.join(out, "report.txt"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return m, verdict, text


def _merge(m: Measurements, rounds: dict[str, list[Fed]], synthetic: list[float]) -> None:
    from . import measure

    for setting, got in rounds.items():
        if got:
            m.fed[setting] = measure.merge_rounds(got, synthetic)


def _settled(m: Measurements, rounds: dict[str, list[Fed]], synthetic: list[float],
             timeline: Any = None) -> bool:
    """Whether the rounds so far give a verdict (any but ``inconclusive``), with the
    other processes' CPU use over the phases ``timeline`` ended so far."""
    trial = copy.copy(m)
    trial.fed = dict(m.fed)
    if timeline is not None:
        timeline.record(trial)
    _merge(trial, rounds, synthetic)
    return decide(trial).bottleneck != "inconclusive"


def _model_rounds(m: Measurements, args: argparse.Namespace, source: Any, kind: str, step: Any,
                  transforms: list[Any], settings: list[str], timeline: Any, bar: Any, phase: Any,
                  max_pixels: int) -> None:
    """The model on synthetic input and fed by each setting, in ``ROUNDS`` interleaved
    rounds (each fed round is compared with the synthetic round just before it, so
    the machine's drift between phases does not make a ratio), then the
    ``decode_threads="tune"`` run, long enough in batches for it to shrink."""
    from . import measure

    S = args.seconds
    rounds: dict[str, list[Fed]] = {s: [] for s in settings}
    synthetic: list[float] = []
    fsrc = None
    tune_least = measure.tune_batches()
    tune_budget = S * SHARES["fed"]
    r = 0
    while r < ROUNDS or (r < ROUNDS + EXTRA_ROUNDS and not _settled(m, rounds, synthetic, timeline)):
        if r == ROUNDS:
            bar.total += EXTRA_ROUNDS * (1 + len(settings))  # the extra rounds, at most
        of = ROUNDS if r < ROUNDS else ROUNDS + EXTRA_ROUNDS
        phase(f"the model on synthetic input (round {r + 1} of {of})")
        measure.synthetic_step(m, step, transforms, S * SHARES["model"] / ROUNDS, timeline, max_pixels)
        synthetic.append(m.step_ms_rounds[-1])
        bar.update()
        if fsrc is None:
            # Passes long enough that no fed run restarts its pipeline within its
            # batches: as many as the model could take in the longest run, and the
            # batches "tune" needs in one pass.
            most = math.ceil(1.2 * 4 * tune_budget * (m.model_rate or 0.0) / m.batch_size)
            fsrc, m.tune_pass_batches = measure.fed_source(source, kind, m.batch_size,
                                                           min(max(tune_least, most), 100_000))
        for setting in settings:
            if r and not rounds[setting]:
                bar.update()
                continue  # it failed in an earlier round
            phase(f"the model fed by the feeder ({setting}, round {r + 1} of {of})")
            try:
                rounds[setting].append(measure.fed(m, setting, fsrc, kind, step, transforms,
                                                   S * SHARES["fed"] / ROUNDS, timeline,
                                                   synthetic[-1]))
            except Exception as exc:  # noqa: BLE001 - one setting failing is a finding, not the end
                if setting == "threads":
                    raise
                m.notes.append(f"the {setting} run failed: {type(exc).__name__}: {exc}")
                rounds[setting] = []
            bar.update()
        r += 1
    if r > ROUNDS:
        m.notes.append(f"the first {ROUNDS} rounds of the model disagreed: {r - ROUNDS} more were "
                       f"run ({r} in all)")
    _merge(m, rounds, synthetic)
    phase('the model fed by the feeder (decode_threads="tune")')
    try:
        # A slow step may take up to the whole --seconds again for the batches
        # "tune" needs to shrink a thread (a note says when even that was short).
        m.fed["tune"] = measure.fed(m, "tune", fsrc, kind, step, transforms, tune_budget, timeline,
                                    m.step_ms or 0.0, least=tune_least, pieces=ROUNDS,
                                    cap_s=max(4 * tune_budget, S))
    except Exception as exc:  # noqa: BLE001
        m.notes.append(f"the tune run failed: {type(exc).__name__}: {exc}")
    else:
        ran = m.fed["tune"].batches
        if (m.tune_pass_batches or 0) < tune_least:
            m.notes.append(f'decode_threads="tune" had passes of {m.tune_pass_batches} batches, fewer '
                           f"than the {tune_least} it needs in one pass to shrink a thread (a new pass "
                           "restarts its windows): its thread count says little; more data per "
                           "pass or a smaller --batch-size gives it more")
        elif ran + 1 < tune_least:
            m.notes.append(f'decode_threads="tune" ran {ran} batches, fewer than the {tune_least} it '
                           f"needs to shrink a thread (the step is slow): its thread count says "
                           f"little; a longer --seconds gives it more")
    bar.update()


def _import_from_here() -> None:
    """``MODULE:NAME`` arguments import from the current folder, as ``python -m`` does."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``feeder-doctor``; returns the exit status: 0, 2 for a bad
    argument, 1 for a failure while measuring, 130 when interrupted (Ctrl-C). An
    error is one line on stderr naming what is at fault (``--debug``: the
    traceback instead)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _import_from_here()
    try:
        _, _, text = run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("feeder-doctor: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"feeder-doctor: error: {error_line(exc)}", file=sys.stderr)
        # ValueError: an argument (or DATA) the doctor cannot use, found before measuring
        return 2 if isinstance(exc, ValueError) else 1
    print(text)
    return 0
