"""One remote shard (:class:`RemoteShard`): its version checked against what
was seen before, its local copy in the cache, its reads by range, and its index
(see :mod:`feeder.storage.remote` for the store that serves it)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from . import http as _http
from .http import Validator
from .cache import _unlink
from .fetch import (MAX_INDEX_BYTES, RemoteError, ShardChangedError, _status, fetch_bounded,
                    filesystem, remote_index_url)
from .tar import ShardFormatError, ShardIndex, scan

# The remote storage's messages, under one name (see feeder.storage.fetch).
log = logging.getLogger("feeder.storage.remote")

# Reads of a copy in progress elsewhere look for the finished file this often (seconds).
_RECHECK_S = 2.0
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

    #: Its index comes from the server unchecked against the shard (a local
    #: shard's is checked when it is loaded): each read also takes the tar header
    #: before the sample's first member, in the same request, and checks it
    #: (feeder.storage.tarread.MemberReader.read).
    check_headers = True
    remote = True

    def __init__(self, url: str, store: Any) -> None:
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


def _info_validator(fs: Any, path: str) -> Validator:
    info = fs.info(path)
    size = info.get("size")
    etag = info.get("ETag") or info.get("etag")
    modified = info.get("LastModified") or info.get("last_modified") or info.get("mtime")
    return Validator(int(size) if isinstance(size, int) else None,
                     str(etag) if etag is not None else None,
                     str(modified) if modified is not None else None)
