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
  exactly the bytes asked for (see :mod:`feeder.storage.http`); a server that ignores
  ranges (answers ``200``) is read by copying each shard whole once (said once
  in the log): into the cache, or without one into a private temporary copy
  removed at ``close()``. Other fsspec back-ends: the length of every range.
- Each shard's *validator* (size, ``ETag``, ``Last-Modified``) is learned from
  the first answer and compared with every later answer and copy; it must hold
  the bytes its index points at. A change means the shard was re-published
  under the same URL: :class:`ShardChangedError` names it, and the stale index
  and copy are removed from the cache so that the next ``TarShards(...)``
  indexes the new version (offsets are never reused across versions).
- Every answer's size (a range's ``Content-Range`` total, a copy's length, a
  non-HTTP back-end's object size) must be the shard list's ``filesize``, the
  size of the shard the index was made from (its ``# shard_size`` line) and
  the first answer's: without ``ETag`` and ``Last-Modified`` the size is what
  tells a shard re-published before its first read. A cached index the shard
  list contradicts is removed and fetched again.
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

import collections
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from . import http as _http
from .http import Validator
from .local import FilePool, after_fork_registry
from .cache import ShardCache, _unlink, cache_limit, cache_root
from .fetch import (MAX_INDEX_BYTES, HashMismatch, RemoteError, Retrier, ShardChangedError,
                     _status, fetch_bounded, filesystem, remote_index_url)
from .tar import ShardFormatError, ShardIndex, scan

log = logging.getLogger(__name__)

# Reads of a copy in progress elsewhere look for the finished file this often (seconds).
_RECHECK_S = 2.0
# A copy that failed is tried again after this long (seconds); reads go by range meanwhile.
_RETRY_COPY_S = 30.0
_CHUNK = 4 << 20
# A derived index (name.idx next to name.tar) answered with one of these does
# not exist for this client: object stores answer 403 for a key that does not
# exist when listing is not allowed, and a presigned URL's signature covers
# the shard only.
_NO_INDEX_STATUS = {401, 403, 404}


class RemoteShard:
    """A shard at a URL: range reads until a local copy is there, then ``pread``.

    Attributes:
        validator: The version of the shard this process reads (learned from the
            first answer, a cache record or the cached index's record), None
            until known.
        index_end: Bytes the shard must hold (the end of its index's last member).
        index_size: The size of the shard the index was made from, bytes (its
            ``# shard_size`` line, or the copy it was scanned from; None: not
            known).
        sha256: The shard's hash from the shard list, hex (None: not given).
    """

    remote = True

    def __init__(self, url: str, store: "RemoteStore") -> None:
        self.name = url
        self.store = store
        self.local: str | None = None
        self.validator: Validator | None = None
        self.index_end = 0
        self.index_size: int | None = None
        self.sha256: str | None = None
        self.list_size: int | None = None
        self._index_entry: str | None = None  # the cached index, to record the validator in
        self._index_fetched = False  # the index came from the server in this process
        self._damaged = 0  # local copies found damaged (one is fetched again, then it fails)
        self.broken: str | None = None  # why every read of this shard fails (a hash mismatch)
        self._checked = 0.0
        self._copy_after = 0.0  # when a failed copy may be tried again

    def state(self) -> Any:
        """What a copy of this shard in another process needs (see :meth:`restore`):
        what the list said, what the index needs, the version read."""
        return (self.sha256, self.list_size, self.index_end, self.index_size, self.validator)

    def restore(self, state: Any) -> None:
        self.sha256, self.list_size, self.index_end, self.index_size, self.validator = state

    # -- the version being read -------------------------------------------------
    def confirm(self, seen: Validator, where: str = "the server", copy: bool = False) -> None:
        """Check an answer's validator against the version this process reads.

        Every answer's size is compared with each size this process was told
        (the shard list's ``filesize``, the size the index was made from, the
        size of the first answer) and must hold the index's members: without
        ``ETag`` and ``Last-Modified`` the size is all that tells a shard
        re-published under the same URL from the one its index describes. A
        copy whose size alone is wrong was cut on its way (transient: it is
        fetched again); a changed ``ETag`` or ``Last-Modified``, or an answer
        giving the shard another size, is another version.

        Raises:
            ShardChangedError: another version (the stale cache entries are removed).
            BadAnswer: a copy of the wrong size.
        """
        if self.broken is not None:
            raise ShardChangedError(self.broken)
        with self.store.version_lock:
            known = self.validator
            if known is not None:
                versions = Validator(None, seen.etag, seen.modified).change_from(known)
                if versions:
                    self._changed(f"changed since its index was read ({versions}): re-published "
                                  f"under the same URL")
            wrong = self._size_mismatch(seen.size, known)
            if wrong is not None:
                if copy:
                    raise _http.BadAnswer(f"the copy holds {seen.size} bytes, but {wrong}")
                self._changed(f"{where} says it holds {seen.size} bytes, but {wrong}: "
                              f"re-published under the same URL, or damaged")
            if known is not None:
                self.validator = known.merged(seen)
                return
            self.validator = seen
            if self._index_entry is not None and self.store.cache is not None:
                self.store.cache.update_record(self._index_entry, shard=seen.to_dict())

    def _size_mismatch(self, size: int | None, known: Validator | None) -> str | None:
        """What a shard of ``size`` bytes contradicts (None: nothing this process knows)."""
        if size is None:
            return None
        if self.list_size is not None and size != self.list_size:
            return f"the shard list says {self.list_size}"
        if self.index_size is not None and size != self.index_size:
            return f"its index was made from a shard of {self.index_size} bytes"
        if size < self.index_end:
            return f"its index points at bytes up to {self.index_end}"
        if known is not None and known.size is not None and size != known.size:
            return f"it held {known.size} bytes when this process first read it"
        return None

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
                rec = cache.record(found) or {}
                recorded = Validator.from_dict(rec.get("validator"))
                stale = self._stale_copy(rec, recorded)
                if stale is not None:
                    log.warning("cache entry %s (%s) %s: removed", found, self.name, stale)
                    self.store.files.forget(found)
                    cache.remove(self.name)
                    return None  # read by range; the copy started next is of this version
                if recorded is not None:
                    self.confirm(recorded, "its cache entry")
                cache.touch(found)
                self.local = found
            return found

    def _stale_copy(self, rec: dict[str, Any], recorded: Validator | None) -> str | None:
        """Why a cached copy must not be read with this process's index (None: it may).

        The copy's record says its hash and version. The shard list's sha256, when
        given, must be the copy's, and its size the list's and the index's. Without a known version (the index was fetched
        from the server just now, while the copy is from an earlier run: the
        cache kept the copy but not the index, and the shard may have been
        re-published since), the server is asked which version it serves, once."""
        digest = rec.get("sha256")
        if self.sha256 is not None and isinstance(digest, str) and digest != self.sha256:
            return f"holds sha256 {digest}, the shard list says {self.sha256}"
        wrong = None if recorded is None else self._size_mismatch(recorded.size, None)
        if wrong is not None:
            return f"holds {recorded.size} bytes, but {wrong}"
        if self.validator is None and self._index_fetched:
            fs, path = filesystem(self.name, self.store.options)
            try:
                current = self.store.retrier(self.name, "version", lambda: _info_validator(fs, path))
            except (RemoteError, OSError) as exc:
                # Not used, then: reads go by range, whose answers say the version.
                return f"could not be checked against the version served now ({exc})"
            changed = "it has no record" if recorded is None else current.change_from(recorded)
            self.confirm(current)  # this process's version: the one the index was read with
            if changed:
                return f"is another version than the one served now ({changed})"
        return None

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
            index = ShardIndex.from_text(text.decode("utf-8", "surrogateescape"), idx_url)
            rec = store.cache.record(cached) or {}
            recorded = Validator.from_dict(rec.get("shard"))
            # The cache kept the index of the version it was read with: one the
            # shard list (given again, maybe re-written) contradicts is stale.
            stale = self._size_mismatch(index.shard_size, None) or (
                None if recorded is None else self._size_mismatch(recorded.size, None))
            if stale is None:
                # Used now: the index ages with its copy (an index evicted before
                # its copy makes the next run ask the server for the shard's version).
                store.cache.touch(cached)
                self._index_entry = cached
                self.validator = recorded
                self.index_end, self.index_size = index.end, index.shard_size
                return index
            log.warning("cache entry %s (%s) is the index of another version of the shard "
                        "(%s): removed, fetching it again", cached, idx_url, stale)
            store.cache.remove(idx_url)
            store.cache.remove(self.name)
        try:
            text, seen = fetch_bounded(idx_url, MAX_INDEX_BYTES, store.retrier, store.options,
                                       deadline)
        except FileNotFoundError:
            text = None
        except RemoteError as exc:
            if _status(exc.__cause__) not in _NO_INDEX_STATUS:
                raise
            text = None  # an object store's 403 for a missing key, a presigned shard URL
        self._index_fetched = text is not None
        if text is not None:
            index = ShardIndex.from_text(text.decode("utf-8", "surrogateescape"), idx_url)
            if (index.shard_size is not None and self.list_size is not None
                    and index.shard_size != self.list_size):
                raise ShardFormatError(f"{idx_url}: the index of a shard of {index.shard_size} "
                                       f"bytes, but the shard list says {self.name} holds "
                                       f"{self.list_size}: the index or the list is damaged or "
                                       f"out of date (re-pack, or fix the list)")
            if store.cache is not None:
                self._index_entry = store.cache.put_bytes(idx_url, text, seen)
            self.index_end, self.index_size = index.end, index.shard_size
            return index
        # No index: the headers are spread over the whole shard, so copy it once
        # (into the cache, where the reads will find it) and scan it locally.
        log.debug("%s has no index (%s): copying the shard to index it", self.name, idx_url)
        path = store.copy_now(self, deadline)
        try:
            index = scan(lambda n, o: store.files.pread(path, n, o), os.path.getsize(path),
                         self.name, warn, strict=True)
            self.index_end, self.index_size = index.end, index.shard_size
            return index
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


def _info_validator(fs: Any, path: str) -> Validator:
    info = fs.info(path)
    size = info.get("size")
    etag = info.get("ETag") or info.get("etag")
    modified = info.get("LastModified") or info.get("last_modified") or info.get("mtime")
    return Validator(int(size) if isinstance(size, int) else None,
                     str(etag) if etag is not None else None,
                     str(modified) if modified is not None else None)


_stores: "weakref.WeakSet[RemoteStore]" = after_fork_registry()
