"""Storage benchmarks: slow reads, shards over HTTP, local shards against files.

* ``read-latency``: a source whose ``read`` blocks ``--latency-ms`` per sample
  (a network file system, an object store): the feeder with its defaults,
  with reads in the decode threads (``read_threads=0``: blocking reads), and on
  the same source without latency; DataLoader with its usual worker counts on
  the same source and per-sample work. Targets: defaults >= 4x blocking reads and
  >= 80% of the no-latency rate.
* ``remote``: the dataset packed into shards, served by the loopback HTTP
  server (in a process of its own) with ``--latency-ms`` per request: first epoch with the defaults (fresh
  cache) and with blocking reads, second epoch (from the cache) with the
  requests it makes; DataLoader over the same remote shards. Targets: first
  epoch >= 3x blocking reads; second epoch <= 10% of the first epoch's requests.
* ``shards``: the same images as a folder of files and as local shards, feeder
  and DataLoader on each. Target: shards at least as fast as files.

Every row is the median of ``--rounds`` alternating rounds; ratios are medians of
per-round ratios (the machine's drift cancels).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import Feeder, ImageFolder
from ..sample.rng import sample_key
from ..pack import pack, parse_size
from ..shards import TarShards
from .httpserver import ServerProcess
from .loaders import _limit_cv2_threads, sample_work, transforms
from .report import describe_machine, format_table, machine_info, median, progress, pyplot, write_outputs


class Subset:
    """The first ``limit`` samples of a source, spread evenly over it."""

    def __init__(self, source: Any, limit: int | None) -> None:
        self.source = source
        n = len(source)
        self.index = list(range(n)) if not limit or limit >= n else \
            [int(i) for i in np.linspace(0, n - 1, limit).round()]

    def __len__(self) -> int:
        return len(self.index)

    def read(self, i: int) -> tuple[bytes, int]:
        return self.source.read(self.index[i])

    def describe(self, i: int) -> str:
        return str(self.source.describe(self.index[i]))


class Slow:
    """``source`` whose every read first blocks ``latency_s`` (as a network read waits)."""

    def __init__(self, source: Any, latency_s: float) -> None:
        self.source = source
        self.latency_s = latency_s

    def __len__(self) -> int:
        return len(self.source)

    def read(self, i: int) -> tuple[bytes, int]:
        time.sleep(self.latency_s)
        return self.source.read(i)


class WorkDataset(torch.utils.data.Dataset):
    """DataLoader's side: any source, then the feeder's own per-sample work."""

    def __init__(self, source: Any, seed: int = 0) -> None:
        self.source = source
        self.work = sample_work()
        self.seed = seed

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        data, label = self.source.read(i)
        h, w = self.work.image_size
        out = np.empty((h, w, 3), np.uint8)
        self.work(data, sample_key(self.seed, 0, i), out)
        return torch.from_numpy(out), label


def _time_feeder(source: Any, batch_size: int, epochs: int, seed: int, **options: Any) -> tuple[float, Any]:
    with Feeder(source, batch_size, transforms(), shuffle=True, seed=seed, **options) as f:
        n = 0
        t0 = time.perf_counter()
        for epoch in range(epochs):
            f.set_epoch(epoch)
            for x, _ in f:
                n += x.shape[0]
        wall = time.perf_counter() - t0
        return n / wall, f.stats()


def _time_dataloader(source: Any, batch_size: int, workers: int, seed: int) -> float:
    gen = torch.Generator()
    gen.manual_seed(seed)
    loader = torch.utils.data.DataLoader(WorkDataset(source, seed), batch_size=batch_size, shuffle=True,
                                         num_workers=workers, generator=gen,
                                         worker_init_fn=_limit_cv2_threads if workers else None)
    n = 0
    t0 = time.perf_counter()
    for x, _ in loader:
        n += x.shape[0]
    return n / (time.perf_counter() - t0)


def _rounds(runs: list[tuple[str, Callable[[], dict[str, Any]]]], rounds: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {name: [] for name, _ in runs}
    for r in range(rounds):
        for name, fn in (runs if r % 2 == 0 else runs[::-1]):
            result = fn()
            out[name].append(result)
            progress(f"round {r + 1} {name}: {result['img_s']:.0f} img/s")
    return out


def _ratio(results: dict[str, list[dict]], a: str, b: str) -> float:
    return statistics.median(x["img_s"] / y["img_s"] for x, y in zip(results[a], results[b]))


def _rows(results: dict[str, list[dict]], info: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for name, rs in results.items():
        row = {"run": name, "setting": info.get(name, ""), "img_s": median([x["img_s"] for x in rs])}
        for key in ("requests", "read_util"):
            if key in rs[0]:
                row[key] = median([x[key] for x in rs])
        rows.append(row)
    return rows


def _finish(args: argparse.Namespace, name: str, rows: list[dict], targets: list[dict], meta: dict,
            title: str) -> int:
    machine = machine_info()
    text = format_table(rows, [("run", "run", "{}"), ("setting", "setting", "{}"),
                               ("img_s", "img/s", "{:.0f}"), ("requests", "requests", "{:.0f}")],
                        title=f"{title}\n{describe_machine(machine)}")
    text += "\n" + format_table(targets, [("target", "target", "{}"), ("value", "measured", "{:.2f}"),
                                          ("goal", "goal", "{}"), ("met", "met", "{}")])
    print(text)
    write_outputs(args.out, name, rows, meta, {"targets": targets})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(rows)))
        ax.barh([r["run"] for r in rows][::-1], [r["img_s"] for r in rows][::-1], color="#4878a8")
        ax.set_xlabel("images/s (median of rounds)")
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"{name}.png"), dpi=120)
        plt.close(fig)
    return 0


def _target(name: str, value: float, goal: float, above: bool = True) -> dict[str, Any]:
    met = value >= goal if above else value <= goal
    return {"target": name, "value": value, "goal": (">= " if above else "<= ") + f"{goal:g}",
            "met": "yes" if met else "NO"}


def run_read_latency(args: argparse.Namespace) -> int:
    base = Subset(ImageFolder(args.dir), args.limit)
    slow = Slow(base, args.latency_ms / 1000)
    B, E, seed = args.batch_size, args.epochs, args.seed

    def feeder(source: Any, **opt: Any) -> Callable[[], dict[str, Any]]:
        def go() -> dict[str, Any]:
            rate, stats = _time_feeder(source, B, E, seed, **opt)
            read = [s for s in stats.stages if s.name == "read"]
            return {"img_s": rate, "read_util": read[0].utilization if read else None}
        return go

    runs = [("feeder, no latency", feeder(base)),
            ("feeder, defaults", feeder(slow)),
            ("feeder, blocking reads", feeder(slow, read_threads=0))]
    runs += [(f"DataLoader, {w} workers", lambda w=w: {"img_s": _time_dataloader(slow, B, w, seed)})
             for w in args.workers]
    info = {"feeder, no latency": "read_threads='auto'", "feeder, defaults": "read_threads='auto'",
            "feeder, blocking reads": "read_threads=0"}
    results = _rounds(runs, args.rounds)
    rows = _rows(results, info)
    targets = [_target("defaults / blocking reads", _ratio(results, "feeder, defaults", "feeder, blocking reads"), 4),
               _target("defaults / no latency", _ratio(results, "feeder, defaults", "feeder, no latency"), 0.8)]
    meta = {"latency_ms": args.latency_ms, "images": len(base), "batch_size": B, "epochs": E,
            "rounds": args.rounds}
    return _finish(args, "read_latency", rows, targets, meta,
                   f"read-latency: {len(base)} images of {args.dir}, every read blocks {args.latency_ms:g} ms; "
                   f"RandomResizedCrop(224)+flip, batch {B}, {E} epoch(s), {args.rounds} rounds")


def _packed(args: argparse.Namespace, work: str) -> str:
    if args.shards:
        return args.shards
    out = os.path.join(work, "shards")
    progress(f"packing {args.dir} into {args.shard_size} shards")
    pack(args.dir, out, shard_size=parse_size(args.shard_size))
    return out


def run_remote(args: argparse.Namespace) -> int:
    B, seed = args.batch_size, args.seed
    work = tempfile.mkdtemp(prefix="feeder-bench-remote-")
    try:
        shards_dir = _packed(args, work)
        with ServerProcess(shards_dir, latency_s=args.latency_ms / 1000) as server:
            url = server.url + "/train.json"

            def epoch1(**opt: Any) -> dict[str, Any]:
                cache = os.path.join(work, "cache")
                shutil.rmtree(cache, ignore_errors=True)
                with TarShards(url, cache_dir=cache if opt.pop("cache", True) else False) as src:
                    server.reset_counts()
                    rate, _ = _time_feeder(src, B, 1, seed, **opt)
                    requests = server.count()
                    result = {"img_s": rate, "requests": requests}
                    if opt:
                        return result
                    # The second epoch of the same job: the cache holds what the first copied.
                    src.wait_downloads(600)
                    server.reset_counts()
                    rate2, _ = _time_feeder(src, B, 1, seed + 1)
                    second.append({"img_s": rate2, "requests": server.count()})
                    return result

            second: list[dict[str, Any]] = []

            def dataloader(w: int) -> dict[str, Any]:
                with TarShards(url, cache_dir=False) as src:
                    server.reset_counts()
                    return {"img_s": _time_dataloader(src, B, w, seed), "requests": server.count()}

            runs = [("feeder, epoch 1, defaults", lambda: epoch1()),
                    ("feeder, epoch 1, blocking reads", lambda: epoch1(read_threads=0, cache=False))]
            runs += [(f"DataLoader, {w} workers, no cache", lambda w=w: dataloader(w)) for w in args.workers]
            results = _rounds(runs, args.rounds)
            results["feeder, epoch 2 (cache)"] = second
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = {"feeder, epoch 1, defaults": "fresh cache", "feeder, epoch 1, blocking reads":
            "read_threads=0, no cache", "feeder, epoch 2 (cache)": "after epoch 1's copies"}
    rows = _rows(results, info)
    e1 = median([x["requests"] for x in results["feeder, epoch 1, defaults"]])
    e2 = median([x["requests"] for x in second])
    targets = [_target("epoch 1: defaults / blocking reads",
                       _ratio(results, "feeder, epoch 1, defaults", "feeder, epoch 1, blocking reads"), 3),
               _target("epoch 2 requests / epoch 1 requests", e2 / e1 if e1 else float("nan"), 0.1,
                       above=False)]
    meta = {"latency_ms": args.latency_ms, "batch_size": B, "rounds": args.rounds}
    return _finish(args, "remote", rows, targets, meta,
                   f"remote: shards of {args.shards or args.dir} over HTTP on 127.0.0.1, "
                   f"{args.latency_ms:g} ms per request; batch {B}, {args.rounds} rounds")


def run_shards(args: argparse.Namespace) -> int:
    B, E, seed = args.batch_size, args.epochs, args.seed
    work = tempfile.mkdtemp(prefix="feeder-bench-shards-")
    try:
        folder = ImageFolder(args.dir)
        shards = TarShards(_packed(args, work))
        if len(shards) != len(folder):
            raise SystemExit(f"--shards holds {len(shards)} samples, {args.dir} {len(folder)}")
        runs = [("feeder, folder of files", lambda: {"img_s": _time_feeder(folder, B, E, seed)[0]}),
                ("feeder, local shards", lambda: {"img_s": _time_feeder(shards, B, E, seed)[0]})]
        for w in args.workers:
            runs += [(f"DataLoader {w} workers, files", lambda w=w: {"img_s": _time_dataloader(folder, B, w, seed)}),
                     (f"DataLoader {w} workers, shards", lambda w=w: {"img_s": _time_dataloader(shards, B, w, seed)})]
        results = _rounds(runs, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = _rows(results, {})
    targets = [_target("feeder: shards / files", _ratio(results, "feeder, local shards", "feeder, folder of files"), 1.0)]
    meta = {"images": len(folder), "batch_size": B, "epochs": E, "rounds": args.rounds}
    return _finish(args, "shards", rows, targets, meta,
                   f"shards: {len(folder)} images of {args.dir}, files vs local shards ({args.shard_size}); "
                   f"RandomResizedCrop(224)+flip, batch {B}, {E} epoch(s), {args.rounds} rounds")


def add_parsers(sub: Any, common: Callable[[argparse.ArgumentParser], None],
                ints: Callable[[str], list[int]]) -> None:
    """The ``read-latency``, ``remote`` and ``shards`` subcommands."""
    def shared(p: argparse.ArgumentParser, latency: float | None) -> None:
        common(p)
        p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
        p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
        p.add_argument("--workers", type=ints, default=[2, 4, 8],
                       help="DataLoader num_workers to run (default 2,4,8)")
        if latency is not None:
            p.add_argument("--latency-ms", type=float, default=latency,
                           help=f"latency per read or request, ms (default {latency:g})")

    p = sub.add_parser("read-latency", help="a source whose reads block: defaults vs blocking reads")
    shared(p, 10.0)
    p.add_argument("--limit", type=int, default=2000, help="images used (default 2000)")
    p.add_argument("--epochs", type=int, default=1, help="epochs per run (default 1)")

    p = sub.add_parser("remote", help="shards over the loopback HTTP server with latency, cache")
    shared(p, 15.0)
    p.add_argument("--shards", default=None, help="shards made by feeder-pack (default: pack DIR)")
    p.add_argument("--shard-size", default="16MB", help="shard size when packing DIR (default 16MB)")

    p = sub.add_parser("shards", help="a folder of files vs the same images in local shards")
    shared(p, None)
    p.add_argument("--shards", default=None, help="shards of DIR made by feeder-pack (default: pack DIR)")
    p.add_argument("--shard-size", default="64MB", help="shard size when packing DIR (default 64MB)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run (default 2)")


def run(args: argparse.Namespace) -> int:
    return {"read-latency": run_read_latency, "remote": run_remote, "shards": run_shards}[args.command](args)
