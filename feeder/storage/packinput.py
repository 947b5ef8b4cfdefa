"""The inputs of ``feeder-pack`` read from files: a file list (:func:`read_list`),
the regular files among listed paths (:func:`regular_files`, decided before any
is opened) and one input's bytes (:func:`read_input`, opened without blocking,
refused unless still a regular file). Errors name the file.
"""

from __future__ import annotations

import logging
import os
import stat

from .packsample import PackError

# The packer's own logger: its warnings are the command's.
logger = logging.getLogger("feeder.pack")


NEWLINE = b"\n"


def read_list(path: str) -> tuple[list[str], list[int]]:
    """A file list: one ``path [label]`` per line (``#`` starts a comment)."""
    paths, labels, _ = read_list_lines(path)
    return paths, labels


def read_list_lines(path: str) -> tuple[list[str], list[int], list[int]]:
    """:func:`read_list`, with each entry's line number."""
    base = os.path.dirname(os.path.abspath(path))
    paths, labels, numbers = [], [], []
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.read().split("\n")  # not splitlines: a path may hold \x0c, \x85...
        except UnicodeDecodeError as exc:
            where = ""
            if isinstance(exc.object, bytes):
                where = f"line {exc.object[:exc.start].count(NEWLINE) + 1}: "
            raise PackError(f"{path}: {where}not UTF-8 text ({exc.reason} at byte {exc.start}); a "
                            f"file list is one 'path [label]' per line") from None
        for no, line in enumerate(lines, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, rest = line.rpartition(" ") if "\t" not in line else line.rpartition("\t")
            label = -1
            if name and rest.lstrip("-").isdigit():
                label = int(rest)
            else:
                name = line
            if label < -1:
                raise PackError(f"{path}:{no}: label {label} is negative")
            paths.append(name if os.path.isabs(name) else os.path.join(base, name))
            labels.append(label)
            numbers.append(no)
    if not paths:
        raise PackError(f"{path}: the file list has no entry")
    return paths, labels, numbers


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISDIR, "directory")):
        if test(mode):
            return kind
    return "not a regular file"


def regular_files(paths: list[str], labels: list[int]) -> tuple[list[str], list[int], list[str]]:
    """The paths that are regular files (links followed), their labels, and the
    others as ``"path (kind)"``. Decided from ``os.stat`` before any is opened:
    opening a FIFO blocks until a writer comes, which may be never. A path that
    cannot be stat'ed stays: reading it fails with an error naming it."""
    keep_paths, keep_labels, skipped = [], [], []
    for path, label in zip(paths, labels):
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if stat.S_ISREG(mode):
            keep_paths.append(path)
            keep_labels.append(label)
        else:
            skipped.append(f"{path} ({file_kind(mode)})")
            logger.warning("feeder-pack: skipping %s: not a regular file (%s)", path, file_kind(mode))
    return keep_paths, keep_labels, skipped


def read_input(path: str) -> bytes:
    """The bytes of the input file ``path``; errors name it.

    Opened without blocking: a path replaced by a FIFO since it was listed would
    otherwise block the open until a writer comes. Then refused unless it is a
    regular file (checked on the open descriptor, so no later swap can fool it).

    Raises:
        PackError: ``path`` is not a regular file any more.
        OSError: opening or reading failed (EIO...), with ``path`` as its filename.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PackError(f"{path}: input is not a regular file ({file_kind(mode)}); it was one "
                            f"when the files were listed: rerun the pack")
        with open(fd, "rb", closefd=False) as f:
            try:
                return f.read()
            except OSError as exc:
                # A read's error has no filename: the packer's must say which input failed.
                raise OSError(exc.errno, f"reading input file: {exc.strerror}", path) from exc
    finally:
        os.close(fd)
