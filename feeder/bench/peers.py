"""``peers``: feeder against other loaders' CPU pipelines, on the same job and cores.

Rows, every one a fresh child process (:mod:`feeder.bench.runner`) per round,
in a rotated order from round to round, all on the same ImageFolder, batch
size and crop side, shuffled, the last batch kept, uint8 output:

* ``feeder``: :class:`feeder.Feeder` with its default settings.
* ``DataLoader (num_workers=N)``: ``torch.utils.data.DataLoader`` over
  :class:`~feeder.bench.loaders.FeederWorkDataset` (feeder's own per-sample
  work), one row per ``--workers-grid`` value, with persistent workers when a
  run has several epochs; the best is marked.
* ``DALI``: NVIDIA DALI's CPU pipeline (:class:`DaliLoader`): file reader,
  ``decoders.image_random_crop``, ``resize``, ``flip``, on ``num_threads`` =
  the cores, through its PyTorch iterator.
* ``SPDL``: SPDL's thread pipeline (:class:`SpdlLoader`): indices, feeder's
  per-sample work in ``concurrency`` = the cores, batches collated in a last
  stage.
* ``bare work``: no loader (:mod:`feeder.bench.bare`): one process per core
  making the per-sample call the DataLoader and SPDL rows make, with nothing
  around it, every file read once first. No loader built on that call can
  pass its steady rate on these cores; it has no first-epoch rate.

A library that is not installed is left out, with a line saying how to
install it. Each run reports when each epoch's last batch came: the *first
epoch* rate counts from building the loader (its start-up included), the
*steady* rate is over epochs 2..N. Ratios to feeder are taken within each
round, then their median.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..engine.threads import available_cores
from . import report
from .loaders import FeederWorkDataset, image_source, transforms
from .measure import RunResult, run_child
from .region import _busy_s, _children_cpu_s
from .report import median

MIB = 2**20

#: Every row kind, in the order of the table.
LOADERS = ("feeder", "dataloader", "dali", "spdl", "bare")


@dataclass(frozen=True)
class Peer:
    """Another library's loader: its name in the table, the module its run imports,
    the distributions that install it and the command that does."""

    label: str
    module: str
    dists: tuple[str, ...]
    install: str


PEERS = {
    "dali": Peer("DALI", "nvidia.dali", ("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110"),
                 "pip install nvidia-dali-cuda120"),
    "spdl": Peer("SPDL", "spdl.pipeline", ("spdl",), "pip install spdl"),
}


def installed(name: str) -> bool:
    """Whether peer ``name``'s module can be found (it is not imported here)."""
    try:
        return importlib.util.find_spec(PEERS[name].module) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def version(name: str) -> str | None:
    """The installed version of peer ``name``, from its distribution's metadata."""
    for dist in PEERS[name].dists:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# -- the peers' loaders, built in the child process of a run --------------------------------

#: The modules each peer's loader imports.
_MODULES = {"dali": ("nvidia.dali", "nvidia.dali.fn", "nvidia.dali.types", "nvidia.dali.plugin.pytorch"),
            "spdl": ("spdl.pipeline",)}


def import_peer(kind: str) -> None:
    """Import the modules of peer ``kind``'s loader (a run does it before its clock
    starts, as the other loaders' libraries are imported before theirs)."""
    for module in _MODULES[kind]:
        importlib.import_module(module)


class DaliLoader:
    """NVIDIA DALI's CPU pipeline doing RandomResizedCrop + flip, as its documentation
    builds one: ``readers.file`` (shuffled), ``decoders.image_random_crop`` on the
    CPU (area 0.08-1, aspect 3/4-4/3), ``resize`` to ``size`` x ``size``, ``flip``
    on a coin flip; ``device_id=None`` (no GPU), ``num_threads`` threads. Batches
    come through DALI's PyTorch iterator as uint8 [B, H, W, 3] and are viewed as
    [B, 3, H, W] (no copy), as the other loaders' are; one epoch is the reader's
    epoch, its last batch partial (the reader pads it, the iterator drops the
    padding).

    Args:
        root: ImageFolder root.
        batch_size: Samples per batch.
        size: Output side in pixels.
        seed: The pipeline's seed.
        threads: DALI's ``num_threads`` (default: the available cores).
        limit: Only this many of the images (:func:`~feeder.bench.loaders.image_source`).
    """

    def __init__(self, root: str, batch_size: int, size: int, seed: int = 0, threads: int | None = None,
                 limit: int | None = None) -> None:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self.threads = threads or available_cores()
        files: dict[str, Any] = {"file_root": root}
        if limit is not None:
            source = image_source(root, limit)
            files = {"files": list(source.paths), "labels": [int(x) for x in source.labels]}

        @pipeline_def(batch_size=batch_size, num_threads=self.threads, device_id=None, seed=seed)
        def pipeline():
            jpegs, labels = fn.readers.file(**files, random_shuffle=True, pad_last_batch=True,
                                            name="Reader")
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                   random_area=[0.08, 1.0],
                                                   random_aspect_ratio=[3 / 4, 4 / 3])
            images = fn.resize(images, resize_x=size, resize_y=size)
            images = fn.flip(images, horizontal=fn.random.coin_flip())
            return images, labels

        self.pipeline = pipeline()
        self.pipeline.build()
        self.iterator = DALIGenericIterator(self.pipeline, ["images", "labels"], reader_name="Reader",
                                            last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=False)
        self._started = False

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield one epoch's batches as ``([B, 3, H, W] uint8, [B] int64)``."""
        if self._started:
            self.iterator.reset()
        self._started = True
        for (out,) in self.iterator:
            yield out["images"].permute(0, 3, 1, 2), out["labels"].reshape(-1).long()

    def stats(self) -> dict[str, Any]:
        return {"threads": self.threads}

    def close(self) -> None:
        del self.iterator
        del self.pipeline


class _EpochIndices:
    """A source SPDL iterates once per epoch (``continuous=True``): ``(epoch, index)``
    for every index of ``n``, in a new order each epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return ((epoch, int(i)) for i in order)


class SpdlLoader:
    """SPDL's thread pipeline (``spdl.pipeline.PipelineBuilder``): a source of shuffled
    indices, one pipe doing the read and feeder's own per-sample work
    (:meth:`FeederWorkDataset.sample <feeder.bench.loaders.FeederWorkDataset.sample>`,
    what the ``DataLoader`` rows' workers do) with ``concurrency`` = ``threads``,
    ``aggregate(batch_size)`` keeping the last partial batch, and a pipe stacking
    each batch into uint8 [B, H, W, 3], viewed as [B, 3, H, W]. The pipeline's
    thread pool has ``threads`` threads; its source is continuous, one pass per
    epoch, so the pipeline is built once for every epoch. OpenCV runs on one
    thread meanwhile, as in feeder's threads and the DataLoader rows' workers.

    Args:
        root: ImageFolder root.
        batch_size: Samples per batch.
        size: Output side in pixels.
        seed: Shuffle and augmentation seed.
        threads: Concurrency of the work and SPDL's ``num_threads`` (default: the
            available cores).
        limit: Only this many of the images (:func:`~feeder.bench.loaders.image_source`).
        timeout_s: Longest wait for one batch.
    """

    def __init__(self, root: str, batch_size: int, size: int, seed: int = 0, threads: int | None = None,
                 limit: int | None = None, timeout_s: float = 600.0) -> None:
        import cv2
        from spdl.pipeline import PipelineBuilder

        self.threads = threads or available_cores()
        self.timeout_s = timeout_s
        self.dataset = FeederWorkDataset(root, transforms(size), seed=seed, limit=limit)
        dataset = self.dataset

        def load(item: tuple[int, int]) -> tuple[torch.Tensor, int]:
            epoch, index = item
            return dataset.sample(index, epoch)

        def collate(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
            images = torch.stack([x for x, _ in items])
            labels = torch.tensor([y for _, y in items], dtype=torch.int64)
            return images, labels

        self._cv2_threads = cv2.getNumThreads()
        cv2.setNumThreads(1)
        self.pipeline = (PipelineBuilder()
                         .add_source(_EpochIndices(len(dataset), seed), continuous=True)
                         .pipe(load, concurrency=self.threads, name="load")
                         .aggregate(batch_size)
                         .pipe(collate, name="collate")
                         .add_sink(3)
                         .build(num_threads=self.threads))
        self.pipeline.start(timeout=timeout_s)

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield one epoch's batches as ``([B, 3, H, W] uint8, [B] int64)``."""
        for images, labels in self.pipeline.get_iterator(timeout=self.timeout_s):
            yield images.permute(0, 3, 1, 2), labels

    def stats(self) -> dict[str, Any]:
        return {"threads": self.threads}

    def close(self) -> None:
        import cv2

        try:
            self.pipeline.stop(timeout=self.timeout_s)
        finally:
            cv2.setNumThreads(self._cv2_threads)


def peer_loader(kind: str, root: str, batch_size: int, *, size: int, seed: int = 0,
                limit: int | None = None) -> DaliLoader | SpdlLoader:
    """The loader of peer ``kind`` (``"dali"`` or ``"spdl"``), on all the available cores."""
    if kind == "dali":
        return DaliLoader(root, batch_size, size, seed=seed, limit=limit)
    if kind == "spdl":
        return SpdlLoader(root, batch_size, size, seed=seed, limit=limit)
    raise ValueError(f"unknown peer loader {kind!r}; peers: {sorted(PEERS)}")


# -- the subcommand ---------------------------------------------------------------------

def _loaders(text: str) -> list[str]:
    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown loader {unknown[0]!r}; loaders: {','.join(LOADERS)}")
    if "feeder" not in names:
        raise argparse.ArgumentTypeError("the loaders must include feeder (every ratio is to feeder)")
    return list(dict.fromkeys(names))


def _name(text: str) -> str:
    if not text or os.sep in text or (os.altsep and os.altsep in text) or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"a file name without a folder is needed, got {text!r}")
    return text


def add_parser(sub: Any, common: Callable[..., None], ints: Callable[[str], list[int]]) -> None:
    """The ``peers`` subcommand's arguments."""
    p = sub.add_parser("peers", help="feeder vs DataLoader, NVIDIA DALI (CPU) and SPDL on the same job, "
                                     "first and steady epochs")
    common(p)
    p.add_argument("--size", type=int, default=224,
                   help="RandomResizedCrop output side: 224 (ImageNet-like photos) or 64 (small images, "
                        "make-data --small); default 224")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--epochs", type=int, default=3,
                   help="epochs per run: the first, then 2..N the steady ones (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="rounds, each runs every row (default 3)")
    p.add_argument("--workers-grid", type=ints, default=[2, 3],
                   help="DataLoader num_workers, one row each (default 2,3)")
    p.add_argument("--limit", type=int, default=None,
                   help="images per epoch, spread over DIR (default: all of them)")
    p.add_argument("--loaders", type=_loaders, default=list(LOADERS),
                   help=f"rows to run (default {','.join(LOADERS)}; feeder is required)")
    p.add_argument("--name", type=_name, default="peers",
                   help="base name of the result files in --out (default peers: peers.txt, .csv, .json)")


COLUMNS = [
    ("row", "loader", "{}"),
    ("setting", "setting", "{}"),
    ("first_images_per_s", "1st epoch img/s", "{:.0f}"),
    ("steady_images_per_s", "steady img/s", "{:.0f}"),
    ("first_ratio", "1st vs feeder", "{:.2f}x"),
    ("steady_ratio", "steady vs feeder", "{:.2f}x"),
    ("steady_cpu_ms_per_image", "steady CPU ms/img", "{:.2f}"),
    ("steady_cores", "steady cores used", "{:.2f}"),
    ("other_cores", "other load", "{:.2f}"),
    ("first_batch_s", "1st batch s", "{:.2f}"),
    ("peak_pss_mib", "peak PSS MiB", "{:.0f}"),
    ("best", "best", "{}"),
]


def epoch_rates(res: RunResult) -> dict[str, float | None]:
    """The first epoch's img/s (from building the loader: start-up included) and the
    steady epochs' (2..N: from the first epoch's last batch to the last one's), with
    the steady epochs' CPU ms per image and the cores they used (CPU over wall time)."""
    ends = res.extra.get("epoch_end_s") or []
    counts = res.extra.get("epoch_images") or []
    cpus = res.extra.get("epoch_cpu_s") or []
    out: dict[str, float | None] = {"first": None, "steady": None, "steady_cpu_ms": None,
                                    "steady_cores": None}
    if not res.ok or not ends or ends[0] <= 0:
        return out
    out["first"] = counts[0] / ends[0]
    if len(ends) > 1 and ends[-1] > ends[0] and counts[-1] > counts[0]:
        out["steady"] = (counts[-1] - counts[0]) / (ends[-1] - ends[0])
        if len(cpus) == len(ends):
            out["steady_cpu_ms"] = 1e3 * (cpus[-1] - cpus[0]) / (counts[-1] - counts[0])
            out["steady_cores"] = (cpus[-1] - cpus[0]) / (ends[-1] - ends[0])
    return out


def specs(args: argparse.Namespace) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The rows' labels and child specs, and a line for each peer left out."""
    base = {"mode": "loader", "root": args.dir, "batch_size": args.batch_size, "epochs": args.epochs,
            "seed": args.seed, "size": args.size, "limit": args.limit}
    rows: list[tuple[str, dict[str, Any]]] = []
    skipped: list[str] = []
    for kind in args.loaders:
        if kind == "feeder":
            rows.append(("feeder", {**base, "kind": "feeder", "name": "feeder"}))
        elif kind == "bare":
            rows.append((f"bare work ({available_cores()} processes, no loader)",
                         {**base, "kind": "bare", "name": "bare work"}))
        elif kind == "dataloader":
            for w in args.workers_grid:
                label = f"DataLoader (num_workers={w})"
                rows.append((label, {**base, "kind": "dl-cv2", "workers": w, "name": label}))
        elif installed(kind):
            rows.append((PEERS[kind].label, {**base, "kind": kind, "name": PEERS[kind].label}))
        else:
            skipped.append(f"{kind}: not installed ({PEERS[kind].install})")
    return rows, skipped


def _setting(spec: dict[str, Any], cores: int) -> str:
    kind = spec["kind"]
    if kind == "feeder":
        return "defaults"
    if kind == "dl-cv2":
        return f"num_workers={spec['workers']}, feeder's work"
    if kind == "dali":
        return f"CPU pipeline, num_threads={cores}"
    if kind == "bare":
        return "feeder's work, nothing around it"
    return f"threads, concurrency={cores}, feeder's work"


def _one_line(error: str) -> str:
    lines = [x.strip() for x in error.strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else "no output"


def run(args: argparse.Namespace) -> int:
    """The ``peers`` subcommand."""
    rows, skipped = specs(args)
    cores = available_cores()
    source = image_source(args.dir, args.limit)  # names a folder that is no ImageFolder, here
    for line in skipped:
        report.progress(line)
    rounds: list[dict[str, RunResult]] = []
    load = [os.getloadavg()[0]]
    for r in range(args.repeats):
        report.progress(f"peers: round {r + 1}/{args.repeats}")
        shift = r % len(rows)
        got: dict[str, RunResult] = {}
        for label, spec in rows[shift:] + rows[:shift]:
            busy0, kids0, t0 = _busy_s(), _children_cpu_s(), time.perf_counter()
            res = run_child(spec)
            busy1, kids1, elapsed = _busy_s(), _children_cpu_s(), time.perf_counter() - t0
            if busy0 is not None and busy1 is not None and elapsed > 0:
                # The machine's busy time less the run's own CPU (start-up included: run_child
                # reaps it): the cores other processes took meanwhile.
                res.extra["other_cores"] = max(0.0, ((busy1 - busy0) - (kids1 - kids0)) / elapsed)
            got[label] = res
            if res.ok:
                rates = epoch_rates(res)
                steady = rates["steady"]
                first = "- (every file read)" if spec["kind"] == "bare" else f"{rates['first']:.0f} img/s"
                report.progress(f"  {label}: first epoch {first}, steady "
                                + ("-" if steady is None else f"{steady:.0f}") + " img/s")
            else:
                report.progress(f"  {label}: FAILED ({_one_line(res.error)})")
        rounds.append(got)
        load.append(os.getloadavg()[0])

    def ratios(label: str, key: str) -> list[float]:
        vals = []
        for got in rounds:
            a, f = epoch_rates(got[label])[key], epoch_rates(got["feeder"])[key]
            if a is not None and f:
                vals.append(a / f)
        return vals

    table: list[dict[str, Any]] = []
    failures: list[str] = []
    for label, spec in rows:
        runs = [got[label] for got in rounds]
        ok = [x for x in runs if x.ok]
        if not ok:
            failures.append(f"{label}: failed in every round ({_one_line(runs[-1].error)})")
        rates = [epoch_rates(x) for x in ok]
        pss = [x.peak_pss for x in ok if x.peak_pss is not None]
        table.append({
            "row": label, "kind": spec["kind"], "setting": _setting(spec, cores),
            "workers": spec.get("workers"),
            "first_images_per_s": median([x["first"] for x in rates]),
            "steady_images_per_s": median([x["steady"] for x in rates]),
            "first_ratio": 1.0 if label == "feeder" else median(ratios(label, "first")),
            "steady_ratio": 1.0 if label == "feeder" else median(ratios(label, "steady")),
            "first_ratio_rounds": ratios(label, "first"), "steady_ratio_rounds": ratios(label, "steady"),
            "steady_cpu_ms_per_image": median([x["steady_cpu_ms"] for x in rates]),
            "steady_cores": median([x["steady_cores"] for x in rates]),
            "other_cores": median([x.extra.get("other_cores") for x in ok]),
            "cpu_ms_per_image": 1e3 * median([x.cpu_per_image_s for x in ok]),
            "first_batch_s": median([x.first_batch_s for x in ok]),
            "peak_pss_mib": median(pss) / MIB if pss else None,
            "images": median([x.images for x in ok]), "runs": len(ok),
            "first_rounds": [x["first"] for x in rates], "steady_rounds": [x["steady"] for x in rates],
            "best": "",
        })
        if spec["kind"] == "bare":  # its first epoch reads every file in every process: no loader's rate
            table[-1].update(first_images_per_s=None, first_ratio=None, first_rounds=[],
                             first_ratio_rounds=[])
    if not any(r.ok for r in (got["feeder"] for got in rounds)):
        raise RuntimeError(f"peers: feeder failed in every round ({_one_line(rounds[-1]['feeder'].error)})")
    dl = [row for row in table if row["kind"] == "dl-cv2" and row["runs"]]
    if dl:
        key = "steady_images_per_s" if args.epochs > 1 else "first_images_per_s"
        max(dl, key=lambda row: row[key] if row[key] == row[key] else -1.0)["best"] = "*"

    machine = report.machine_info()
    versions = {name: version(name) if installed(name) else None for name in PEERS}
    command = " ".join(["feeder-bench", *sys.argv[1:]])
    job = (f"RandomResizedCrop({args.size}) + flip, batch {args.batch_size}, uint8, shuffled, last batch "
           f"kept, {len(source)} images per epoch, {args.epochs} epochs per run")
    lines = [f"peers on {args.dir}: {job}; median of {args.repeats} rounds, each row a fresh process, "
             f"rows in a rotated order each round, on {cores} cores",
             f"command: {command}",
             f"machine: {report.describe_machine(machine)}",
             "peers: " + ", ".join(v or f"{name} not installed" for name, v in versions.items()),
             "load average (1 min) before and after each round: " + ", ".join(f"{x:.2f}" for x in load)]
    lines += skipped + failures + [""]
    text = "\n".join(lines) + report.format_table(table, COLUMNS)
    text += ("\n1st epoch: its images over the time from building the loader to its last batch (start-up "
             "included); steady: epochs 2..N, from the first epoch's last batch to the last one's, with "
             "their CPU per image (every process of the loader) and the cores it used (that CPU over the "
             "same time). other load: the cores other processes used while the row ran (the machine's "
             "busy time less the row's own CPU). vs feeder: the row's rate over feeder's in the same "
             "round, median of the rounds. best: the DataLoader row with the highest "
             + ("steady" if args.epochs > 1 else "first-epoch") + " rate.\n")
    print(text, end="")
    meta = {"dir": args.dir, "size": args.size, "batch_size": args.batch_size, "epochs": args.epochs,
            "repeats": args.repeats, "workers_grid": args.workers_grid, "limit": args.limit,
            "images_per_epoch": len(source), "loaders": args.loaders, "cores": cores, "skipped": skipped,
            "versions": {**versions, "torch": torch.__version__}, "load_average": load,
            "raw_rounds": [{lb: {"ok": x.ok, "images": x.images, "wall_s": x.wall_s, "cpu_s": x.cpu_s,
                                 "first_batch_s": x.first_batch_s, "peak_pss": x.peak_pss,
                                 "extra": x.extra, "error": x.error}
                            for lb, x in got.items()} for got in rounds]}
    report.write_outputs(args.out, args.name, table, meta, machine=machine)
    with open(os.path.join(args.out, f"{args.name}.txt"), "w") as f:
        f.write(text)
    return 0
