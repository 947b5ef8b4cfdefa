"""The local cache of remote shards (see :mod:`feeder.storage.remote`): whole files
on local disk, bounded in bytes, shared by processes (a lock file per entry, an
eviction lock), written under temporary names and renamed when complete."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .fetch import _split_query
from .sizes import parse_size
from .http import Validator

# The records keep the logger of the module these came from.
log = logging.getLogger("feeder.storage.remote")

DEFAULT_CACHE_BYTES = 32 << 30


def cache_root(cache_dir: Any) -> str | None:
    """The cache folder: ``cache_dir``, else ``$FEEDER_CACHE``, else ``~/.cache/feeder``;
    None when ``cache_dir`` is False."""
    if cache_dir is False:
        return None
    if cache_dir is None:
        cache_dir = os.environ.get("FEEDER_CACHE") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "feeder")
    return os.fspath(cache_dir)


def cache_limit(cache_bytes: int | None) -> int:
    if cache_bytes is None:
        env = os.environ.get("FEEDER_CACHE_BYTES")
        if env:
            return parse_size(env)
        return DEFAULT_CACHE_BYTES
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise ValueError(f"cache_bytes must be an int >= 0 (bytes), got {cache_bytes!r}")
    return cache_bytes


_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class ShardCache:
    """Whole remote files, kept on local disk, bounded in bytes (see the module docstring).

    Each entry has a record in ``shards/.meta/`` (JSON: its URL, size, validator
    and hash); an entry without one, or whose size differs from it, is not used.
    Temporary copies left by processes that no longer exist are removed when the
    cache is opened and at each eviction.

    Args:
        root: The cache folder (``shards/`` is made under it).
        max_bytes: The bound on complete entries, bytes.
    """

    def __init__(self, root: str, max_bytes: int) -> None:
        self.dir = os.path.join(root, "shards")
        self.meta_dir = os.path.join(self.dir, ".meta")
        os.makedirs(self.meta_dir, exist_ok=True)
        self.max_bytes = max_bytes
        self.remove_dead_partials()

    def path(self, url: str) -> str:
        digest = hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()[:20]
        # The readable part of the name: the URL's last path element, in safe
        # characters only, so no URL can name a path outside the cache folder.
        last = _split_query(url)[0].rstrip("/").rsplit("/", 1)[-1][-80:]
        base = "".join(ch if ch in _SAFE else "_" for ch in last).lstrip(".") or "file"
        return os.path.join(self.dir, f"{digest}-{base}")

    def _meta_path(self, path: str) -> str:
        return os.path.join(self.meta_dir, os.path.basename(path) + ".json")

    def record(self, path: str) -> dict[str, Any] | None:
        """The record kept beside the entry at ``path`` (None: none, or unreadable)."""
        try:
            with open(self._meta_path(path), encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError, RecursionError):
            return None
        return rec if isinstance(rec, dict) else None

    def update_record(self, path: str, **fields: Any) -> None:
        rec = self.record(path)
        if rec is None:
            return
        rec.update(fields)
        self._write_record(path, rec)

    def _write_record(self, path: str, rec: dict[str, Any]) -> None:
        meta = self._meta_path(path)
        tmp = f"{meta}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(rec, f)
        os.replace(tmp, meta)

    def lookup(self, url: str, expect: Validator | None = None) -> str | None:
        """The entry of ``url`` when it is there and matches its record (and
        ``expect``, when given); a damaged or stale entry is removed."""
        p = self.path(url)
        try:
            size = os.path.getsize(p)
        except OSError:
            return None
        rec = self.record(p)
        recorded = Validator.from_dict(rec.get("validator")) if rec else None
        why = None
        if rec is None or rec.get("url") != url or recorded is None:
            why = "has no valid record beside it"
        elif recorded.size is not None and size != recorded.size:
            why = f"holds {size} bytes, its record says {recorded.size} (damaged outside feeder)"
        elif expect is not None and expect.change_from(recorded):
            # cached -> now served
            why = f"is another version of the file ({expect.change_from(recorded)})"
        if why is not None:
            log.warning("cache entry %s (%s) %s: removed", p, url, why)
            self.remove(url)
            return None
        return p

    def recorded(self, url: str) -> Validator | None:
        """The validator recorded with ``url``'s entry (None: no entry or record)."""
        rec = self.record(self.path(url))
        return Validator.from_dict(rec.get("validator")) if rec else None

    def remove(self, url: str) -> None:
        """Remove ``url``'s entry and its record (a process reading it keeps its descriptor)."""
        p = self.path(url)
        _unlink(p)
        _unlink(self._meta_path(p))

    def touch(self, path: str) -> None:
        """Mark ``path`` used now (eviction removes the least recently used first)."""
        try:
            os.utime(path)
        except OSError:
            pass

    @contextmanager
    def owning(self, url: str, wait: bool = False) -> Iterator[bool]:
        """Hold ``url``'s entry lock: yields False when another copier (a process, or
        another thread's copy) holds it, or, with ``wait``, once it is released."""
        fd = os.open(self.path(url) + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    def temp(self, url: str) -> str:
        return f"{self.path(url)}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def put_bytes(self, url: str, data: bytes, validator: Validator | None = None,
                  **extra: Any) -> str:
        """Store a small file (an index) atomically; return its path."""
        tmp = self.temp(url)
        with open(tmp, "wb") as f:
            f.write(data)
        return self.commit(tmp, url, validator, **extra)

    def commit(self, tmp: str, url: str, validator: Validator | None = None, **extra: Any) -> str:
        """Rename a finished copy into place (its record first); evict down to the
        bound when the total passes it.

        The total of complete entries is kept in ``shards/.total``, updated under
        the eviction lock, so a commit costs no listing of the folder; a missing
        or unreadable total (or an entry replaced) makes it list and recount.
        Files removed by hand only make the kept total too high: the next commit
        that passes the bound recounts."""
        final = self.path(url)
        size = os.path.getsize(tmp)
        seen = (validator or Validator()).merged(Validator(size))
        with self._locked():
            replaced = os.path.exists(final)
            self._write_record(final, {"url": url, "validator": seen.to_dict(), **extra})
            os.replace(tmp, final)
            total = None if replaced else self._read_total()
            if total is not None and total + size <= self.max_bytes:
                self._write_total(total + size)
            else:
                self._evict_locked(keep=final)
        return final

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.dir, ".evict.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read_total(self) -> int | None:
        try:
            with open(os.path.join(self.dir, ".total"), encoding="ascii") as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def _write_total(self, total: int) -> None:
        tmp = os.path.join(self.dir, f".total.{os.getpid()}")
        with open(tmp, "w", encoding="ascii") as f:
            f.write(str(total))
        os.replace(tmp, os.path.join(self.dir, ".total"))

    def evict(self, keep: str | None = None) -> int:
        """Remove least recently used entries until the total fits; return bytes removed.
        Temporary files of processes that no longer exist are removed too."""
        with self._locked():
            return self._evict_locked(keep)

    def remove_dead_partials(self) -> int:
        """Remove the temporary copies of processes that no longer exist (a job
        killed mid-copy); return the bytes freed."""
        freed = 0
        with self._locked():
            with os.scandir(self.dir) as it:
                for e in it:
                    if _dead_partial(e.name):
                        try:
                            freed += e.stat().st_size
                        except FileNotFoundError:
                            continue
                        _unlink(e.path)
        if freed:
            log.info("cache %s: removed %d bytes of copies left by dead processes", self.dir, freed)
        return freed

    def partial_bytes(self) -> int:
        """Bytes of copies in progress (of live processes) now on disk."""
        total = 0
        with os.scandir(self.dir) as it:
            for e in it:
                if ".part-" in e.name:
                    try:
                        total += e.stat().st_size
                    except FileNotFoundError:
                        pass
        return total

    def _evict_locked(self, keep: str | None = None) -> int:
        removed = 0
        entries = []
        total = 0
        with os.scandir(self.dir) as it:
            for e in it:
                name = e.name
                if name.startswith(".") or name.endswith(".lock"):
                    continue
                if ".part-" in name:
                    if _dead_partial(name):
                        _unlink(e.path)
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, e.path))
                total += st.st_size
        entries.sort()
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            _unlink(path)
            _unlink(self._meta_path(path))
            total -= size
            removed += size
            log.debug("cache: evicted %s (%d bytes)", path, size)
        self._write_total(total)
        return removed

    def total_bytes(self) -> int:
        """Bytes of complete entries."""
        total = 0
        with os.scandir(self.dir) as it:
            for e in it:
                if not (e.name.startswith(".") or e.name.endswith(".lock") or ".part-" in e.name):
                    try:
                        total += e.stat().st_size
                    except FileNotFoundError:
                        pass
        return total


def _dead_partial(name: str) -> bool:
    if ".part-" not in name:
        return False
    pid = name.rsplit(".part-", 1)[1].split("-", 1)[0]
    return pid.isdigit() and not _alive(int(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
