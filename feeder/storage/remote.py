"""Remote shards: range reads through fsspec, retries, and a local disk cache.

A sample is one range request; the first read from a shard also starts a copy
of the whole shard into the cache, after which its reads are local. Transient
errors are retried; every answer is checked against what the shard list, the
index and the first answer say. The rules and their reasons:
docs/design/storage.md; the user's side: docs/guides/shards.md.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from . import http as _http
from .http import Validator
from .local import FilePool, after_fork_registry
from .cache import ShardCache, _unlink, cache_limit, cache_root
from .fetch import HashMismatch, RemoteError, Retrier, ShardChangedError, filesystem
from .remoteshard import RemoteShard, _info_validator
from .tar import ShardFormatError

log = logging.getLogger(__name__)

# A copy that failed is tried again after this long (seconds); reads go by range meanwhile.
_RETRY_COPY_S = 30.0
_CHUNK = 4 << 20

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
    def copies_all(self, shards: Sequence[Any]) -> bool:
        """Whether every remote shard of ``shards`` is copied into the cache when
        wanted: there is a cache, and each shard's size is known (the shard list's
        ``filesize``, the server's answer, or its index's end) and within its bound.
        A shard larger than the cache is read by range for good."""
        cache = self.cache
        if cache is None:
            return False
        for shard in shards:
            if not shard.remote:
                continue
            size = shard.list_size or (shard.validator.size if shard.validator is not None else None) \
                or shard.index_end
            if not size or size > cache.max_bytes:
                return False
        return True

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


_stores: "weakref.WeakSet[RemoteStore]" = after_fork_registry()
