"""TarShards(lazy_index=): numbering from the shard list, indices loaded at
their first need (ahead of the order), kept in a bounded LRU; the block shuffle
over shards on local disk and over HTTP."""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter

import pytest

from feeder import Feeder, ops
from feeder.shards import ShardFormatError, TarShards

from tests.support import JOIN_TIMEOUT_S, drain, labels_of, pack_numbered


@pytest.fixture(scope="module")
def packed(tmp_path_factory, jpeg_blobs):
    """60 samples (label = sample number) in many small shards, with a shard list."""
    out, shards = pack_numbered(tmp_path_factory.mktemp("lazy"), jpeg_blobs, "20KB")
    assert shards >= 8
    return out, jpeg_blobs, shards


def test_lazy_source_reads_as_the_eager_one(packed):
    out, blobs, nshards = packed
    listing = os.path.join(out, "train.json")
    eager = TarShards(listing, lazy_index=False)
    with TarShards(listing, lazy_index=True, index_cache=2) as lazy:
        assert lazy.indices_loaded == 1  # the first shard's, for the fields
        assert len(lazy) == len(eager) == 60 and lazy.shard_ranges() == eager.shard_ranges()
        for i in range(60):
            assert lazy.read(i) == eager.read(i) == (blobs[i], i)
            assert lazy.describe(i) == eager.describe(i)
        assert len(lazy._table._entries) <= 2  # the LRU bound
        assert lazy.indices_loaded >= nshards
        again = pickle.loads(pickle.dumps(lazy))
        assert again.indices_loaded == 0  # the indices stay in their process
        assert again.read(59) == (blobs[59], 59) and again.indices_loaded == 1
        again.close()
    eager.close()


def test_auto_is_lazy_only_for_long_lists(packed, monkeypatch):
    out, _, nshards = packed
    listing = os.path.join(out, "train.json")
    with TarShards(listing) as s:
        assert s._lazy_counts is None  # few shards: every index at construction, as before
    import feeder.shards as shards_mod
    monkeypatch.setattr(shards_mod, "LAZY_INDEX_SHARDS", nshards - 1)
    with TarShards(listing) as s:
        assert s._lazy_counts is not None and s.indices_loaded == 1


def test_a_wrong_count_fails_the_reads_of_that_shard(packed, tmp_path):
    out, blobs, _ = packed
    doc = json.loads(open(os.path.join(out, "train.json")).read())
    for e in doc["shardlist"]:
        e["url"] = os.path.join(out, e["url"])
    doc["shardlist"][2]["nsamples"] += 1
    bad = tmp_path / "bad.json"
    # The list's image sizes (feeder-pack writes one per sample) no longer match
    # the count: they are only a hint and are dropped; the count is checked
    # against the shard's own index when the shard is first read.
    bad.write_text(json.dumps(doc))
    with TarShards(str(bad), lazy_index=True) as s:
        assert len(s) == 61
        a = sum(e["nsamples"] for e in doc["shardlist"][:2])
        with pytest.raises(ShardFormatError, match="holds .* samples but the shard list says"):
            s.read(a)
        assert s.read(0) == (blobs[0], 0)


def test_lazy_index_needs_counts(packed):
    out, _, _ = packed
    with pytest.raises(ValueError, match="lazy_index=True numbers the samples from the shard list"):
        TarShards(out, lazy_index=True)
    with pytest.raises(ValueError, match="lazy_index must be True, False or 'auto'"):
        TarShards(out, lazy_index="yes")
    with pytest.raises(ValueError, match="index_cache must be an int >= 1"):
        TarShards(out, index_cache=0)


def _feeder(src, **kw):
    return Feeder(src, 4, [ops.Resize(24), ops.CenterCrop(16)], seed=3, decode_threads=2, **kw)


@pytest.mark.parametrize("k", [1, 3])
def test_block_shuffle_over_lazy_shards(packed, k):
    out, _, _ = packed
    with TarShards(os.path.join(out, "train.json"), lazy_index=True, index_cache=2 * k) as src:
        for epoch in range(2):
            seen = Counter()
            for rank in range(2):
                with _feeder(src, shuffle="shards", shuffle_shards=k, rank=rank, world_size=2,
                             drop_last=False) as f:
                    # Two windows and two shards of indices, whatever index_cache said.
                    assert src._table.capacity == max(2 * k, 2 * k + 2)
                    f.set_epoch(epoch)
                    batches, err = drain(f)
                    assert err is None, err
                    seen.update(labels_of(batches))
            assert seen == Counter(range(60))


def test_block_shuffle_resumes(packed):
    out, _, _ = packed
    listing = os.path.join(out, "train.json")
    with TarShards(listing, lazy_index=True) as src:
        with _feeder(src, shuffle="shards", shuffle_shards=2) as f:
            full, err = drain(f)
            assert err is None
        with _feeder(src, shuffle="shards", shuffle_shards=2) as f:
            head, err = drain(f, limit=4)
            state = f.state_dict()
        assert state["settings"]["shuffle_shards"] == 2
        with _feeder(src, shuffle="shards", shuffle_shards=2) as f:
            f.load_state_dict(state)
            rest, err = drain(f)
            assert err is None
        assert labels_of(head) + labels_of(rest) == labels_of(full)
        with _feeder(src, shuffle="shards", shuffle_shards=3) as f:
            with pytest.raises(ValueError, match="shuffle_shards differs"):
                f.load_state_dict(state)


def test_lazy_remote_source_asks_nothing_per_shard_up_front(packed, tmp_path, file_server):
    out, blobs, nshards = packed
    with file_server(out) as srv:
        src = TarShards(srv.url + "/train.json", lazy_index=True, cache_dir=str(tmp_path / "c"))
        try:
            # The list and the first shard's index: no request per shard.
            assert srv.count() <= 3, [r.path for r in srv.requests] if hasattr(srv, "requests") else None
            with _feeder(src, shuffle="shards", shuffle_shards=2) as f:
                batches, err = drain(f)
                assert err is None, err
            assert sorted(labels_of(batches)) == list(range(60))
            assert src.wait_downloads(JOIN_TIMEOUT_S)
            # Each shard's body was fetched whole at most once (window prefetch).
            whole = srv.count(lambda r: r.method == "GET" and r.path.endswith(".tar")
                              and r.range is None)
            assert whole <= nshards
        finally:
            src.close()


def test_lazy_source_reads_in_a_forked_child(packed):
    """A DataLoader worker is a fork: the child reads through the inherited source,
    its table starting without the parent's loader thread (whose lock may have
    been held at the fork)."""
    import multiprocessing

    global _INHERITED
    out, blobs, _ = packed
    with TarShards(os.path.join(out, "train.json"), lazy_index=True, index_cache=4) as src:
        _INHERITED = src
        try:
            src.will_read(list(range(0, 60, 7)))  # the loader thread may be running at the fork
            ctx = multiprocessing.get_context("fork")
            with ctx.Pool(1) as pool:
                got = pool.apply_async(_read_inherited).get(JOIN_TIMEOUT_S)
            assert got == [(blobs[i], i) for i in range(60)]
        finally:
            _INHERITED = None
            worker = src._table._worker
            if worker is not None:
                worker.join(JOIN_TIMEOUT_S)


_INHERITED = None


def _read_inherited():
    return [_INHERITED.read(i) for i in range(len(_INHERITED))]


def test_construction_leaves_garbage_collection_as_it_was(packed, tmp_path):
    import gc

    out, _, _ = packed
    assert gc.isenabled()
    TarShards(os.path.join(out, "train.json"), lazy_index=True).close()
    assert gc.isenabled()
    (tmp_path / "x.tar.gz").write_bytes(b"")
    for bad in (str(tmp_path / "x.tar.gz"), str(tmp_path / "none.json")):
        with pytest.raises((ValueError, OSError)):
            TarShards(bad)
        assert gc.isenabled()
    gc.disable()
    try:
        TarShards(os.path.join(out, "train.json"), lazy_index=True).close()
        assert not gc.isenabled()  # a caller's choice stays
    finally:
        gc.enable()
