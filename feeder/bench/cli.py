"""The ``feeder-bench`` command line: one subcommand per benchmark."""

from __future__ import annotations

import argparse
from collections.abc import Callable
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from ..errors import error_line

# Without --out, each run writes into a new folder of this name (plus a time
# stamp): never into an existing results folder, and never into the package's
# own checkout, whose bench/results/ holds the published figures (bench/run_all.sh
# regenerates them there with an explicit --out).
OUT_PREFIX = "feeder-bench-results-"
DEFAULT_OUT_HELP = (f"./{OUT_PREFIX}<date>-<time>, or the same under the system temp folder when "
                    f"the current folder is inside feeder's source checkout")


def checkout_root() -> Path | None:
    """The source checkout the running ``feeder`` package comes from, if any
    (an editable install or a run from the repository); None when installed."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "bench").is_dir() else None


def default_out(cwd: str | None = None) -> str:
    """A new, empty results folder (created here): ``./feeder-bench-results-<stamp>``,
    or under :func:`tempfile.gettempdir` when ``cwd`` is inside the source checkout."""
    here = Path(cwd or os.getcwd()).resolve()
    root = checkout_root()
    parent = Path(tempfile.gettempdir()) if root is not None and here.is_relative_to(root) else here
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = parent / (OUT_PREFIX + stamp + ("" if n == 1 else f"-{n}"))
        try:
            path.mkdir(parents=True)
        except FileExistsError:  # two runs in the same second
            continue
        return str(path)
    raise FileExistsError(f"no free results folder name under {parent} for {OUT_PREFIX}{stamp}")


def _ints(text: str) -> list[int]:
    from .compare import parse_ints

    values = parse_ints(text)
    if not values:  # an empty grid would measure nothing and say nothing of it
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


def _threads(text: str) -> list[tuple[int, int]]:
    from .compare import parse_threads

    return parse_threads(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="feeder-bench",
        description="Benchmarks of feeder against torch DataLoader, and tuning sweeps.")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback instead of one line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser, out: bool = True) -> None:
        p.add_argument("dir", help="ImageFolder dataset root (root/<class>/<image>)")
        if out:
            p.add_argument("--out", default=None,
                           help=f"folder for CSV/JSON/PNG results (default: a new folder, "
                                f"{DEFAULT_OUT_HELP})")
            p.add_argument("--seed", type=int, default=0, help="shuffle and augmentation seed")

    p = sub.add_parser("make-data", help="write a deterministic ImageFolder of photo-like JPEGs")
    common(p, out=False)
    p.add_argument("--n-classes", type=int, default=10, help="class folders (default 10)")
    p.add_argument("--per-class", type=int, default=100, help="images per class (default 100)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--large", action="store_true", help="large photos (~1500x1100) instead of 300-600 px")
    size.add_argument("--small", action="store_true",
                      help="small images (64-96 px a side: thumbnails, downsampled datasets)")
    p.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    p.add_argument("--force", action="store_true", help="write even if DIR already holds files")

    p = sub.add_parser("compare", help="feeder vs DataLoader (PIL and cv2) on the same work")
    common(p)
    p.add_argument("--epochs", type=int, default=1, help="epochs per measured run (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="alternating rounds of the finalists (default 5)")
    p.add_argument("--scan-repeats", type=int, default=1,
                   help="runs of each grid point when picking the best settings (default 1)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--workers-grid", type=_ints, default=[0, 1, 2, 3, 4],
                   help="DataLoader num_workers to try (default 0,1,2,3,4)")
    p.add_argument("--threads-grid", type=_threads, default=[(2, 0), (3, 0), (4, 0), (2, 1), (3, 1), (4, 2)],
                   help="feeder DECODExAUGMENT points to try; augment 0 runs the transforms in the "
                        "decode threads (default 2x0,3x0,4x0,2x1,3x1,4x2)")
    p.add_argument("--queue-size", type=int, default=4, help="feeder queue_size (default 4)")
    p.add_argument("--ceiling-images", type=int, default=500,
                   help="images timed per round for the ceiling, per thread or process (default 500)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--model", action="store_true",
                   help="the consumer runs a ResNet-style training step per batch (use with --device cuda)")
    p.add_argument("--targets", action="store_true",
                   help="also check the project's acceptance targets (a table and compare_targets.csv)")

    p = sub.add_parser("ceiling", help="single-thread cost of the per-sample work x cores, "
                                      "and the same work in one process per core at once")
    common(p)
    p.add_argument("--limit", type=int, default=500, help="images timed per thread or process (default 500)")
    p.add_argument("--processes", type=int, default=0,
                   help="processes of the parallel row (default: the cores available)")
    p.add_argument("--repeats", type=int, default=3, help="repeats, median kept (default 3)")
    p.add_argument("--full-decode-too", action="store_true", help="also time with full-size decode")

    p = sub.add_parser("overlap", help="CUDA: do the host-to-device copies overlap the model's compute? "
                                      "(torch.profiler trace and summary)")
    common(p)
    p.add_argument("--loaders", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                   default=["feeder", "dl-cv2"], help="loaders to profile (default feeder,dl-cv2)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader num_workers (default 4)")
    p.add_argument("--batches", type=int, default=30, help="profiled training steps (default 30)")
    p.add_argument("--warmup", type=int, default=10, help="steps before profiling (default 10)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")

    p = sub.add_parser("sweep", help="grid over feeder threads and queue size, with starvation")
    common(p)
    p.add_argument("--decode", type=_ints, default=[1, 2, 3, 4], help="decode threads (default 1,2,3,4)")
    p.add_argument("--augment", type=_ints, default=[0, 1, 2],
                   help="augment threads, 0 = run in the decode threads (default 0,1,2)")
    p.add_argument("--queue", type=_ints, default=[4], help="queue sizes (default 4)")
    p.add_argument("--step-ms", type=_floats, default=[0.0],
                   help="simulated training step per batch, ms; several give one plot panel each "
                        "(default 0)")
    p.add_argument("--epochs", type=int, default=1, help="epochs per point (default 1)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per point: the median and the spread are kept (default 3)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")

    p = sub.add_parser("scaled-decode", help="reduced-scale vs full JPEG decode on large photos")
    common(p)
    p.add_argument("--epochs", type=int, default=1, help="epochs per run (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--ceiling-images", type=int, default=100,
                   help="images timed for the single-thread cost (default 100)")
    from .region import add_parser as add_region

    add_region(sub, common)
    from .peers import add_parser as add_peers

    add_peers(sub, common, _ints)
    from .storage import add_parsers

    add_parsers(sub, common, _ints)

    from . import interference

    interference.add_parser(sub, DEFAULT_OUT_HELP)

    from . import scale

    scale.add_parser(sub, DEFAULT_OUT_HELP)
    return parser


# Numeric options shared by the subcommands, checked before any measurement (a
# bad one would otherwise surface minutes in, or as a run that measures nothing):
# each name with the least value it takes. Names a subcommand lacks are skipped.
_AT_LEAST = {
    1: ("batch_size", "epochs", "large_epochs", "repeats", "scan_repeats", "rounds", "limit",
        "ceiling_images", "stage_images", "n_classes", "per_class", "batches", "windows",
        "shards", "per", "world_size", "image_px", "local_batches", "loop_cores", "loader_cores",
        "proxy_ops", "size"),
    0: ("workers", "pil_workers", "processes", "warmup", "queue_size", "rank", "model_batch",
        "window", "decode_threads", "read_threads", "latency_ms", "window_s", "feed_share",
        "capacity_s", "cache_shards", "seconds", "rss_every", "shard_size", "seed"),
}
# Comma-separated lists, each item with its least value.
_LISTS_AT_LEAST = {"decode": 1, "augment": 0, "queue": 1, "workers_grid": 0, "step_ms": 0}


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, with argparse's one-line usage error (exit status 2), the paths and
    numbers no benchmark can run with, before any work starts; then make the
    ``--out`` folder, so that a place results cannot go is refused before measuring."""
    def bad(message: str) -> None:
        parser.error(message)

    for least, names in _AT_LEAST.items():
        for name in names:
            value = getattr(args, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not (
                    math.isfinite(value) and value >= least):
                bad(f"--{name.replace('_', '-')} must be a finite number >= {least}, got {value}")
    for name, least in _LISTS_AT_LEAST.items():
        for value in getattr(args, name, None) or []:
            if not (math.isfinite(value) and value >= least):
                bad(f"--{name.replace('_', '-')}: every value must be a finite number >= {least}, "
                    f"got {value}")
    for d, a in getattr(args, "threads_grid", None) or []:
        if d < 1 or a < 0:
            bad(f"--threads-grid: DECODExAUGMENT needs DECODE >= 1 and AUGMENT >= 0, got {d}x{a}")
    out = getattr(args, "out", None)
    if out is not None and os.path.exists(out) and not os.path.isdir(out):
        bad(f"--out {out!r} is a file, not a folder")
    root = getattr(args, "dir", None)
    if args.command == "make-data":
        if os.path.exists(root) and not os.path.isdir(root):
            bad(f"DIR {root!r} is a file, not a folder")
    elif root is not None and not getattr(args, "report", None):
        if not os.path.isdir(root):
            bad(f"DIR {root!r} is not a folder" + ("" if os.path.exists(root) else " (it does not exist)"))
        _check_folder(bad, "DIR", root)
    size = getattr(args, "shard_size", None)
    if isinstance(size, str):  # feeder-pack's shard size, as text ("64MB")
        from ..storage.sizes import parse_size

        try:
            parse_size(size)
        except ValueError as exc:
            bad(f"--shard-size: {exc}")
    shards = getattr(args, "shards", None)
    if isinstance(shards, str) and not os.path.exists(shards):
        bad(f"--shards {shards!r} does not exist (shards made by feeder-pack)")
    large = getattr(args, "large", None)
    if args.command == "region-decode" and large is None and not getattr(args, "report", None):
        bad("region-decode needs --large LARGE (an ImageFolder of large photos)")
    if isinstance(large, str):
        if not os.path.isdir(large):
            bad(f"--large {large!r} is not a folder")
        _check_folder(bad, "--large", large)
    rank, world_size = getattr(args, "rank", None), getattr(args, "world_size", None)
    if isinstance(rank, int) and isinstance(world_size, int) and not 0 <= rank < world_size:
        bad(f"--rank {rank} must be below --world-size {world_size}")
    device = getattr(args, "device", None)
    if device is not None:
        import torch

        try:
            parsed = torch.device(device)
        except (RuntimeError, ValueError):
            bad(f"--device {device!r} is not a device (cpu, cuda or cuda:N)")
        if parsed.type == "cuda":
            if not torch.cuda.is_available():
                bad(f"--device {device!r}: CUDA is not available on this machine")
            elif parsed.index is not None and parsed.index >= torch.cuda.device_count():
                bad(f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA "
                    f"device(s)")
        elif parsed.type != "cpu":
            bad(f"--device {device!r}: feeder-bench measures on cpu or cuda")
    if out is not None:  # last: a refused argument leaves no folder behind
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as exc:  # a file on the way, no permission: before any measurement
            bad(f"--out {out!r}: cannot make the folder: {exc.strerror or exc}")


def _check_folder(bad: Callable[[str], None], what: str, root: str) -> None:
    """Refuse a folder that is no ImageFolder of images before any run starts (each
    run would fail on it, one after the other, and leave an empty table)."""
    from .. import ImageFolder

    try:
        ImageFolder(root)
    except (OSError, ValueError) as exc:
        bad(f"{what} {root!r}: {str(exc).replace('pass allow_empty=True to accept them', 'remove them')}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``feeder-bench``; returns the exit status: 0, 2 for a bad
    argument, 1 for a failure while measuring, 130 when interrupted (Ctrl-C). An
    error is one line on stderr naming what is at fault (``--debug``: the
    traceback instead)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        return _run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        sys.stderr.write("feeder-bench: interrupted\n")
        return 130
    except Exception as exc:
        if args.debug:
            raise
        sys.stderr.write(f"feeder-bench: error: {error_line(exc)}\n")
        return 1


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from . import report

    report.set_quiet(args.quiet)
    if getattr(args, "out", "") is None:
        args.out = default_out()
        report.progress(f"results in {args.out} (--out to choose)")
    if args.command == "make-data":
        from . import data as module
    elif args.command == "compare":
        from . import compare as module  # type: ignore[no-redef]
    elif args.command == "ceiling":
        from . import ceiling as module  # type: ignore[no-redef]
    elif args.command == "overlap":
        from . import overlap as module  # type: ignore[no-redef]
    elif args.command == "sweep":
        from . import sweep as module  # type: ignore[no-redef]
    elif args.command in ("read-latency", "remote", "shards"):
        from . import storage as module  # type: ignore[no-redef]
    elif args.command == "region-decode":
        from . import region as module  # type: ignore[no-redef]
    elif args.command == "peers":
        from . import peers as module  # type: ignore[no-redef]
    elif args.command == "interference":
        from . import interference as module  # type: ignore[no-redef]
    elif args.command == "scale":
        from . import scale as module  # type: ignore[no-redef]
    else:
        from . import scaled as module  # type: ignore[no-redef]
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
