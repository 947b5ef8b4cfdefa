"""Positional reads of local files, shared by every reading thread.

``os.pread`` takes the offset with each call, so any number of threads (and
forked children) read one descriptor without sharing a file position, and no
lock is held while a read waits on the disk. Descriptors are kept open (opening
a file per sample is the cost packed shards exist to avoid) up to a limit,
least recently used first out; one in use by a read is never closed under it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

# Open descriptors kept per pool: far below the usual soft limit of 1024, and
# enough that a job cycling through many shards reopens rarely.
DEFAULT_OPEN_FILES = 128


class FilePool:
    """Open-once, read-anywhere access to local files.

    Args:
        limit: Most descriptors kept open when idle.
    """

    def __init__(self, limit: int = DEFAULT_OPEN_FILES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        # path -> [fd, readers now, closed while read]
        self._open: OrderedDict[str, list] = OrderedDict()
        _pools.add(self)

    def after_fork(self) -> None:
        """In a forked child (a DataLoader worker): a parent thread may have held
        the lock, and its reads will never finish here. The descriptors are
        inherited and stay usable (pread shares no position)."""
        self._lock = threading.Lock()
        for entry in self._open.values():
            entry[1] = 0

    def _acquire(self, path: str, check: Callable[[int], None] | None = None) -> list:
        with self._lock:
            entry = self._open.get(path)
            if entry is not None:
                self._open.move_to_end(path)
                entry[1] += 1
                return entry
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))  # outside the lock: may block
        if check is not None:
            try:
                check(fd)
            except BaseException:
                os.close(fd)
                raise
        with self._lock:
            entry = self._open.get(path)
            if entry is not None:  # another thread opened it meanwhile
                os.close(fd)
                entry[1] += 1
                return entry
            entry = [fd, 1, False]
            self._open[path] = entry
            if len(self._open) > self.limit:
                for old in list(self._open):
                    if len(self._open) <= self.limit:
                        break
                    e = self._open[old]
                    if e[1] == 0:
                        del self._open[old]
                        os.close(e[0])
            return entry

    def _release(self, entry: list) -> None:
        with self._lock:
            entry[1] -= 1
            if entry[2] and entry[1] == 0:
                os.close(entry[0])

    def pread(self, path: str, length: int, offset: int,
              check: Callable[[int], None] | None = None) -> bytes:
        """Up to ``length`` bytes of ``path`` from ``offset`` (fewer only at the end of the file).

        Args:
            check: Called with each new descriptor of ``path`` before it is kept
                or read (it raises to refuse the file: one changed since its
                index was made).
        """
        entry = self._acquire(path, check)
        try:
            fd = entry[0]
            data = os.pread(fd, length, offset)
            if len(data) < length and data:
                # A large read may come back in pieces; the end of the file stops it.
                parts = [data]
                got = len(data)
                while got < length:
                    more = os.pread(fd, length - got, offset + got)
                    if not more:
                        break
                    parts.append(more)
                    got += len(more)
                data = b"".join(parts)
            return data
        finally:
            self._release(entry)

    def forget(self, path: str) -> None:
        """Close ``path``'s descriptor (once its reads finish): the file was replaced."""
        with self._lock:
            entry = self._open.pop(path, None)
            if entry is not None:
                if entry[1] == 0:
                    os.close(entry[0])
                else:
                    entry[2] = True

    def close(self) -> None:
        """Close every idle descriptor; busy ones close when their read returns. Safe to repeat."""
        with self._lock:
            entries = list(self._open.values())
            self._open.clear()
            for entry in entries:
                if entry[1] == 0:
                    os.close(entry[0])
                else:
                    entry[2] = True


def after_fork_registry() -> "weakref.WeakSet[Any]":
    """A set of live objects whose ``after_fork()`` runs in a forked child, where
    their locks, threads and open files are the parent's (held weakly: an object
    leaves the set when it is collected)."""
    registry: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def after_fork_in_child() -> None:
        for obj in list(registry):
            obj.after_fork()

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=after_fork_in_child)
    return registry


_pools: "weakref.WeakSet[FilePool]" = after_fork_registry()


# File systems whose reads wait on a network or a user-space daemon: a read there
# can take milliseconds (or hang), so sources on them get a read stage by default.
NETWORK_FILE_SYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "lustre", "gpfs", "beegfs",
    "ceph", "cephfs", "glusterfs", "orangefs", "pvfs2", "panfs", "wekafs", "davfs", "fuse",
    "fuseblk", "sshfs", "s3fs", "gcsfuse", "juicefs", "alluxio", "quobyte",
})


def _read_mounts() -> str | None:
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError:
        return None


def _mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of this process's mounts, longest first;
    empty where ``/proc/self/mounts`` does not exist (not Linux)."""
    text = _read_mounts()
    if text is None:
        return []
    rows = [line.split()[1:3] for line in text.splitlines() if len(line.split()) >= 3]
    # Mount points escape spaces and the like as octal (\040).
    decoded = [(p.encode().decode("unicode_escape", "surrogateescape"), t) for p, t in rows]
    return sorted(decoded, key=lambda row: len(row[0]), reverse=True)


def file_system_type(path: str, mounts: list[tuple[str, str]] | None = None) -> str | None:
    """The type of the file system holding ``path`` (``"ext4"``, ``"nfs4"``...), or None
    when it cannot be told (no ``/proc/self/mounts``)."""
    mounts = _mounts() if mounts is None else mounts
    real = os.path.realpath(path)
    for point, kind in mounts:
        if real == point or real.startswith(point.rstrip("/") + "/"):
            return kind
    return None


def on_network_storage(paths: list[str]) -> bool:
    """Whether any of ``paths`` is on a network or FUSE file system (see
    :data:`NETWORK_FILE_SYSTEMS`; ``fuse.*`` types included). False where the
    file system cannot be told."""
    mounts = _mounts()
    for path in paths:
        kind = file_system_type(path, mounts)
        if kind is not None and (kind in NETWORK_FILE_SYSTEMS or kind.startswith("fuse.")):
            return True
    return False


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No garbage collection inside: a list of 10^5 shards (``TarShards``) makes some 10^6
    objects, all kept, and collections while they are made walk them again and
    again (a third of the construction's time). Held from the shard list's
    fetch and parsing to the shard objects (well under a second for 10^5 shards),
    not for the index requests."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
