"""``feeder-bench scale``: a web-scale dataset simulated on one machine.

A server synthesizes shards on request from their names (:mod:`feeder.bench.synth`:
deterministic bytes, no disk), listed in a ``train.json`` of ``--shards`` shards
of ``--per`` samples (default 10^5 x 10^4 = 10^9 samples). One rank of a job of
``--world-size`` ranks reads its share of an epoch through a cache much smaller
than the data, with the block shuffle (``shuffle="shards"``,
``shuffle_shards=--window``). Measured:

- construction of the source (seconds, and the requests it made);
- time to the first batch;
- RSS over the run (sampled every second; growth from the first batch);
- bytes fetched from the server (whole shards, ranges, indices) against this
  rank's shards' bytes;
- the resume state's size (pickled) mid-epoch;
- steady throughput once the window is warm, and the same pipeline on local
  copies of the same shards;
- the global shuffle's order over the whole list (10^9 samples): time to make it
  and to compute a batch of it;
- the shuffle quality of the block shuffle by window (label autocorrelation of
  the order at lag 1, distinct classes per batch), labels laid out by class.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from . import report


def add_parser(sub: Any, default_out_help: str) -> None:
    p = sub.add_parser("scale", help="a 10^9-sample shard list served by a synthetic HTTP server: "
                                     "construction, first batch, RSS, bytes fetched, resume state, "
                                     "throughput vs local shards, shuffle quality by window")
    p.add_argument("--out", default=None,
                   help=f"folder for CSV/JSON results (default: a new folder, {default_out_help})")
    p.add_argument("--shards", type=int, default=100_000, help="shards in the list (default 10^5)")
    p.add_argument("--per", type=int, default=10_000, help="samples per shard (default 10^4)")
    p.add_argument("--world-size", type=int, default=10_000,
                   help="ranks of the simulated job; this process is one of them (default 10^4: "
                        "10 shards per rank per epoch)")
    p.add_argument("--rank", type=int, default=0, help="the rank measured (default 0)")
    p.add_argument("--window", type=int, default=2, help="shuffle_shards (default 2)")
    p.add_argument("--cache-shards", type=float, default=5.0,
                   help="cache bound, in shards (default 5: two windows and a half)")
    p.add_argument("--batch-size", type=int, default=256, help="batch size (default 256)")
    p.add_argument("--decode-threads", type=int, default=2, help="decode threads (default 2)")
    p.add_argument("--read-threads", default="auto",
                   help="read threads of both runs (default auto: none, the decode threads "
                        "read, for local shards and for remote ones whose windows are copied "
                        "into the cache ahead; 0 reads in the decode threads)")
    p.add_argument("--image-px", type=int, default=64, help="side of the JPEG every sample holds")
    p.add_argument("--seconds", type=float, default=300.0,
                   help="stop the remote run after this long if the rank's epoch is not done")
    p.add_argument("--local-batches", type=int, default=200,
                   help="batches timed on local copies of the shards (default 200)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument("--rss-every", type=float, default=None,
                   help="the long run instead of the measures above: read epoch after epoch for "
                        "--seconds (e.g. 3600), sampling RSS every this many seconds into "
                        "scale_rss.csv (and scale_rss.png with matplotlib), and the bytes "
                        "fetched per epoch against that epoch's shard bytes")
    p.add_argument("--s3", action="store_true",
                   help="read through s3fs (s3://synth/train.json, the server as the S3 endpoint: "
                        "HeadObject and ranged GetObject, path-style) instead of HTTP")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _image(px: int) -> bytes:
    import simplejpeg  # noqa: PLC0415

    y, x = np.mgrid[0:px, 0:px]
    img = np.stack([(x * 255 // px), (y * 255 // px), ((x + y) * 127 // px)], -1).astype(np.uint8)
    return simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=85, colorspace="RGB")


def _transforms() -> list[Any]:
    from feeder import ops  # noqa: PLC0415

    return [ops.Resize(48), ops.CenterCrop(32)]


def shuffle_quality(nshards: int, per: int, classes: int, windows: list[int], positions: int,
                    batch: int, seed: int) -> list[dict[str, Any]]:
    """Lag-1 label autocorrelation and distinct classes per batch of the first
    ``positions`` samples of an epoch's order, labels laid out by class (see
    :mod:`feeder.bench.synth`), for the block shuffle by window and the global
    shuffle."""
    from feeder.order.epoch import ShardLayout, epoch_order, shard_stream_order  # noqa: PLC0415

    n = nshards * per
    ranges = tuple((k * per, (k + 1) * per) for k in range(nshards))
    rows = []
    for w in [*windows, None]:
        if w is None:
            order = epoch_order(n, True, seed, 0)
            name = "global shuffle"
        else:
            order = shard_stream_order(ShardLayout(ranges, 8192, shards=w), seed, 0)
            name = f"shuffle_shards={w}"
        idx = order.take(0, min(positions, n))
        labels = (idx * classes // n).astype(np.float64)
        a, b = labels[:-1], labels[1:]
        corr = float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else 1.0
        per_batch = [len(np.unique(labels[k:k + batch])) for k in range(0, len(labels) - batch + 1, batch)]
        rows.append({"order": name, "window_shards": w, "lag1_autocorrelation": round(corr, 4),
                     "classes_per_batch": round(float(np.mean(per_batch)), 2),
                     "classes_in_first_window": (len(np.unique(labels[:w * per])) if w
                                                 else classes)})
    return rows


def _run_feeder(src: Any, args: argparse.Namespace, rank: int, world_size: int, limit_s: float,
                max_batches: int | None, state_at: int | None,
                server_pid: int | None = None) -> dict[str, Any]:
    from feeder import Feeder  # noqa: PLC0415

    out: dict[str, Any] = {}
    if args.read_threads != "auto":
        args.read_threads = int(args.read_threads)
    f = Feeder(src, args.batch_size, _transforms(), shuffle="shards", shuffle_shards=args.window,
               rank=rank, world_size=world_size, drop_last=True, seed=args.seed,
               decode_threads=args.decode_threads, augment_threads=0,
               read_threads=args.read_threads)
    try:
        t0 = time.perf_counter()
        it = iter(f)
        samples, batches = 0, 0
        rss_trace: list[tuple[float, int, int]] = []
        times: list[float] = []
        # CPU seconds of this process (every loader thread) and of the server
        # process, at each batch: throughput per CPU second is what a shared
        # machine can measure, and the server's share is told apart.
        cpu: list[float] = []
        server_cpu: list[float] = []
        next_rss = 0.0
        for _x, y in it:
            now = time.perf_counter() - t0
            cpu.append(time.process_time())
            if server_pid is not None:
                server_cpu.append(_server_cpu(server_pid))
            if batches == 0:
                out["first_batch_s"] = now
                out["rss_first_batch"] = _rss()
            batches += 1
            samples += len(y)
            times.append(now)
            if now >= next_rss:
                rss_trace.append((round(now, 2), samples, _rss()))
                next_rss = now + 1.0
            if state_at is not None and batches == state_at:
                state = f.state_dict()
                out["state_bytes"] = len(pickle.dumps(state))
                out["state_version"] = state["version"]
                out["state_after"] = len(state.get("after") or [])
            if (max_batches is not None and batches >= max_batches) or now > limit_s:
                break
        out["elapsed_s"] = time.perf_counter() - t0
        out["batches"], out["samples"] = batches, samples
        out["epoch_batches"] = len(f)
        out["epoch_done"] = batches >= len(f)
        out["rss_trace"] = rss_trace
        out["rss_end"] = _rss()
        out["batch_times"] = times
        out["batch_cpu"] = cpu
        out["batch_server_cpu"] = server_cpu
    finally:
        f.close()
    return out


def _steady(times: list[float], batch: int, skip: int) -> float:
    """Samples per second (of wall time, or of CPU time given CPU readings per
    batch) after the first ``skip`` batches (the warm-up)."""
    if len(times) <= skip + 1 or times[-1] <= times[skip]:
        return float("nan")
    return (len(times) - 1 - skip) * batch / (times[-1] - times[skip])


def _import_stack(s3: bool) -> None:
    """Import fsspec's HTTP (or S3) stack before the clock starts: the import is
    a one-off cost of the process, not of building a source."""
    import aiohttp  # noqa: F401, PLC0415
    import fsspec.implementations.http  # noqa: F401, PLC0415

    if s3:
        import s3fs  # noqa: F401, PLC0415


def _dataset(args: argparse.Namespace, prefix: str) -> tuple[str, str, Any]:
    """A work folder, the image file the server process reads, and the dataset."""
    from .synth import SynthShards  # noqa: PLC0415

    work = tempfile.mkdtemp(prefix=prefix)
    image = _image(args.image_px)
    image_path = os.path.join(work, "image.jpg")
    with open(image_path, "wb") as f:
        f.write(image)
    return work, image_path, SynthShards(args.shards, args.per, image)


def _server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass  # evicted while walked
    return total


def _slope_mb_per_h(trace: list[dict[str, Any]], after_s: float) -> float:
    """Least-squares slope of RSS (MB per hour) over the samples after ``after_s``."""
    pts = [(r["t_s"], r["rss_mb"]) for r in trace if r["t_s"] >= after_s]
    if len(pts) < 3:
        return float("nan")
    t, m = np.array(pts).T
    return float(np.polyfit(t / 3600.0, m, 1)[0])


def run_long(args: argparse.Namespace) -> int:
    """The long run: epochs of this rank's share read back to back for
    ``--seconds``, RSS sampled every ``--rss-every`` seconds (see the module
    docstring); bytes fetched per finished epoch against that epoch's shards."""
    from feeder import Feeder  # noqa: PLC0415
    from feeder.order.epoch import ShardLayout, shard_stream_order  # noqa: PLC0415
    from feeder.shards import TarShards  # noqa: PLC0415

    from .synth import SynthServerProcess  # noqa: PLC0415

    _import_stack(False)
    os.makedirs(args.out, exist_ok=True)
    work, image_path, synth = _dataset(args, "feeder-scale-long-")
    cache_dir = os.path.join(work, "cache")
    cache_bytes = int(args.cache_shards * synth.size)
    meta: dict[str, Any] = {
        "shards": args.shards, "per_shard": args.per, "samples": synth.samples,
        "shard_bytes": synth.size, "data_bytes": synth.size * args.shards,
        "world_size": args.world_size, "rank": args.rank, "window_shards": args.window,
        "batch_size": args.batch_size, "decode_threads": args.decode_threads,
        "cache_bytes": cache_bytes, "seconds": args.seconds, "rss_every_s": args.rss_every}
    trace: list[dict[str, Any]] = []
    epochs: list[dict[str, Any]] = []
    csv_path = os.path.join(args.out, "scale_rss.csv")
    rss_start = _rss()
    try:
        with SynthServerProcess(args.shards, args.per, image_path) as server, \
                open(csv_path, "w") as csv:
            csv.write("t_s,epoch,samples,rss_mb,cache_mb,tar_bytes_fetched,server_cpu_s,"
                      "client_cpu_s\n")
            src = TarShards(server.url + "/train.json", cache_dir=cache_dir,
                            cache_bytes=cache_bytes, lazy_index=True)
            server.counts(reset=True)
            f = Feeder(src, args.batch_size, _transforms(), shuffle="shards",
                       shuffle_shards=args.window, rank=args.rank, world_size=args.world_size,
                       drop_last=True, seed=args.seed, decode_threads=args.decode_threads,
                       augment_threads=0)
            layout = ShardLayout(tuple(src.shard_ranges()), 8192, shards=args.window)
            t0, c0 = time.perf_counter(), time.process_time()
            s0 = _server_cpu(server.pid)
            samples, next_rss, epoch, fetched_before = 0, 0.0, 0, 0

            def sample(now: float) -> None:
                row = {"t_s": round(now, 1), "epoch": epoch, "samples": samples,
                       "rss_mb": round(_rss() / 2**20, 1),
                       "cache_mb": round(_dir_bytes(cache_dir) / 2**20, 1),
                       "tar_bytes_fetched": server.counts().get("tar_bytes", 0),
                       "server_cpu_s": round(_server_cpu(server.pid) - s0, 1),
                       "client_cpu_s": round(time.process_time() - c0, 1)}
                trace.append(row)
                csv.write(",".join(str(row[k]) for k in row) + "\n")
                csv.flush()
                report.progress(f"{row['t_s']:.0f} s: epoch {epoch}, {samples} samples, RSS "
                                f"{row['rss_mb']} MB, cache {row['cache_mb']} MB")

            done = False
            while not done:
                order = shard_stream_order(layout, args.seed, epoch, args.rank, args.world_size,
                                           True)
                shards = {s for w in range(order.windows()) for s in order.window_shard_numbers(w)}
                e0, n0 = time.perf_counter(), samples
                f.set_epoch(epoch)
                for _x, y in f:
                    samples += len(y)
                    now = time.perf_counter() - t0
                    if now >= next_rss:
                        sample(now)
                        next_rss += args.rss_every
                    if now >= args.seconds:
                        done = True
                        break
                src.wait_downloads(60)
                fetched = server.counts().get("tar_bytes", 0)
                epochs.append({"epoch": epoch, "complete": not done,
                               "samples": samples - n0, "seconds": round(time.perf_counter() - e0, 1),
                               "tar_bytes_fetched": fetched - fetched_before,
                               "epoch_shard_bytes": len(shards) * synth.size,
                               "fetched_over_shard_bytes": round(
                                   (fetched - fetched_before) / (len(shards) * synth.size), 4)})
                fetched_before = fetched
                epoch += 1
            sample(time.perf_counter() - t0)
            f.close()
            src.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    full = [e for e in epochs if e["complete"]]
    first_min = min(trace, key=lambda r: abs(r["t_s"] - 60.0))
    summary = {
        "rss_start_mb": round(rss_start / 2**20, 1),
        "rss_at_1min_mb": first_min["rss_mb"], "rss_at_1min_t_s": first_min["t_s"],
        "rss_end_mb": trace[-1]["rss_mb"], "rss_end_t_s": trace[-1]["t_s"],
        "rss_max_mb": max(r["rss_mb"] for r in trace),
        "rss_slope_mb_per_h_after_1min": round(_slope_mb_per_h(trace, 60.0), 2),
        "cache_max_mb": max(r["cache_mb"] for r in trace),
        "epochs_complete": len(full), "samples": trace[-1]["samples"],
        "fetched_over_shard_bytes_complete_epochs": round(
            sum(e["tar_bytes_fetched"] for e in full)
            / max(1, sum(e["epoch_shard_bytes"] for e in full)), 4) if full else float("nan"),
        "server_cpu_s": trace[-1]["server_cpu_s"], "client_cpu_s": trace[-1]["client_cpu_s"]}
    meta["summary"] = summary
    line = (f"feeder-bench scale --rss-every {args.rss_every:g} --seconds {args.seconds:g}: "
            f"{synth.samples:.0e} samples, {args.shards} shards, rank {args.rank} of "
            f"{args.world_size}, shuffle_shards={args.window}, cache {cache_bytes / 2**20:.0f} MiB; "
            f"RSS {summary['rss_at_1min_mb']} MB at {summary['rss_at_1min_t_s']:.0f} s, "
            f"{summary['rss_end_mb']} MB at {summary['rss_end_t_s']:.0f} s, max "
            f"{summary['rss_max_mb']} MB, slope {summary['rss_slope_mb_per_h_after_1min']} MB/h; "
            f"{summary['epochs_complete']} epochs complete, bytes fetched / their shard bytes "
            f"{summary['fetched_over_shard_bytes_complete_epochs']}; cache at most "
            f"{summary['cache_max_mb']} MB; {summary['samples']} samples")
    print(line)
    table = report.format_table(
        epochs, [("epoch", "epoch", "{}"), ("complete", "complete", "{}"),
                 ("samples", "samples", "{}"), ("seconds", "s", "{}"),
                 ("tar_bytes_fetched", "bytes fetched", "{}"),
                 ("epoch_shard_bytes", "epoch's shard bytes", "{}"),
                 ("fetched_over_shard_bytes", "ratio", "{}")],
        title="bytes fetched per epoch")
    print(table)
    report.write_outputs(args.out, "scale_long", epochs, meta, {"rss": trace})
    with open(os.path.join(args.out, "scale_long.txt"), "w") as out:
        out.write(line + "\n\n" + table + "\n")
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([r["t_s"] / 60 for r in trace], [r["rss_mb"] for r in trace], label="RSS")
        ax.plot([r["t_s"] / 60 for r in trace], [r["cache_mb"] for r in trace], label="disk cache")
        ax.set_xlabel("minutes")
        ax.set_ylabel("MB")
        ax.legend()
        ax.set_title(f"{synth.samples:.0e} samples, rank {args.rank} of {args.world_size}")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "scale_rss.png"), dpi=90)
    except ImportError:
        pass  # the CSV holds the same
    return 0


def run(args: argparse.Namespace) -> int:
    if args.rss_every is not None:
        if args.rss_every <= 0:
            raise ValueError(f"--rss-every must be > 0 seconds, got {args.rss_every}")
        return run_long(args)
    from feeder.order.epoch import ShardLayout, pass_sequence, shard_sizes, shard_stream_order  # noqa: PLC0415
    from feeder.shards import TarShards  # noqa: PLC0415

    from .synth import SynthServerProcess  # noqa: PLC0415

    _import_stack(args.s3)
    work, image_path, synth = _dataset(args, "feeder-scale-")
    image = synth.image
    n = synth.samples
    meta: dict[str, Any] = {
        "shards": args.shards, "per_shard": args.per, "samples": n, "shard_bytes": synth.size,
        "data_bytes": synth.size * args.shards, "world_size": args.world_size, "rank": args.rank,
        "window_shards": args.window, "batch_size": args.batch_size,
        "protocol": "s3" if args.s3 else "http",
        "decode_threads": args.decode_threads, "read_threads": args.read_threads,
        "image_bytes": len(image)}
    cache_bytes = int(args.cache_shards * synth.size)
    meta["cache_bytes"] = cache_bytes
    rss_start = _rss()
    rows: list[dict[str, Any]] = []
    try:
        with SynthServerProcess(args.shards, args.per, image_path) as server:
            report.progress(f"server at {server.url}: {args.shards} shards x {args.per} samples "
                            f"({synth.size * args.shards / 1e12:.2f} TB synthesized on request)")
            t0, c0 = time.perf_counter(), time.process_time()
            if args.s3:
                # The server answers S3's path-style requests too (its paths end the same).
                listing = "s3://synth/train.json"
                options: dict | None = {"client_kwargs": {"endpoint_url": server.url},
                                        "key": "bench", "secret": "bench"}
            else:
                listing, options = server.url + "/train.json", None
            src = TarShards(listing, cache_dir=os.path.join(work, "cache"),
                            cache_bytes=cache_bytes, lazy_index=True, storage_options=options)
            meta["construction_s"] = time.perf_counter() - t0
            # CPU time too: on a shared machine the wall time waits for cores.
            meta["construction_cpu_s"] = time.process_time() - c0
            meta["construction_requests"] = server.counts(reset=True)
            meta["rss_after_construction"] = _rss() - rss_start
            report.progress(f"TarShards: {meta['construction_s']:.2f} s, {len(src)} samples, "
                            f"{meta['construction_requests']}")
            # This rank's shards: the windows of its chunk of the permuted stream.
            layout = ShardLayout(tuple(src.shard_ranges()), 8192, shards=args.window)
            order = shard_stream_order(layout, args.seed, 0, args.rank, args.world_size, True)
            mine = sorted({s for w in range(order.windows()) for s in order.window_shard_numbers(w)})
            meta["rank_shards"] = len(mine)
            meta["rank_samples"] = shard_sizes(n, args.world_size, True)[args.rank]
            remote = _run_feeder(src, args, args.rank, args.world_size, args.seconds, None,
                                 state_at=max(1, meta["rank_samples"] // args.batch_size // 2),
                                 server_pid=server.pid)
            src.wait_downloads(60)
            fetched = server.counts()
            src.close()
        meta["fetched"] = fetched
        tar_bytes = fetched.get("tar_bytes", 0)
        rank_bytes = len(mine) * synth.size
        meta["rank_shard_bytes"] = rank_bytes
        meta["fetched_over_rank_bytes"] = tar_bytes / rank_bytes if rank_bytes else float("nan")
        trace = remote.pop("rss_trace")
        times = remote.pop("batch_times")
        meta["remote"] = remote
        meta["rss_trace"] = trace
        meta["rss_growth_after_first_batch"] = max(r for _, _, r in trace) - remote["rss_first_batch"]
        # Warm: after the first window (its shards were fetched while it was read).
        warm_skip = min(len(times) // 3, max(1, args.window * args.per // args.batch_size))
        meta["remote_steady_samples_per_s"] = _steady(times, args.batch_size, warm_skip)
        cpu, server_cpu = remote.pop("batch_cpu"), remote.pop("batch_server_cpu")
        meta["remote_samples_per_client_cpu_s"] = _steady(cpu, args.batch_size, warm_skip)
        steady_wall = times[-1] - times[warm_skip] if len(times) > warm_skip + 1 else float("nan")
        meta["server_cpu_s_steady"] = (server_cpu[-1] - server_cpu[warm_skip]
                                       if len(server_cpu) > warm_skip + 1 else float("nan"))
        meta["server_cpu_share_steady"] = meta["server_cpu_s_steady"] / steady_wall
        meta["remote_samples_per_cpu_s_with_server"] = (
            (len(cpu) - 1 - warm_skip) * args.batch_size
            / (cpu[-1] - cpu[warm_skip] + meta["server_cpu_s_steady"])
            if len(cpu) > warm_skip + 1 else float("nan"))

        # The same pipeline on local copies of the same shards (one rank reading them all).
        local_dir = os.path.join(work, "local")
        os.makedirs(local_dir)
        entries = []
        for k in mine:
            with open(os.path.join(local_dir, synth.name(k)), "wb") as f:
                step = 256 * synth.span
                for a in range(0, synth.size, step):
                    f.write(synth.read(k, a, a + step))
            with open(os.path.join(local_dir, synth.name(k)[:-4] + ".idx"), "w") as f:
                f.write(synth.index_text(k))
            entries.append({"url": synth.name(k), "nsamples": args.per, "filesize": synth.size})
        with open(os.path.join(local_dir, "train.json"), "w") as f:
            json.dump({"shardlist": entries}, f)
        local_src = TarShards(os.path.join(local_dir, "train.json"), lazy_index=True)
        local = _run_feeder(local_src, args, 0, 1, args.seconds,
                            min(args.local_batches + warm_skip, len(times)), None)
        local_src.close()
        ltimes = local.pop("batch_times")
        lcpu = local.pop("batch_cpu")
        local.pop("batch_server_cpu")
        local.pop("rss_trace")
        meta["local"] = local
        meta["local_steady_samples_per_s"] = _steady(ltimes, args.batch_size, warm_skip)
        meta["remote_over_local"] = (meta["remote_steady_samples_per_s"]
                                     / meta["local_steady_samples_per_s"])
        meta["local_samples_per_client_cpu_s"] = _steady(lcpu, args.batch_size, warm_skip)
        meta["remote_over_local_per_client_cpu"] = (meta["remote_samples_per_client_cpu_s"]
                                                    / meta["local_samples_per_client_cpu_s"])
        meta["remote_over_local_per_cpu_with_server"] = (
            meta["remote_samples_per_cpu_s_with_server"] / meta["local_samples_per_client_cpu_s"])

        # The global shuffle over the whole list: no array, at once.
        t0 = time.perf_counter()
        seq = pass_sequence(n, args.batch_size, True, True, False, args.seed, 0, args.rank,
                            args.world_size)
        first = seq[:args.batch_size]
        meta["global_order_first_batch_s"] = time.perf_counter() - t0
        meta["global_order_len"] = len(seq)
        assert len(first) == args.batch_size
    finally:
        shutil.rmtree(work, ignore_errors=True)

    quality = shuffle_quality(args.shards, args.per, 1000, [1, 2, 4, 16, 64, 256],
                              positions=200_000, batch=args.batch_size, seed=args.seed)
    rows = [
        {"measure": "construction (s)", "value": round(meta["construction_s"], 3),
         "target": "< 1"},
        {"measure": "construction, CPU time of this process (s)",
         "value": round(meta["construction_cpu_s"], 3), "target": ""},
        {"measure": "requests at construction", "value": sum(
            v for k, v in meta["construction_requests"].items() if k.endswith("requests")),
         "target": "no request per shard"},
        {"measure": "first batch (s)", "value": round(remote["first_batch_s"], 2), "target": "< 5"},
        {"measure": "RSS growth after the first batch (MB)",
         "value": round(meta["rss_growth_after_first_batch"] / 2**20, 1), "target": "< 200"},
        {"measure": "RSS after construction (MB over the start)",
         "value": round(meta["rss_after_construction"] / 2**20, 1), "target": ""},
        {"measure": "resume state (bytes, pickled)", "value": remote.get("state_bytes"),
         "target": "< 65536"},
        {"measure": "bytes fetched / this rank's shard bytes",
         "value": round(meta["fetched_over_rank_bytes"], 3), "target": "<= 1.1"},
        {"measure": "cache bound / data", "value": f"{cache_bytes / meta['data_bytes']:.2e}",
         "target": "0.01"},
        {"measure": "steady samples/s, remote", "value": round(meta["remote_steady_samples_per_s"]),
         "target": ""},
        {"measure": "steady samples/s, local shards",
         "value": round(meta["local_steady_samples_per_s"]), "target": ""},
        {"measure": "remote / local", "value": round(meta["remote_over_local"], 3),
         "target": ">= 0.9"},
        {"measure": "samples per CPU s of the loader's process, remote",
         "value": round(meta["remote_samples_per_client_cpu_s"]), "target": ""},
        {"measure": "samples per CPU s of the loader's process, local",
         "value": round(meta["local_samples_per_client_cpu_s"]), "target": ""},
        {"measure": "remote / local, per CPU s of the loader's process",
         "value": round(meta["remote_over_local_per_client_cpu"], 3), "target": ">= 0.9"},
        {"measure": "remote / local, per CPU s with the server's",
         "value": round(meta["remote_over_local_per_cpu_with_server"], 3), "target": ""},
        {"measure": "server CPU s per second, steady remote",
         "value": round(meta["server_cpu_share_steady"], 3), "target": ""},
        {"measure": "global shuffle over the list: order + first batch (s)",
         "value": round(meta["global_order_first_batch_s"], 4), "target": "instant"},
        {"measure": "rank's epoch completed", "value": remote["epoch_done"], "target": ""},
    ]
    main = report.format_table(rows, [("measure", "measure", "{}"), ("value", "value", "{}"),
                                      ("target", "target", "{}")],
                               title=f"feeder-bench scale ({'S3' if args.s3 else 'HTTP'}): "
                                     f"{n:.0e} samples, {args.shards} shards, "
                                     f"rank {args.rank} of {args.world_size}, shuffle_shards="
                                     f"{args.window}, cache {cache_bytes / 2**20:.0f} MiB")
    table = report.format_table(quality, [("order", "order", "{}"),
                                          ("lag1_autocorrelation", "lag-1 autocorr.", "{:.4f}"),
                                          ("classes_per_batch", "classes/batch", "{:.2f}"),
                                          ("classes_in_first_window", "classes in window 0",
                                           "{}")],
                                title=f"shuffle quality: first 200000 samples of an epoch, 1000 "
                                      f"classes laid out in order, batch {args.batch_size}")
    print(main)
    print(table)
    report.write_outputs(args.out, "scale", rows, meta, {"quality": quality})
    # The tables as printed, for the docs (included by docs/guides/web-scale.md).
    for name, text in (("scale.txt", main), ("scale_quality.txt", table)):
        with open(os.path.join(args.out, name), "w") as f:
            f.write(text)
    return 0
