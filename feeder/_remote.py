"""Remote shards: range reads through fsspec, retries, and a local disk cache.

Any URL fsspec knows is read the same way: ``http(s)://`` with aiohttp
(``pip install 'feeder[remote]'`` installs both), ``s3://``, ``gs://``, ``az://``... once the user installs
that backend (s3fs, gcsfs, adlfs). fsspec was chosen over requests/urllib3
because it gives one interface for every object store, range reads included.

A sample is one range request (its fields are adjacent in the shard). The
first read from a shard also starts a copy of the whole shard into the cache,
in the background, one request per shard (``downloads`` at once): this is the
read-ahead, and once it is there every later read of the shard, this epoch and
the next, is a local ``pread``.

**Retries.** A request failing with a transient error (HTTP 408, 425, 429 or
5xx, a refused or dropped connection, a timeout) is retried ``retries`` times,
waiting ``backoff_s * 2**attempt`` seconds (with +-50% jitter, at most 10 s)
between tries; then it fails with :class:`RemoteError` naming the URL and the
last error. Any other 4xx fails at once (a 404 as ``FileNotFoundError``),
naming the URL and the status.

**Cache.** ``$FEEDER_CACHE`` or ``~/.cache/feeder`` (``cache_dir=`` overrides;
``cache_dir=False`` turns it off), under ``shards/``: one file per shard or index,
named by a hash of its URL and its own name. It is bounded by ``cache_bytes``
(default ``$FEEDER_CACHE_BYTES`` or 32 GiB): after each copy, the least recently
used entries are removed until the total fits (a shard larger than the bound is
never copied; copies in progress add at most ``downloads`` shards on top).
Several processes (the ranks of one job on a node) share it safely: a copy is
written under a temporary name and renamed when complete, so no reader ever
sees a partial shard; a lock file per entry makes one process copy it while the
others keep reading by range until it is there; eviction runs under a lock of
its own; a process reading a shard that another evicts keeps its open
descriptor (POSIX keeps the file until it is closed).

**What is verified** (so that storage cannot deliver wrong bytes silently):

- HTTP range reads must come back as ``206`` with a ``Content-Range`` naming
  exactly the bytes asked for (see :mod:`feeder._http`); a server that ignores
  ranges (answers ``200``) is read by copying each shard whole once (said once
  in the log): into the cache, or without one into a private temporary copy
  removed at ``close()``. Other fsspec back-ends: the length of every range.
- Each shard's *validator* (size, ``ETag``, ``Last-Modified``) is learned from
  the first answer and compared with every later answer and copy; it must hold
  the bytes its index points at. A change means the shard was re-published
  under the same URL: :class:`ShardChangedError` names it, and the stale index
  and copy are removed from the cache so that the next ``TarShards(...)``
  indexes the new version (offsets are never reused across versions).
- A copy is committed to the cache only when its size matches the server's
  ``Content-Length``, the shard's validator, and its index; with a ``sha256``
  in the shard list (``feeder-pack`` writes one), its hash too. Each cache
  entry has a record beside it (``shards/.meta/``: size, validator, hash); an
  entry whose size does not match its record (truncated outside feeder) is
  removed and fetched again; a copy that is damaged again fails naming the
  cache path. Bytes changed in place in the cache, at the same size, are not
  detected (no hash is computed on read).
- A cached copy and a cached index are used as recorded, without asking the
  server: a shard re-published while both are cached is read as the recorded
  version (consistent with its index) until the entries are evicted or the
  cache is cleared.
"""

from __future__ import annotations

import asyncio
import collections
import json
import errno
import fcntl
import hashlib
import logging
import os
import random
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Iterator, TypeVar

from . import _http
from ._http import Validator
from ._storage import FilePool
from ._tar import ShardFormatError, ShardIndex, index_path, scan

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_CACHE_BYTES = 32 << 30
# Reads of a copy in progress elsewhere look for the finished file this often (seconds).
_RECHECK_S = 2.0
# A copy that failed is tried again after this long (seconds); reads go by range meanwhile.
_RETRY_COPY_S = 30.0
_CHUNK = 4 << 20
_MAX_BACKOFF_S = 10.0
_TRANSIENT_STATUS = {408, 425, 429}
# Bounds on files read whole into memory (bytes): an index, a shard list.
MAX_INDEX_BYTES = 256 << 20
MAX_LIST_BYTES = 1 << 30
# A derived index (name.idx next to name.tar) answered with one of these does
# not exist for this client: object stores answer 403 for a key that does not
# exist when listing is not allowed, and a presigned URL's signature covers
# the shard only.
_NO_INDEX_STATUS = {401, 403, 404}


class RemoteError(OSError):
    """A remote read failed (the message names the URL and what happened)."""


class HashMismatch(_http.BadAnswer):
    """A copy whose hash is not the shard list's (fetched again, as a cut copy is)."""


class ShardChangedError(RemoteError):
    """A remote shard is not the version its index was read from (re-published
    under the same URL, or cut), or a cached copy of it is damaged."""


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
            from .pack import parse_size  # noqa: PLC0415

            return parse_size(env)
        return DEFAULT_CACHE_BYTES
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise ValueError(f"cache_bytes must be an int >= 0 (bytes), got {cache_bytes!r}")
    return cache_bytes


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    if isinstance(exc, FileNotFoundError):
        return 404
    if isinstance(exc, PermissionError):
        return 403
    return None


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, _http.BadAnswer):
        return True  # a proxy that cut one body may not cut the next
    if isinstance(exc, (_http.RedirectLoop, _http.RangesIgnored, _http.TooLarge, _http.DeadlinePassed,
                        InterruptedError, ShardChangedError, ShardFormatError)):
        return False
    status = _status(exc)
    if status is not None:
        return status >= 500 or status in _TRANSIENT_STATUS
    try:
        import aiohttp  # noqa: PLC0415

        if isinstance(exc, aiohttp.ClientError):
            return True
    except ImportError:
        pass
    return isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError, OSError))


class Retrier:
    """Runs a request, retrying transient failures with exponential backoff.

    Args:
        retries: Retries after the first try.
        backoff_s: The first wait, seconds (doubled each retry, +-50% jitter).
        stop: Set to cut the waits short (the reader is closing).
    """

    def __init__(self, retries: int, backoff_s: float, stop: threading.Event) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if not backoff_s >= 0:
            raise ValueError(f"backoff_s must be >= 0 seconds, got {backoff_s!r}")
        self.retries = retries
        self.backoff_s = backoff_s
        self.stop = stop

    def __call__(self, url: str, what: str, fn: Callable[[], T], deadline: float | None = None) -> T:
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                status = _status(exc)
                if isinstance(exc, (ShardChangedError, ShardFormatError)):
                    raise  # says what is wrong and where already
                if isinstance(exc, _http.DeadlinePassed):
                    raise RemoteError(f"{url}: {what} stalled: no answer before the deadline "
                                      f"(TarShards(deadline_s=...))") from exc
                if not _transient(exc):
                    code = f"HTTP {status}" if status is not None else type(exc).__name__
                    msg = f"{url}: {what} failed: {code}: {exc}"
                    if status == 404:
                        raise FileNotFoundError(errno.ENOENT, msg) from exc
                    raise RemoteError(msg) from exc
                if attempt == self.retries or self.stop.is_set():
                    raise RemoteError(f"{url}: {what} failed after {attempt + 1} tries: "
                                      f"{type(exc).__name__}: {exc}") from exc
                wait = min(_MAX_BACKOFF_S, self.backoff_s * 2 ** attempt * random.uniform(0.5, 1.5))
                if deadline is not None and time.monotonic() + wait >= deadline:
                    raise RemoteError(f"{url}: {what} failed and the deadline leaves no time "
                                      f"to retry (TarShards(deadline_s=...)): "
                                      f"{type(exc).__name__}: {exc}") from exc
                log.debug("%s: %s failed (%s), retry %d in %.2f s", url, what, exc, attempt + 1, wait)
                self.stop.wait(wait)
        raise AssertionError("unreachable")


_fs_lock = threading.Lock()
_fs_cache: dict[tuple[str, str], Any] = {}


def filesystem(url: str, options: dict | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path)`` for ``url``.

    Raises:
        ImportError: fsspec (or the URL's backend) is not installed; says what to install.
    """
    try:
        import fsspec  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(f"reading {url} needs fsspec and aiohttp: pip install 'feeder[remote]'") from exc

    options = dict(options or {})
    protocol = url.split("://", 1)[0]
    if protocol in ("http", "https"):
        import aiohttp  # noqa: PLC0415

        # A stalled server must fail (and be retried), not hang a read forever.
        options.setdefault("client_kwargs", {"timeout": aiohttp.ClientTimeout(
            total=None, sock_connect=30, sock_read=60)})
    key = (protocol, repr(sorted(options.items())))
    with _fs_lock:
        fs = _fs_cache.get(key)
        if fs is None or getattr(fs, "_feeder_pid", None) != os.getpid():
            fs = fsspec.filesystem(protocol, **options)
            fs._feeder_pid = os.getpid()
            _fs_cache[key] = fs
    return fs, url if protocol in ("http", "https") else fs._strip_protocol(url)


def _split_query(url: str) -> tuple[str, str]:
    """``(url without its query, "?query" or "")``: a presigned URL's query is
    its credentials, kept on the request but not part of the file's name."""
    base, sep, query = url.partition("?")
    return base, sep + query


def remote_index_url(url: str) -> str:
    """The index URL of a remote shard: ``.tar`` replaced by ``.idx`` in the path,
    the query (a presigned URL's signature) kept."""
    base, query = _split_query(url)
    return index_path(base) + query


def fetch_bounded(url: str, limit: int, retrier: Retrier, options: dict | None = None,
                  deadline: float | None = None) -> tuple[bytes, Validator | None]:
    """The whole of a small remote file (a shard list, an index), at most ``limit``
    bytes, and its validator (None where the back-end gives none).

    Raises:
        RemoteError: larger than ``limit`` (naming it), or the read failed.
        FileNotFoundError: it does not exist (404).
    """
    fs, path = filesystem(url, options)

    def get() -> tuple[bytes, Validator | None]:
        if _http.is_http(fs):
            data, seen, _ = _http.read_whole(fs, path, retrier.stop, limit=limit, deadline=deadline)
            return data, seen  # type: ignore[return-value]
        size = fs.size(path)
        if size is not None and size > limit:
            raise _http.TooLarge(size, limit)
        data = fs.cat_file(path)
        if len(data) > limit:
            raise _http.TooLarge(len(data), limit)
        return data, None

    try:
        return retrier(url, "read", get, deadline)
    except RemoteError as exc:
        if isinstance(exc.__cause__, _http.TooLarge):
            raise RemoteError(f"{url}: {exc.__cause__.size} bytes, more than the {limit} "
                              f"bytes such a file may hold: not an index or shard list") from None
        raise


def fetch_small(url: str, retrier: Retrier | None = None, options: dict | None = None,
                limit: int = MAX_LIST_BYTES, deadline: float | None = None) -> bytes:
    """The whole of a small remote file (a shard list), at most ``limit`` bytes."""
    retrier = retrier or Retrier(5, 0.2, threading.Event())
    return fetch_bounded(url, limit, retrier, options, deadline)[0]


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
        elif expect is not None and recorded.change_from(expect):
            why = f"is another version of the file ({recorded.change_from(expect)})"
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


class RemoteShard:
    """A shard at a URL: range reads until a local copy is there, then ``pread``.

    Attributes:
        validator: The version of the shard this process reads (learned from the
            first answer, a cache record or the cached index's record), None
            until known.
        index_end: Bytes the shard must hold (the end of its index's last member).
        sha256: The shard's hash from the shard list, hex (None: not given).
    """

    remote = True

    def __init__(self, url: str, store: "RemoteStore") -> None:
        self.name = url
        self.store = store
        self.local: str | None = None
        self.validator: Validator | None = None
        self.index_end = 0
        self.sha256: str | None = None
        self.list_size: int | None = None
        self._index_entry: str | None = None  # the cached index, to record the validator in
        self._damaged = 0  # local copies found damaged (one is fetched again, then it fails)
        self.broken: str | None = None  # why every read of this shard fails (a hash mismatch)
        self._checked = 0.0
        self._copy_after = 0.0  # when a failed copy may be tried again

    # -- the version being read -------------------------------------------------
    def confirm(self, seen: Validator, where: str = "the server", copy: bool = False) -> None:
        """Check an answer's validator against the version this process reads.

        A copy whose size alone is wrong was cut on its way (transient: it is
        fetched again); a changed ``ETag`` or ``Last-Modified``, or a server
        saying the shard is smaller than its index, is another version.

        Raises:
            ShardChangedError: another version (the stale cache entries are removed).
            BadAnswer: a copy of the wrong size.
        """
        if self.broken is not None:
            raise ShardChangedError(self.broken)
        with self.store.version_lock:
            known = self.validator
            if known is None:
                short = seen.size is not None and seen.size < self.index_end
                listed = self.list_size is not None and seen.size is not None and seen.size != self.list_size
                if (short or listed) and copy:
                    raise _http.BadAnswer(f"the copy holds {seen.size} bytes, but the shard "
                                          f"{'list says ' + str(self.list_size) if listed else 'index needs ' + str(self.index_end)}")
                if short:
                    self._changed(f"{where} says it holds {seen.size} bytes but its index points "
                                  f"at bytes up to {self.index_end}")
                if listed:
                    self._changed(f"{where} says it holds {seen.size} bytes, the shard list "
                                  f"says {self.list_size}")
                self.validator = seen
                if self._index_entry is not None and self.store.cache is not None:
                    self.store.cache.update_record(self._index_entry, shard=seen.to_dict())
                return
            versions = Validator(None, seen.etag, seen.modified).change_from(known)
            if versions:
                self._changed(f"changed since its index was read ({versions}): re-published "
                              f"under the same URL")
            sized = Validator(seen.size).change_from(known)
            if sized:
                raise _http.BadAnswer(f"{where}: {sized} with the same version: a cut or "
                                      f"inconsistent answer")
            self.validator = known.merged(seen)

    def _changed(self, what: str) -> None:
        store = self.store
        if store.cache is not None:
            store.cache.remove(self.name)
            store.cache.remove(remote_index_url(self.name))
        raise ShardChangedError(
            f"{self.name}: {what}; its index and copy were removed from the cache: build the "
            f"source again (TarShards(...)) to index the shard as it is now")

    def _local_copy(self) -> str | None:
        if self.local is not None:
            return self.local
        cache = self.store.cache
        if cache is None:
            return self.store.private.get(self.name)
        # One lookup at a time per store: a thread arriving while another looks
        # must wait for its answer, not take the throttle below for a miss and
        # read by range a shard that is in the cache.
        with self.store.lookup_lock:
            if self.local is not None:
                return self.local
            now = time.monotonic()
            if now - self._checked < _RECHECK_S:
                return None
            found = cache.lookup(self.name, self.validator)
            self._checked = now
            if found is not None:
                recorded = cache.recorded(self.name)
                if recorded is not None:
                    self.confirm(recorded, "its cache entry")
                cache.touch(found)
                self.local = found
            return found

    def pread(self, length: int, offset: int) -> bytes:
        if self.broken is not None:
            raise ShardChangedError(self.broken)
        local = self._local_copy()
        if local is not None:
            try:
                data = self.store.files.pread(local, length, offset)
            except FileNotFoundError:  # evicted (by another process) before we opened it
                self.local = None
            else:
                size = self.validator.size if self.validator is not None else None
                if len(data) == length or size is None or offset + length > size:
                    return data
                self._damaged_copy(local, f"ends before byte {offset + length} but the shard "
                                          f"holds {size} bytes")
        try:
            # The range first: its answer tells the shard's size, which the copy
            # started next checks against the cache's bound without asking.
            data = self.store.read_range(self, offset, length)
            self.store.want(self)
            return data
        except RemoteError as exc:
            if not isinstance(exc.__cause__, _http.RangesIgnored):
                raise
        # The server sends whole files only: copy this one whole (once) and read it locally.
        path = self.store.copy_now(self)
        return self.store.files.pread(path, length, offset)

    def _damaged_copy(self, path: str, what: str) -> None:
        """A local copy read short: drop it and read the server's again, once."""
        self._damaged += 1
        self.store.files.forget(path)
        self.local = None
        if self.store.cache is not None:
            self.store.cache.remove(self.name)
        else:
            self.store.private.pop(self.name, None)
            _unlink(path)
        if self._damaged > 1:
            raise ShardChangedError(f"{self.name}: its local copy {path} {what}, again after "
                                    f"fetching it anew: the cache folder is being damaged")
        log.warning("%s: local copy %s %s: removed, fetching it again", self.name, path, what)
        self._checked = 0.0

    def load_index(self, warn: Callable[[str], None], deadline: float | None = None) -> ShardIndex:
        store = self.store
        idx_url = remote_index_url(self.name)
        text = None
        cached = store.cache.lookup(idx_url) if store.cache is not None else None
        if cached is not None:
            with open(cached, "rb") as f:
                text = f.read()
            self._index_entry = cached
            rec = store.cache.record(cached) or {}
            self.validator = Validator.from_dict(rec.get("shard"))
        else:
            try:
                text, seen = fetch_bounded(idx_url, MAX_INDEX_BYTES, store.retrier, store.options,
                                           deadline)
            except FileNotFoundError:
                text = None
            except RemoteError as exc:
                if _status(exc.__cause__) not in _NO_INDEX_STATUS:
                    raise
                text = None  # an object store's 403 for a missing key, a presigned shard URL
            if text is not None and store.cache is not None:
                self._index_entry = store.cache.put_bytes(idx_url, text, seen)
        if text is not None:
            index = ShardIndex.from_text(text.decode("utf-8", "surrogateescape"), idx_url)
            self.index_end = index.end
            return index
        # No index: the headers are spread over the whole shard, so copy it once
        # (into the cache, where the reads will find it) and scan it locally.
        log.debug("%s has no index (%s): copying the shard to index it", self.name, idx_url)
        path = store.copy_now(self, deadline)
        try:
            return scan(lambda n, o: store.files.pread(path, n, o), os.path.getsize(path),
                        self.name, warn, strict=True)
        except ShardFormatError:
            # A copy that is not a whole tar must not stay cached as if it were.
            if store.cache is not None:
                store.files.forget(path)
                store.cache.remove(self.name)
            raise
        finally:
            if store.cache is None:
                store.files.forget(path)
                store.private.pop(self.name, None)
                _unlink(path)


class RemoteStore:
    """Remote access shared by the remote shards of one :class:`~feeder.TarShards`:
    the retry policy, the cache, and the background copies into it."""

    def __init__(self, files: FilePool, cache_dir: Any, cache_bytes: int | None, retries: int,
                 backoff_s: float, downloads: int, options: dict | None = None) -> None:
        self.files = files
        self.options = options
        # stop: the background copies end (close()); cancel: every request ends
        # at once (the source's construction ran out of time). Reads after
        # close() still work: they reopen what they need.
        self.stop = threading.Event()
        self.cancel = threading.Event()
        self.retrier = Retrier(retries, backoff_s, self.cancel)
        root = cache_root(cache_dir)
        limit = cache_limit(cache_bytes)
        self.cache = ShardCache(root, limit) if root is not None and limit > 0 else None
        if isinstance(downloads, bool) or not isinstance(downloads, int) or downloads < 1:
            raise ValueError(f"downloads must be a positive int, got {downloads!r}")
        self.downloads = downloads
        self._lock = threading.Lock()
        self.lookup_lock = threading.Lock()  # RemoteShard._local_copy
        self.version_lock = threading.Lock()  # RemoteShard.confirm
        self._idle = threading.Condition(self._lock)
        self._queued: collections.deque[RemoteShard] = collections.deque()
        self._pending: set[str] = set()
        self._active = 0
        # Without a cache, shards of a server that ignores ranges are copied here
        # (url -> path), removed at close().
        self.private: dict[str, str] = {}
        self._private_lock = threading.Lock()
        self._told_no_ranges: set[str] = set()
        _stores.add(self)

    def after_fork(self) -> None:
        """In a forked child: the copier threads do not exist here, and a lock they
        held stays held. Start with none; the child copies what it needs itself."""
        self._lock = threading.Lock()
        self.lookup_lock = threading.Lock()
        self.version_lock = threading.Lock()
        self._private_lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queued = collections.deque()
        self._pending = set()
        self._active = 0
        self.private = {}  # the parent's copies are the parent's to remove

    def shard(self, url: str) -> RemoteShard:
        return RemoteShard(url, self)

    def read_range(self, shard: RemoteShard, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        url = shard.name
        fs, path = filesystem(url, self.options)
        end = offset + length
        if _http.is_http(fs):
            def get() -> bytes:
                data, seen = _http.read_range(fs, path, offset, end, self.cancel)
                shard.confirm(seen)
                return data
        else:
            def get() -> bytes:
                if shard.validator is None:
                    shard.confirm(_info_validator(fs, path))
                data = fs.cat_file(path, start=offset, end=end)
                size = shard.validator.size if shard.validator is not None else None
                if len(data) > length or (len(data) < length and (size is None or offset + len(data) != size)):
                    raise _http.BadAnswer(f"asked for bytes [{offset}, {end}), got {len(data)} bytes")
                return data
        try:
            return self.retrier(url, f"read of bytes [{offset}, {end})", get)
        except RemoteError as exc:
            if isinstance(exc.__cause__, _http.RangesIgnored) and url not in self._told_no_ranges:
                self._told_no_ranges.add(url)
                log.warning("%s: the server ignores range requests (it answered a range with the "
                            "whole file): each shard is copied whole once and read locally", url)
            raise

    # -- copies into the cache ---------------------------------------------
    def want(self, shard: RemoteShard) -> None:
        """Start copying ``shard`` into the cache, unless it is under way or done."""
        if self.cache is None or shard.local is not None or self.stop.is_set():
            return
        with self._lock:
            if shard.name in self._pending or time.monotonic() < shard._copy_after:
                return
            self._pending.add(shard.name)
            self._queued.append(shard)
            if self._active >= self.downloads:
                return
            self._active += 1
        threading.Thread(target=self._copier, name="feeder-download", daemon=True).start()

    def _copier(self) -> None:
        while True:
            with self._lock:
                if not self._queued or self.stop.is_set():
                    self._queued.clear()
                    self._pending.clear()
                    self._active -= 1
                    self._idle.notify_all()
                    return
                shard = self._queued.popleft()
            try:
                self._copy(shard, background=True)
            except Exception as exc:  # noqa: BLE001 - the reads go on by range
                if not self.stop.is_set():
                    shard._copy_after = time.monotonic() + _RETRY_COPY_S
                    log.warning("%s: copy into the cache failed (%s); reading by range", shard.name, exc)
            finally:
                with self._lock:
                    self._pending.discard(shard.name)

    def _copy(self, shard: RemoteShard, deadline: float | None = None,
              background: bool = False) -> str | None:
        cache = self.cache
        assert cache is not None
        found = cache.lookup(shard.name, shard.validator)
        if found is not None:
            shard.local = found
            return found
        with cache.owning(shard.name) as mine:
            if not mine:
                return None  # another process copies it; the reads will find it
            found = cache.lookup(shard.name, shard.validator)
            if found is None:
                size = shard.validator.size if shard.validator is not None else None
                if size is None:
                    fs, path = filesystem(shard.name, self.options)
                    size = self.retrier(shard.name, "size", lambda: _info_validator(fs, path).size,
                                        deadline)
                if size is not None and size > cache.max_bytes:
                    log.warning("%s: %d bytes, larger than the cache (cache_bytes=%d): read by "
                                "range", shard.name, size, cache.max_bytes)
                    shard._copy_after = float("inf")
                    return None
                tmp = cache.temp(shard.name)
                try:
                    seen, digest = self._fetch_to(shard, tmp, cache.max_bytes, deadline,
                                                  self.cancel if background is False else self.stop)
                except RemoteError as exc:
                    if isinstance(exc.__cause__, _http.TooLarge):
                        log.warning("%s: %d bytes, larger than the cache (cache_bytes=%d): read by "
                                    "range", shard.name, exc.__cause__.size, cache.max_bytes)
                        shard._copy_after = float("inf")
                        return None
                    raise
                try:
                    found = cache.commit(tmp, shard.name, seen, sha256=digest)
                finally:
                    _unlink(tmp)
            shard.local = found
            return found

    def _fetch_to(self, shard: RemoteShard, dest: str, limit: int | None,
                  deadline: float | None = None, stop: threading.Event | None = None
                  ) -> tuple[Validator, str]:
        """Copy ``shard`` whole into ``dest``, checked: its size against the server's
        ``Content-Length``, the shard's validator, its index and the shard list,
        its hash against the list's. Retried as a request is; the partial file is
        removed on failure."""
        url = shard.name
        fs, path = filesystem(url, self.options)
        stop = stop or self.cancel

        def copy() -> tuple[Validator, str]:
            try:
                with open(dest, "wb") as out:
                    if _http.is_http(fs):
                        _, seen, digest = _http.read_whole(fs, path, stop, out=out, limit=limit,
                                                           deadline=deadline)
                    else:
                        seen, digest = self._download(fs, path, out, limit, stop)
                shard.confirm(seen, "the copy", copy=True)
                if shard.sha256 is not None and digest != shard.sha256:
                    raise HashMismatch(f"the copy's sha256 is {digest}, the shard list says "
                                       f"{shard.sha256}")
                return seen, digest
            except BaseException:
                _unlink(dest)
                raise

        try:
            return self.retrier(url, "download", copy, deadline)
        except RemoteError as exc:
            if isinstance(exc.__cause__, HashMismatch):
                # Copied again and still not the listed bytes: the server holds
                # something else; no read of it (by range either) is trusted.
                shard.broken = (f"{url}: its content does not match the shard list's sha256 "
                                f"({exc.__cause__}): the shard or the list is damaged or out of date")
                raise ShardChangedError(shard.broken) from exc
            raise

    def _download(self, fs: Any, path: str, out: Any, limit: int | None,
                  stop: threading.Event) -> tuple[Validator, str]:
        """A copy through a non-HTTP fsspec back-end: the size from ``info`` first,
        the bytes received checked against it."""
        seen = _info_validator(fs, path)
        if limit is not None and seen.size is not None and seen.size > limit:
            raise _http.TooLarge(seen.size, limit)
        digest = hashlib.sha256()
        got = 0
        with fs.open(path, "rb", block_size=_CHUNK) as src:
            while True:
                if stop.is_set():
                    raise InterruptedError(f"{path}: copy stopped (closing)")
                chunk = src.read(_CHUNK)
                if not chunk:
                    break
                got += len(chunk)
                digest.update(chunk)
                out.write(chunk)
        if seen.size is not None and got != seen.size:
            raise _http.BadAnswer(f"the copy holds {got} bytes, the store says {seen.size}")
        return seen.merged(Validator(got)), digest.hexdigest()

    def copy_now(self, shard: RemoteShard, deadline: float | None = None) -> str:
        """Copy ``shard`` locally now and return the path: into the cache, or,
        without one, into a private temporary file (removed at close)."""
        if self.cache is not None:
            for _ in range(2):
                found = self._copy(shard, deadline)
                if found is not None:
                    return found
                if shard._copy_after == float("inf"):
                    break  # larger than the whole cache: a private copy instead
                # Another copier has it: wait for it to finish, then look again.
                with self.cache.owning(shard.name, wait=True):
                    pass
                found = self.cache.lookup(shard.name, shard.validator)
                if found is not None:
                    shard.local = found
                    return found
            else:
                raise ShardFormatError(f"{shard.name}: could not copy the shard to read it")
        with self._private_lock:
            found = self.private.get(shard.name)
            if found is not None:
                return found
            import tempfile  # noqa: PLC0415

            fd, tmp = tempfile.mkstemp(prefix="feeder-shard-", suffix=".tar")
            os.close(fd)
            self._fetch_to(shard, tmp, None, deadline)
            self.private[shard.name] = tmp
            return tmp

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no copy is queued or running; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._active or self._queued:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(0.1 if left is None else min(0.1, left))
        return True

    def close(self, wait: bool = True) -> None:
        """Stop the copies (a copy in progress stops at its next chunk), wait up to
        a second for them (with ``wait``), remove private copies. Safe to repeat."""
        self.stop.set()
        if wait:
            self.wait(1.0)
        with self._private_lock:
            for path in self.private.values():
                self.files.forget(path)
                _unlink(path)
            self.private.clear()


def _info_validator(fs: Any, path: str) -> Validator:
    info = fs.info(path)
    size = info.get("size")
    etag = info.get("ETag") or info.get("etag")
    modified = info.get("LastModified") or info.get("last_modified") or info.get("mtime")
    return Validator(int(size) if isinstance(size, int) else None,
                     str(etag) if etag is not None else None,
                     str(modified) if modified is not None else None)


_stores: "weakref.WeakSet[RemoteStore]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _fs_lock
    _fs_lock = threading.Lock()
    for store in list(_stores):
        store.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
