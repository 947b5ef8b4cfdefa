"""The ``feeder-pack`` command (:func:`main`): its arguments, a source named as
``module:name`` (:func:`load_source`), and its ending: a summary, or one line
naming what is at fault (``--debug``: the traceback) with exit status 2 for a
pack that cannot run as asked, 1 for another failure.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import UserCodeError, call_user, error_line
from ..storage.packsample import PackError
from ..storage.sizes import parse_size
from .packer import pack


def load_source(spec: str) -> Any:
    """The source named by ``module:name`` (``name`` an object with ``__len__`` and
    ``read``, or a class or function making one without arguments), imported with the
    current directory on the path, as ``python -m`` would.

    Raises:
        PackError: the module or the name cannot be found, or it is not a source.
        UserCodeError: the module, class or function named raised.
    """
    import importlib  # noqa: PLC0415

    module, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise PackError(f"{spec!r}: cannot find the source ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # the module's own code failed: the user's, said as such
        raise UserCodeError(f"SOURCE {spec}: importing {module!r} raised {type(exc).__name__}: "
                            f"{exc}") from exc
    if isinstance(obj, type) or (callable(obj) and not (hasattr(obj, "read")
                                                         and hasattr(obj, "__len__"))):
        obj = call_user(f"SOURCE {spec}", obj)  # a class, or a function making the source
    if not (hasattr(obj, "read") and hasattr(obj, "__len__")):
        raise PackError(f"{spec!r} is {type(obj).__name__}, not a source (an object with __len__ "
                        f"and read(index))")
    return obj


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="feeder-pack",
        description="Pack an ImageFolder, a file list or any feeder source (module:name; dict "
                    "samples keep their masks, boxes and other fields) into WebDataset tar "
                    "shards with offset indices (DALI wds2idx v1.2) and a shard list (<name>.json).")
    p.add_argument("source", metavar="SOURCE_DIR",
                   help="ImageFolder root (root/<class>/<image>), a text file of 'path [label]' "
                        "lines, or module:name of a feeder source (or of a function returning "
                        "one), whose dict samples keep all their fields")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where the shards go")
    p.add_argument("--shard-size", default="64MB", type=_size,
                   help="most bytes per shard (default 64MB; k/M/G = 1000s, KiB/MiB/GiB = 1024s)")
    p.add_argument("--name", default="train", help="shard name prefix (default train)")
    p.add_argument("--max-side", type=int, default=None,
                   help="re-encode images whose longer side exceeds N pixels down to N")
    p.add_argument("--quality", type=int, default=90,
                   help="JPEG/WebP quality of re-encoded images (default 90)")
    p.add_argument("--workers", type=int, default=None,
                   help="threads reading (and re-encoding) images (default: cores, at most 8)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a pack of this name in OUT_DIR instead of resuming it")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the full traceback instead of one line")
    return p


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _size(text: str) -> int:
    """--shard-size: parse_size's error as argparse's one line (the function's name otherwise)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """The ``feeder-pack`` command; returns the exit status: 0, 2 for a pack that
    cannot run as asked (or unreadable input), 1 for another failure (the
    source's own code raising), 130 when interrupted (Ctrl-C). An error is one
    line on stderr naming what is at fault (``--debug``: the traceback instead)."""
    args = build_parser().parse_args(argv)
    try:
        source: Any = args.source
        if not os.path.exists(source) and re.fullmatch(r"[\w.]+:[\w.]+", source):
            source = load_source(source)
        result = pack(source, args.out_dir, shard_size=args.shard_size, name=args.name,
                      max_side=args.max_side, quality=args.quality, workers=args.workers,
                      overwrite=args.overwrite, progress=not args.quiet)
    except KeyboardInterrupt:
        if args.debug:
            raise
        sys.stderr.write("feeder-pack: interrupted\n")
        return 130
    except Exception as exc:
        if args.debug:
            raise
        sys.stderr.write(f"feeder-pack: error: {error_line(exc)}\n")
        # what the pack was asked, or its input, cannot work; anything else is a failure
        return 2 if isinstance(exc, (PackError, OSError, ValueError)) else 1
    out = sys.stdout
    out.write(f"{_count(result.samples, 'sample')} in {_count(len(result.shards), 'shard')} in {args.out_dir}"
              + (f" ({result.resumed} shards kept from an earlier run)" if result.resumed else "")
              + "\n")
    if args.max_side:
        out.write(f"{result.reencoded} images re-encoded to at most {args.max_side} px (with "
                  f"their masks and boxes)\n")
    for path in result.kept:
        out.write(f"kept as is (could not decode to re-encode): {path}\n")
    for path in result.skipped:
        out.write(f"skipped, not a regular file: {path}\n")
    out.write(f"shard list: {result.manifest}\n")
    out.write(f"train with: TarShards({result.manifest!r})\n")
    return 0
