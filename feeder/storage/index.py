"""Shard indices for :class:`feeder.shards.TarShards`: a local shard's index
(its ``.idx`` file, or a scan of its headers), every shard's index loaded at once
(:func:`load_indices`, in parallel for remote shards, within a deadline), and
the lazy indexing's bounded table (:class:`IndexTable`: an index loaded at its
shard's first need, ahead of the order in a thread of its own)."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

from .local import FilePool, after_fork_registry
from .tar import (MAX_INDEX_BYTES, Scanned, ShardFormatError, ShardIndex, index_mismatch, index_path,
                  read_bounded, scan_members)


log = logging.getLogger("feeder.shards")

class LocalShard:
    """A shard on a local file system, read with ``os.pread``.

    Attributes:
        size: The shard's size when its index was loaded, bytes (None before):
            each descriptor opened on it is checked against it, so a shard
            replaced or changed after it was indexed fails its reads, naming
            both sizes, instead of giving other bytes at the index's offsets.
    """

    remote = False

    def __init__(self, path: str, files: FilePool) -> None:
        self.name = path
        self.files = files
        self.size: int | None = None

    def pread(self, length: int, offset: int) -> bytes:
        return self.files.pread(self.name, length, offset, self._check_open)

    def _check_open(self, fd: int) -> None:
        size = self.size
        if size is None:
            return
        now = os.fstat(fd).st_size
        if now != size:
            raise ShardFormatError(f"{self.name}: holds {now} bytes, {size} when its index was "
                                   f"loaded: the shard was replaced or changed since; build the "
                                   f"source again (TarShards(...)) to index it as it is now")

    def state(self) -> Any:
        """What a copy of this shard in another process needs (see :meth:`restore`)."""
        return self.size

    def restore(self, state: Any) -> None:
        self.size = state

    def load_index(self, warn: Any, deadline: float | None = None) -> ShardIndex:
        idx = index_path(self.name)
        size = os.path.getsize(self.name)  # FileNotFoundError names the shard
        if self.size is not None and size != self.size:
            # Loaded again (lazy indexing keeps a bounded number): the samples are
            # numbered from the first load, and descriptors may be open on it.
            raise ShardFormatError(f"{self.name}: holds {size} bytes, {self.size} when its index "
                                   f"was first loaded: the shard was replaced or changed since; "
                                   f"build the source again (TarShards(...)) to index it as it is now")
        index = None
        fresh = os.path.isfile(idx) and os.path.getmtime(idx) >= os.path.getmtime(self.name) - 1
        if os.path.isfile(idx):
            try:
                text = read_bounded(idx, MAX_INDEX_BYTES, "shard index")
                index = ShardIndex.from_text(text.decode("utf-8", "surrogateescape"), idx)
            except ShardFormatError:
                if fresh:
                    raise
                # An index older than its shard is not used to read it; it only
                # tells a shard cut since (a truncation changes the time) below.
        if index is not None and fresh:
            # Timestamps do not tell a replaced shard (a copy keeping them:
            # cp -p, rsync -a, tar x) from the one the index was written for.
            with open(self.name, "rb") as f:  # not the pool's: these few reads keep no descriptor
                mismatch = index_mismatch(index, size, lambda n, at: os.pread(f.fileno(), n, at))
            if mismatch is None:
                self.size = size
                return index
            warn(f"{idx} does not describe {self.name} as it is now ({mismatch}): the shard was "
                 f"replaced after its index was written; indexing it from its headers instead "
                 f"(write the index again: feeder-pack, or delete it)")
        log.debug("indexing %s from its headers", self.name)
        found = scan_members(self.pread, size, self.name, warn)
        if index is not None and _cut_from(found, index):
            # The shard is the one the index describes, cut short: the samples
            # the index promises past the cut stay numbered, and each fails when
            # read (a counted skip), so that nothing is lost unseen and the
            # numbering (len, resume) stays the index's.
            lost = [index.keys[s] for s in range(len(index))
                    if any(int(index.offsets[m] + index.sizes[m]) > size
                           for m in index.members(s))]
            keys = lost[0] if len(lost) == 1 else f"{lost[0]} ... {lost[-1]}"
            warn(f"{self.name}: truncated: it holds {size} bytes, its index {idx} needs "
                 f"{index.end}; the {len(lost)} samples stored past the cut ({keys}) fail "
                 f"when read (copy or re-pack the shard whole)")
            self.size = size
            return index
        self.size = size
        return found.index(self.name, warn)


def _cut_from(found: Scanned, index: ShardIndex) -> bool:
    """Whether the shard scanned as ``found`` is the one ``index`` describes, cut
    short: it lacks the end-of-archive marker, the index's members run past its
    end, and every member its headers give is the index's, at the same offset
    and size (a shard re-packed with fewer samples ends with the marker)."""
    if found.ended or index.end <= found.size or not found.members:
        return False
    listed = {name: (int(offset), int(n)) for name, offset, n in
              zip(index.names, index.offsets, index.sizes)}
    return all(listed.get(name) == (offset, n) for name, offset, n in found.members)


class IndexTable:
    """Shard indices loaded at their first need and kept in a bounded LRU (the
    lazy indexing of :class:`TarShards`); :meth:`ahead` loads them in a thread of
    its own before the readers get there (and starts the shards' copies into the
    cache), so a read rarely waits for an index.

    An entry is ``(index, image member per sample, label member per sample,
    member offsets, member sizes)``, the last four as ``array('q')`` (looked up
    at Python speed by every read, 8 bytes a number).
    """

    def __init__(self, owner: Any, counts: list[int], capacity: int) -> None:
        self._owner = weakref.ref(owner)
        self.counts = counts
        self.capacity = capacity
        self._entries: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[int, bool]] = collections.deque()
        self._queued: set[int] = set()
        self._worker: threading.Thread | None = None
        self.loads = 0  # indices loaded (for stats and tests)
        self._loading: dict[int, threading.Event] = {}  # shard -> set when its load ends
        _tables.add(self)

    def after_fork(self) -> None:
        """In a forked child (a DataLoader worker): the loader thread does not exist
        there and its lock may be held; start with none (the entries stay)."""
        self._lock = threading.Lock()
        self._queue = collections.deque()
        self._queued = set()
        self._worker = None
        self._loading = {}

    def get(self, s: int) -> tuple:
        while True:
            with self._lock:
                entry = self._entries.get(s)
                if entry is not None:
                    self._entries.move_to_end(s)
                    return entry
                loading = self._loading.get(s)
                if loading is None:
                    # This thread loads it; the others wanting it wait (every
                    # read thread starts on the same shard at a window's start).
                    done = self._loading[s] = threading.Event()
                    break
            # Bounded: the loader sets the event however its load ends; then
            # this thread finds the entry, or loads it itself (and meets the error).
            loading.wait(60)
        try:
            owner = self._owner()
            if owner is None:
                raise RuntimeError("the TarShards source was garbage-collected")
            return self.put(s, owner._index_entry(s, self.counts[s]))
        finally:
            with self._lock:
                self._loading.pop(s, None)
            done.set()

    def put(self, s: int, entry: tuple) -> tuple:
        """Keep shard ``s``'s freshly loaded entry (the oldest go past the bound)."""
        with self._lock:
            self.loads += 1
            self._entries[s] = entry
            self._entries.move_to_end(s)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return entry

    def cached(self, s: int) -> bool:
        with self._lock:
            return s in self._entries

    def ahead(self, shards: Iterable[int], copy: bool = False) -> None:
        """Load these shards' indices in the background (and start copying the
        shards into the cache when ``copy``); a hint: never blocks, never fails."""
        start = False
        with self._lock:
            for s in shards:
                if s in self._queued or (not copy and s in self._entries):
                    continue
                if len(self._queue) >= 4 * self.capacity:  # far ahead: the hint can wait
                    break
                self._queued.add(s)
                self._queue.append((s, copy))
            if self._queue and self._worker is None:
                self._worker = threading.Thread(target=self._run, name="feeder-index-ahead",
                                                daemon=True)
                start = True
        if start:
            self._worker.start()  # type: ignore[union-attr]

    def _run(self) -> None:
        # Exits when the queue is empty (a later hint starts another): no thread
        # outlives the work, so a dropped source leaves none behind.
        while True:
            with self._lock:
                if not self._queue:
                    self._worker = None
                    return
                s, copy = self._queue.popleft()
                self._queued.discard(s)
            owner = self._owner()
            if owner is None:
                with self._lock:
                    self._worker = None
                return
            try:
                if copy:
                    owner._want_copy(s)
                self.get(s)
            except Exception as exc:  # noqa: BLE001 - the read that needs it raises it
                log.debug("index of shard %d not loaded ahead: %s", s, exc)
            del owner


_tables: "weakref.WeakSet[IndexTable]" = after_fork_registry()


class Column:
    """One field of :class:`IndexTable`'s entries, indexed by shard number."""

    def __init__(self, table: IndexTable, k: int) -> None:
        self.table, self.k = table, k

    def __getitem__(self, s: int) -> Any:
        return self.table.get(s)[self.k]

    def __len__(self) -> int:
        return len(self.table.counts)


def load_indices(shards: list[Any], warn: Any, deadline: float | None,
                 deadline_s: float | None, store: Any = None) -> list[ShardIndex]:
    """Every shard's index; remote ones in parallel (one round trip each, at
    most 16 at once), all within the deadline (whose error cancels ``store``'s
    requests)."""
    if not any(s.remote for s in shards):
        return [s.load_index(warn) for s in shards]
    results: list[Any] = [None] * len(shards)
    done = threading.Event()
    lock = threading.Lock()
    todo = list(range(len(shards)))
    busy: dict[int, str] = {}
    left = [len(shards)]

    def worker() -> None:
        while True:
            with lock:
                if not todo or done.is_set():
                    return
                k = todo.pop(0)
                busy[k] = shards[k].name
            try:
                results[k] = (True, shards[k].load_index(warn, deadline))
            except BaseException as exc:  # noqa: BLE001 - handed to the constructor
                results[k] = (False, exc)
            with lock:
                busy.pop(k, None)
                left[0] -= 1
                if left[0] == 0 or not results[k][0]:
                    done.set()

    # Daemon threads, not a ThreadPoolExecutor: a request stalled past the
    # deadline must not hold up the constructor's error or the interpreter's exit.
    for n in range(min(16, len(shards))):
        threading.Thread(target=worker, name=f"feeder-index-{n}", daemon=True).start()
    done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    with lock:
        done.set()
        stalled = sorted(busy.values()) + [shards[k].name for k in todo]
        failed = [r[1] for r in results if r is not None and not r[0]]
        missing = any(r is None for r in results)
        got = list(results)  # what the workers handed in by now (later ones are dropped)
    if failed:
        # An error that arrived as the deadline passed names its URL itself.
        if store is not None:
            store.cancel.set()
            store.stop.set()
        raise failed[0]
    if missing:
        if store is not None:
            store.cancel.set()  # cuts the stalled requests and the retry waits short
            store.stop.set()
        from .remote import RemoteError  # noqa: PLC0415

        raise RemoteError(f"TarShards: building the source took longer than deadline_s="
                          f"{deadline_s} s; no answer yet from {', '.join(stalled[:5])}"
                          f"{' ...' if len(stalled) > 5 else ''} (raise deadline_s, or check "
                          f"the storage)")
    return [r[1] for r in got]
