"""feeder.storage.index: a local shard's index (its .idx file, or a scan), every
shard's index loaded at once within a deadline (load_indices), and the lazy
indexing's bounded table (IndexTable, Column)."""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
import types

import numpy as np
import pytest

from feeder.storage.fetch import RemoteError
from feeder.storage.index import Column, IndexTable, LocalShard, load_indices
from feeder.storage.local import FilePool
from feeder.storage.tar import ShardFormatError, index_path

from tests.support import JOIN_TIMEOUT_S


@pytest.fixture
def pool():
    files = FilePool()
    yield files
    files.close()


def _shard_copy(packed, tmp_path, with_index: bool) -> str:
    out, _ = packed
    shard = str(tmp_path / "train-000000.tar")
    shutil.copyfile(os.path.join(out, "train-000000.tar"), shard)
    if with_index:
        shutil.copyfile(index_path(os.path.join(out, "train-000000.tar")), index_path(shard))
    return shard


def _same(a, b):
    assert a.keys == b.keys and a.exts == b.exts
    assert np.array_equal(a.start, b.start) and np.array_equal(a.offsets, b.offsets)
    assert np.array_equal(a.sizes, b.sizes)


def test_local_shard_index_file_or_scan_agree(packed, tmp_path, pool):
    warnings = []
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with_idx = LocalShard(_shard_copy(packed, tmp_path / "a", True), pool)
    bare = LocalShard(_shard_copy(packed, tmp_path / "b", False), pool)
    a, b = with_idx.load_index(warnings.append), bare.load_index(warnings.append)
    _same(a, b)
    assert len(a) > 0 and a.image_sizes is not None and b.image_sizes is None  # only the file has sizes
    assert warnings == [] and not with_idx.remote
    assert bare.pread(5, 257) == b"ustar"  # the first member's tar magic


def test_stale_index_file_is_not_used(packed, tmp_path, pool):
    shard = _shard_copy(packed, tmp_path, False)
    with open(index_path(shard), "w") as f:
        f.write("garbage")  # would be an error if it were read
    old = os.path.getmtime(shard) - 10
    os.utime(index_path(shard), (old, old))
    idx = LocalShard(shard, pool).load_index(lambda m: None)
    assert len(idx) > 0
    os.utime(index_path(shard))  # now fresh: read, and its error names it
    with pytest.raises(ShardFormatError, match=index_path(shard)):
        LocalShard(shard, pool).load_index(lambda m: None)


def test_missing_shard_is_not_found(tmp_path, pool):
    with pytest.raises(FileNotFoundError, match="nope.tar"):
        LocalShard(str(tmp_path / "nope.tar"), pool).load_index(lambda m: None)


class Owner:
    """What IndexTable needs of its TarShards: ``_index_entry`` and ``_want_copy``."""

    def __init__(self, fail=()):
        self.loaded: list[int] = []
        self.copies: list[int] = []
        self.fail = set(fail)
        self.done = {s: threading.Event() for s in range(8)}
        self.gate: threading.Event | None = None
        self.lock = threading.Lock()

    def _index_entry(self, s, count):
        if self.gate is not None:
            assert self.gate.wait(JOIN_TIMEOUT_S)
        with self.lock:
            self.loaded.append(s)
        try:
            if s in self.fail:
                raise OSError(f"shard {s} unreadable")
            return (f"index{s}", count, s * 10)
        finally:
            self.done[s].set()

    def _want_copy(self, s):
        self.copies.append(s)


COUNTS = [3, 4, 5, 6, 7, 8, 9, 10]


def test_table_loads_once_and_keeps_the_most_recent(pool):
    owner = Owner()
    table = IndexTable(owner, COUNTS, capacity=2)
    assert table.get(1) == ("index1", 4, 10) and table.get(1) == ("index1", 4, 10)
    assert owner.loaded == [1] and table.loads == 1 and table.cached(1)
    table.get(2)
    table.get(1)  # 1 used last: 2 is the oldest
    table.get(3)
    assert table.cached(1) and table.cached(3) and not table.cached(2)
    table.get(2)
    assert owner.loaded == [1, 2, 3, 2] and table.loads == 4


def test_table_load_error_reaches_the_reader_and_is_retried():
    owner = Owner(fail={0})
    table = IndexTable(owner, COUNTS, capacity=4)
    with pytest.raises(OSError, match="shard 0 unreadable"):
        table.get(0)
    owner.fail.clear()
    assert table.get(0)[0] == "index0" and owner.loaded == [0, 0]


def test_threads_wanting_one_shard_share_its_load():
    owner = Owner()
    owner.gate = threading.Event()
    table = IndexTable(owner, COUNTS, capacity=4)
    got = []
    threads = [threading.Thread(target=lambda: got.append(table.get(5))) for _ in range(4)]
    for t in threads:
        t.start()
    owner.gate.set()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        assert not t.is_alive()
    assert got == [("index5", 8, 50)] * 4 and owner.loaded == [5] and table.loads == 1


def test_table_of_a_dropped_source():
    owner = Owner()
    table = IndexTable(owner, COUNTS, capacity=4)
    del owner
    gc.collect()
    with pytest.raises(RuntimeError, match="garbage-collected"):
        table.get(0)


def test_ahead_loads_in_the_background_and_copies_when_asked():
    owner = Owner()
    table = IndexTable(owner, COUNTS, capacity=8)
    table.get(0)
    table.ahead([0, 1, 2])  # 0 is there already: not loaded again
    table.ahead([3], copy=True)
    for s in (1, 2, 3):
        assert owner.done[s].wait(JOIN_TIMEOUT_S)
    assert sorted(owner.loaded) == [0, 1, 2, 3] and owner.copies == [3]
    assert table.get(2) == ("index2", 5, 20)


def test_ahead_is_a_hint_that_never_fails():
    owner = Owner(fail={1})
    table = IndexTable(owner, COUNTS, capacity=4)
    table.ahead([1, 2])
    assert owner.done[1].wait(JOIN_TIMEOUT_S) and owner.done[2].wait(JOIN_TIMEOUT_S)
    with pytest.raises(OSError, match="shard 1"):
        table.get(1)  # the read that needs it meets the error


def test_ahead_queues_a_bounded_number():
    owner = Owner()
    owner.gate = threading.Event()  # the background load waits: nothing leaves the queue
    table = IndexTable(owner, list(range(100)), capacity=2)
    owner.done = {s: threading.Event() for s in range(100)}
    table.ahead(range(100))
    queued = len(table._queued)
    owner.gate.set()
    # Up to 4 x capacity waiting (one more may be taken by the loader already).
    assert 4 * 2 - 1 <= queued <= 4 * 2
    for s in range(8):
        assert owner.done[s].wait(JOIN_TIMEOUT_S)
    assert sorted(owner.loaded) == list(range(8))  # the queued ones, in order; no more


def test_column_is_one_field_of_the_entries():
    owner = Owner()
    table = IndexTable(owner, COUNTS, capacity=4)
    col = Column(table, 2)
    assert col[3] == 30 and len(col) == len(COUNTS)


class RemoteShard:
    remote = True

    def __init__(self, name, gate=None, error=None):
        self.name, self.gate, self.error = name, gate, error

    def load_index(self, warn, deadline=None):
        if self.gate is not None:
            self.gate.wait(JOIN_TIMEOUT_S)
        if self.error is not None:
            raise self.error
        return f"idx:{self.name}"


def _store():
    return types.SimpleNamespace(cancel=threading.Event(), stop=threading.Event())


def test_load_indices_local_and_remote_in_order(packed, pool):
    out, n = packed
    local = [LocalShard(os.path.join(out, f"train-{k:06d}.tar"), pool) for k in range(2)]
    got = load_indices(local, lambda m: None, None, None)
    assert [len(i) for i in got] == [len(LocalShard(s.name, pool).load_index(print)) for s in local]
    names = [f"https://h/s-{k}.tar" for k in range(40)]
    assert load_indices([RemoteShard(u) for u in names], print, None, None) == [f"idx:{u}" for u in names]


def test_load_indices_first_failure_cancels_the_store():
    store = _store()
    shards = [RemoteShard("https://h/a.tar"), RemoteShard("https://h/b.tar", error=FileNotFoundError("b gone"))]
    with pytest.raises(FileNotFoundError, match="b gone"):
        load_indices(shards, print, None, None, store)
    assert store.cancel.is_set() and store.stop.is_set()


def test_load_indices_past_the_deadline_names_the_stalled_shards():
    store = _store()
    gate = threading.Event()
    shards = [RemoteShard("https://h/fast.tar"), RemoteShard("https://h/stalled.tar", gate=gate)]
    try:
        with pytest.raises(RemoteError) as err:
            load_indices(shards, print, time.monotonic() + 0.2, 0.2, store)
    finally:
        gate.set()  # the stalled worker ends (its answer is dropped)
    msg = str(err.value)
    assert "deadline_s=0.2" in msg and "https://h/stalled.tar" in msg and "fast.tar" not in msg
    assert store.cancel.is_set() and store.stop.is_set()
