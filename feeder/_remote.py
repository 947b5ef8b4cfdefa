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
"""

from __future__ import annotations

import asyncio
import collections
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


class RemoteError(OSError):
    """A remote read failed (the message names the URL and what happened)."""


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

    def __call__(self, url: str, what: str, fn: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                status = _status(exc)
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


def fetch_small(url: str, retrier: Retrier | None = None, options: dict | None = None) -> bytes:
    """The whole of a small remote file (a shard list, an index)."""
    retrier = retrier or Retrier(5, 0.2, threading.Event())
    fs, path = filesystem(url, options)
    return retrier(url, "read", lambda: fs.cat_file(path))


class ShardCache:
    """Whole remote files, kept on local disk, bounded in bytes (see the module docstring).

    Args:
        root: The cache folder (``shards/`` is made under it).
        max_bytes: The bound on complete entries, bytes.
    """

    def __init__(self, root: str, max_bytes: int) -> None:
        self.dir = os.path.join(root, "shards")
        os.makedirs(self.dir, exist_ok=True)
        self.max_bytes = max_bytes

    def path(self, url: str) -> str:
        digest = hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()[:20]
        base = url.rstrip("/").rsplit("/", 1)[-1][-80:] or "file"
        return os.path.join(self.dir, f"{digest}-{base}")

    def lookup(self, url: str) -> str | None:
        p = self.path(url)
        return p if os.path.isfile(p) else None

    def touch(self, path: str) -> None:
        """Mark ``path`` used now (eviction removes the least recently used first)."""
        try:
            os.utime(path)
        except OSError:
            pass

    @contextmanager
    def owning(self, url: str) -> Iterator[bool]:
        """Hold ``url``'s entry lock (no wait): yields False when another process holds it."""
        fd = os.open(self.path(url) + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    def temp(self, url: str) -> str:
        return f"{self.path(url)}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def put_bytes(self, url: str, data: bytes) -> str:
        """Store a small file (an index) atomically; return its path."""
        tmp = self.temp(url)
        with open(tmp, "wb") as f:
            f.write(data)
        return self.commit(tmp, url)

    def commit(self, tmp: str, url: str) -> str:
        """Rename a finished copy into place; evict down to the bound when the total
        passes it.

        The total of complete entries is kept in ``shards/.total``, updated under
        the eviction lock, so a commit costs no listing of the folder; a missing
        or unreadable total (or an entry replaced) makes it list and recount.
        Files removed by hand only make the kept total too high: the next commit
        that passes the bound recounts."""
        final = self.path(url)
        size = os.path.getsize(tmp)
        with self._locked():
            replaced = os.path.exists(final)
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
                    pid = name.rsplit(".part-", 1)[1].split("-", 1)[0]
                    if pid.isdigit() and not _alive(int(pid)):
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
    """A shard at a URL: range reads until a local copy is there, then ``pread``."""

    remote = True

    def __init__(self, url: str, store: "RemoteStore") -> None:
        self.name = url
        self.store = store
        self.local: str | None = None
        self.size: int | None = None
        self._checked = 0.0
        self._copy_after = 0.0  # when a failed copy may be tried again

    def _local_copy(self) -> str | None:
        if self.local is not None:
            return self.local
        cache = self.store.cache
        if cache is None:
            return None
        # One lookup at a time per store: a thread arriving while another looks
        # must wait for its answer, not take the throttle below for a miss and
        # read by range a shard that is in the cache.
        with self.store.lookup_lock:
            if self.local is not None:
                return self.local
            now = time.monotonic()
            if now - self._checked < _RECHECK_S:
                return None
            found = cache.lookup(self.name)
            self._checked = now
            if found is not None:
                cache.touch(found)
                self.local = found
            return found

    def pread(self, length: int, offset: int) -> bytes:
        local = self._local_copy()
        if local is not None:
            try:
                return self.store.files.pread(local, length, offset)
            except FileNotFoundError:  # evicted (by another process) before we opened it
                self.local = None
        self.store.want(self)
        return self.store.read_range(self.name, offset, length)

    def load_index(self, warn: Callable[[str], None]) -> ShardIndex:
        store = self.store
        idx_url = index_path(self.name)
        text = None
        cached = store.cache.lookup(idx_url) if store.cache is not None else None
        if cached is not None:
            with open(cached, "rb") as f:
                text = f.read()
        else:
            try:
                text = store.fetch(idx_url)
            except FileNotFoundError:
                text = None
            if text is not None and store.cache is not None:
                store.cache.put_bytes(idx_url, text)
        if text is not None:
            return ShardIndex.from_text(text.decode("utf-8", "surrogateescape"), idx_url)
        # No index: the headers are spread over the whole shard, so copy it once
        # (into the cache, where the reads will find it) and scan it locally.
        log.debug("%s has no index (%s): copying the shard to index it", self.name, idx_url)
        path = store.copy_now(self)
        try:
            return scan(lambda n, o: store.files.pread(path, n, o), os.path.getsize(path),
                        self.name, warn)
        finally:
            if store.cache is None:
                store.files.forget(path)
                _unlink(path)


class RemoteStore:
    """Remote access shared by the remote shards of one :class:`~feeder.TarShards`:
    the retry policy, the cache, and the background copies into it."""

    def __init__(self, files: FilePool, cache_dir: Any, cache_bytes: int | None, retries: int,
                 backoff_s: float, downloads: int, options: dict | None = None) -> None:
        self.files = files
        self.options = options
        self.stop = threading.Event()
        self.retrier = Retrier(retries, backoff_s, self.stop)
        root = cache_root(cache_dir)
        limit = cache_limit(cache_bytes)
        self.cache = ShardCache(root, limit) if root is not None and limit > 0 else None
        if isinstance(downloads, bool) or not isinstance(downloads, int) or downloads < 1:
            raise ValueError(f"downloads must be a positive int, got {downloads!r}")
        self.downloads = downloads
        self._lock = threading.Lock()
        self.lookup_lock = threading.Lock()  # RemoteShard._local_copy
        self._idle = threading.Condition(self._lock)
        self._queued: collections.deque[RemoteShard] = collections.deque()
        self._pending: set[str] = set()
        self._active = 0
        _stores.add(self)

    def after_fork(self) -> None:
        """In a forked child: the copier threads do not exist here, and a lock they
        held stays held. Start with none; the child copies what it needs itself."""
        self._lock = threading.Lock()
        self.lookup_lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queued = collections.deque()
        self._pending = set()
        self._active = 0

    def shard(self, url: str) -> RemoteShard:
        return RemoteShard(url, self)

    def fetch(self, url: str) -> bytes:
        fs, path = filesystem(url, self.options)
        return self.retrier(url, "read", lambda: fs.cat_file(path))

    def read_range(self, url: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        fs, path = filesystem(url, self.options)
        return self.retrier(url, f"read of bytes [{offset}, {offset + length})",
                            lambda: fs.cat_file(path, start=offset, end=offset + length))

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
                self._copy(shard)
            except Exception as exc:  # noqa: BLE001 - the reads go on by range
                if not self.stop.is_set():
                    shard._copy_after = time.monotonic() + _RETRY_COPY_S
                    log.warning("%s: copy into the cache failed (%s); reading by range", shard.name, exc)
            finally:
                with self._lock:
                    self._pending.discard(shard.name)

    def _copy(self, shard: RemoteShard) -> str | None:
        cache = self.cache
        assert cache is not None
        found = cache.lookup(shard.name)
        if found is not None:
            shard.local = found
            return found
        with cache.owning(shard.name) as mine:
            if not mine:
                return None  # another process copies it; the reads will find it
            found = cache.lookup(shard.name)
            if found is None:
                fs, path = filesystem(shard.name, self.options)
                size = self.retrier(shard.name, "size", lambda: fs.size(path))
                if size is not None and size > cache.max_bytes:
                    log.warning("%s: %d bytes, larger than the cache (cache_bytes=%d): read by range",
                                shard.name, size, cache.max_bytes)
                    shard._copy_after = float("inf")
                    return None
                tmp = cache.temp(shard.name)
                try:
                    self.retrier(shard.name, "download", lambda: self._download(fs, path, tmp))
                    found = cache.commit(tmp, shard.name)
                finally:
                    _unlink(tmp)
            shard.local = found
            return found

    def _download(self, fs: Any, path: str, dest: str) -> None:
        http = getattr(fs, "protocol", None) in ("http", "https") or \
            (isinstance(fs.protocol, tuple) and "http" in fs.protocol)
        # block_size=0: one streaming GET for HTTP, not a request per block.
        with fs.open(path, "rb", block_size=0 if http else _CHUNK) as src, open(dest, "wb") as out:
            while True:
                if self.stop.is_set():
                    raise RemoteError(f"{path}: copy stopped (closing)")
                chunk = src.read(_CHUNK)
                if not chunk:
                    break
                out.write(chunk)

    def copy_now(self, shard: RemoteShard) -> str:
        """Copy ``shard`` locally now and return the path (into the cache, or into a
        temporary file the caller removes when there is no cache)."""
        if self.cache is not None:
            for _ in range(2):
                found = self._copy(shard)
                if found is not None:
                    return found
                # Another process is copying it: wait for it, then look again.
                with self.cache.owning(shard.name):
                    pass
                found = self.cache.lookup(shard.name)
                if found is not None:
                    shard.local = found
                    return found
            raise ShardFormatError(f"{shard.name}: could not copy the shard to index it")
        import tempfile  # noqa: PLC0415

        fd, tmp = tempfile.mkstemp(prefix="feeder-shard-", suffix=".tar")
        os.close(fd)
        fs, path = filesystem(shard.name, self.options)
        try:
            self.retrier(shard.name, "download", lambda: self._download(fs, path, tmp))
        except BaseException:
            _unlink(tmp)
            raise
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

    def close(self) -> None:
        """Stop the copies (a copy in progress stops at its next chunk) and wait up to
        a second for them. Safe to repeat."""
        self.stop.set()
        self.wait(1.0)


_stores: "weakref.WeakSet[RemoteStore]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _fs_lock
    _fs_lock = threading.Lock()
    for store in list(_stores):
        store.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
