"""Lazy epoch orders (feeder.order.sequence): the keyed permutation, the rank split, the
block shuffle, and the compact resume state they make possible."""

from __future__ import annotations

import collections
import pickle
import tracemalloc

import numpy as np
import pytest

import feeder.order.cursor as resume_mod
import feeder.order.epoch as epoch_mod
from feeder import Feeder, ops
from feeder.order.sequence import BlockOrder, GlobalOrder, Handled, Permutation, Remaining, subkey
from feeder.order.epoch import (ShardLayout, epoch_indices, epoch_order, pass_order, pass_sequence,
                                shard_layout, shard_sizes, shard_stream_order)

from tests.support import MemorySource, drain, labels_of
from tests.support.faults import feeder_factory

B = 8


# -- the permutation -------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097, 65536, 65537])
def test_permutation_is_a_bijection_on_small_domains(n):
    p = Permutation(n, 12345)
    values = p(np.arange(n))
    assert sorted(values.tolist()) == list(range(n))
    np.testing.assert_array_equal(p.inverse(values), np.arange(n))
    np.testing.assert_array_equal(Permutation(n, 12345)(np.arange(n)), values)  # deterministic
    if n >= 5:
        assert not np.array_equal(Permutation(n, 12346)(np.arange(n)), values)


@pytest.mark.parametrize("n", [2**31 - 1, 2**31, 2**31 + 1, 2**32 + 5, 10**10, 2**62])
def test_permutation_on_large_domains_by_sampling(n):
    rng = np.random.default_rng(7)
    # Distinct positions, some at the domain's edges.
    pos = np.unique(np.concatenate([rng.integers(0, n, 100_000, dtype=np.int64),
                                    [0, 1, n - 2, n - 1]]))
    p = Permutation(n, 99)
    values = p(pos)
    assert values.dtype == np.int64 and values.min() >= 0 and values.max() < n
    assert len(np.unique(values)) == len(pos)  # distinct positions, distinct values
    np.testing.assert_array_equal(p.inverse(values), pos)
    np.testing.assert_array_equal(Permutation(n, 99)(pos[:1000]), values[:1000])
    assert not np.array_equal(Permutation(n, 100)(pos[:1000]), values[:1000])
    # Values spread over the domain (the mean of 10^5 uniform values is within
    # 0.3 % of the middle at 3 sigma; 1 % leaves room).
    assert abs(values.mean() / n - 0.5) < 0.01
    # Neighbouring positions land far apart (no locality left).
    near = p(np.arange(1000, 1100, dtype=np.int64))
    assert np.median(np.abs(np.diff(near))) > n / 20


def test_permutation_refuses_bad_lengths():
    for n in (0, -1, 2**62 + 1):
        with pytest.raises(ValueError, match="length"):
            Permutation(n, 1)


def test_shuffle_is_statistically_plain():
    # Position of each value over many keys: every value reaches every position
    # about equally often (a chi-square bound far from a flaky edge).
    n, keys = 8, 4000
    counts = np.zeros((n, n))
    for k in range(keys):
        counts[np.arange(n), Permutation(n, k)(np.arange(n))] += 1
    expected = keys / n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 120  # 49 degrees of freedom: p < 1e-7 above 120


# -- the orders: rank split, small sources unchanged ---------------------------------

def test_small_orders_are_unchanged():
    for shuffle in (True, False):
        for rank, world, even in ((0, 1, True), (1, 3, True), (2, 3, False)):
            got = epoch_order(1000, shuffle, 5, 2, rank, world, even)
            assert got[:] == epoch_indices(1000, shuffle, 5, 2, rank, world, even).tolist()


@pytest.mark.parametrize("n", [10, 1001, 2**31 + 3])
@pytest.mark.parametrize("even", [True, False])
def test_lazy_rank_split_is_disjoint_and_covering(monkeypatch, n, even):
    monkeypatch.setattr(epoch_mod, "LAZY_MIN", 0)
    world = 3
    orders = [epoch_order(n, True, 5, 2, r, world, even) for r in range(world)]
    assert [len(o) for o in orders] == shard_sizes(n, world, even)
    whole = GlobalOrder(n, epoch_mod.order_key(5, 2), 0, 1, n)
    if n < 10**4:
        got = [i for o in orders for i in o[:]]
        assert len(got) == len(set(got))
        if not even:
            assert sorted(got) == list(range(n))
        for r, o in enumerate(orders):  # rank r takes global positions r, r + world, ...
            assert o[:] == whole[:][r:len(o) * world:world]
        return
    # N above 2^31: sample positions of each rank; their global positions say
    # which rank owns them (exactly one), and the values are distinct.
    rng = np.random.default_rng(3)
    values = []
    for r, o in enumerate(orders):
        ks = np.unique(rng.integers(0, len(o), 20_000))
        got = np.array([o[int(k)] for k in ks[:50]] + o.take(int(ks[50]), int(ks[50]) + 1000).tolist())
        g = whole.perm.inverse(got)
        assert np.all(g % world == r)
        values.append(got)
    allv = np.concatenate(values)
    assert len(np.unique(allv)) == len(allv)


def test_a_two_billion_sample_epoch_holds_no_array(monkeypatch):
    n = 2_000_000_000
    tracemalloc.start()
    try:
        order = pass_sequence(n, 64, True, False, False, 1, 0, 3, 8)
        first = order[:64]
        later = order[10**8:10**8 + 64]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(order) == n // 8 and len(first) == 64 and len(set(first + later)) == 128
    assert peak < 1 << 20  # bytes: no order of the epoch anywhere


def test_pass_order_lists_match_the_sequence(monkeypatch):
    monkeypatch.setattr(epoch_mod, "LAZY_MIN", 0)
    seq = pass_sequence(100, 8, True, True, False, 5, 1, 1, 3)
    assert pass_order(100, 8, True, True, False, 5, 1, 1, 3) == seq[:]
    assert len(seq) == 32 and [x for c in seq.chunks(8) for x in c] == seq[:]


def test_remaining_leaves_the_handled_positions():
    order = GlobalOrder(50, 77, 0, 1, 50)
    full = order[:]
    rest = Remaining(order, Handled(10, (12, 13, 40)))
    got = [i for c in rest.chunks(7) for i in c]
    want = [i for k, i in enumerate(full) if k >= 10 and k not in (12, 13, 40)]
    assert got == want and len(rest) == len(want)
    assert all(len(c) == 7 for c in list(rest.chunks(7))[:-1])


# -- the block shuffle -------------------------------------------------------------

RANGES = tuple(zip(np.cumsum([0] + [7, 13, 1, 19, 15, 0, 9, 22, 4, 30, 11, 3])[:-1].tolist(),
                   np.cumsum([7, 13, 1, 19, 15, 0, 9, 22, 4, 30, 11, 3]).tolist()))
N = RANGES[-1][1]
SHARD_OF = {i: k for k, (a, b) in enumerate(RANGES) for i in range(a, b)}


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("even", [True, False])
def test_block_shuffle_exactly_once_and_window_bound(k, world, even):
    layout = ShardLayout(RANGES, window=8192, shards=k)
    parts = [shard_stream_order(layout, 3, 1, r, world, even) for r in range(world)]
    got = [i for p in parts for i in p[:]]
    assert [len(p) for p in parts] == shard_sizes(N, world, even)
    assert len(got) == len(set(got))
    if not even:
        assert sorted(got) == list(range(N))
    for p in parts:
        assert isinstance(p, BlockOrder)
        seen_windows = []
        for pos, i in enumerate(p[:]):
            w, _, _ = p.window_of(pos)
            shards = p.window_shard_numbers(w)
            # Every sample comes from its window's shards; a window holds at most k.
            assert SHARD_OF[i] in shards and len(shards) <= k
            if not seen_windows or seen_windows[-1] != w:
                seen_windows.append(w)
        assert seen_windows == sorted(set(seen_windows))  # windows in order, each once
    # Pure in (seed, epoch, rank, world size).
    again = [shard_stream_order(layout, 3, 1, r, world, even)[:] for r in range(world)]
    assert again == [p[:] for p in parts]
    assert shard_stream_order(layout, 3, 2, 0, world, even)[:] != parts[0][:] or N < 3


def test_block_shuffle_mixes_within_the_window():
    ranges = tuple((s * 100, (s + 1) * 100) for s in range(40))
    order = shard_stream_order(ShardLayout(ranges, 8192, shards=4), 1, 0)[:]
    # The first 400 positions are the first window: 4 shards, mixed (not one shard after another).
    first = [i // 100 for i in order[:400]]
    assert len(set(first)) == 4
    runs = sum(1 for a, b in zip(first, first[1:]) if a != b)
    assert runs > 200


def test_lazy_shards_order_with_sample_windows(monkeypatch):
    monkeypatch.setattr(epoch_mod, "LAZY_MIN", 0)
    layout = ShardLayout(RANGES, window=6)
    for world, even in ((1, True), (3, False), (2, True)):
        parts = [shard_stream_order(layout, 3, 0, r, world, even) for r in range(world)]
        got = [i for p in parts for i in p[:]]
        assert len(got) == len(set(got)) and [len(p) for p in parts] == shard_sizes(N, world, even)
        for p in parts:  # each block of 6 positions mixes that block of the shard stream
            flat = p[:]
            for a in range(0, len(flat), 6):
                assert sorted(flat[a:a + 6]) == sorted(p.take(a, a + 6).tolist())


def test_block_shuffle_on_a_billion_samples_by_sampling():
    ranges = [(s * 10_000, (s + 1) * 10_000) for s in range(100_000)]  # 10^9 samples
    layout = ShardLayout(tuple(ranges), 8192, shards=16)
    order = shard_stream_order(layout, 9, 0, 5, 64, True)
    assert len(order) == 10**9 // 64
    batch = order.take(123_456, 123_456 + 4096)
    w, _, _ = order.window_of(123_456)
    assert set((batch // 10_000).tolist()) <= set(order.window_shard_numbers(w))
    assert len(set(batch.tolist())) == 4096


def test_subkeys_differ():
    assert len({subkey(1, r) for r in range(1000)}) == 1000


# -- through the feeder: lazy orders, block shuffle, compact state ----------------------

class ShardedMemory(MemorySource):
    """A memory source cut into shards (``shard_ranges``), as TarShards is."""

    def __init__(self, blobs, ranges):
        super().__init__(blobs)
        self.ranges = ranges

    def shard_ranges(self):
        return list(self.ranges)


def _ranges(n, sizes):
    out, at = [], 0
    for s in sizes:
        if at >= n:
            break
        out.append((at, min(n, at + s)))
        at = min(n, at + s)
    if at < n:
        out.append((at, n))
    return out


@pytest.fixture
def lazy(monkeypatch):
    """Make every source 'large': lazy orders and format-2 states at any length."""
    monkeypatch.setattr(epoch_mod, "LAZY_MIN", 0)
    monkeypatch.setattr(resume_mod, "COMPACT_ABOVE", 0)
    monkeypatch.setattr(resume_mod, "LAZY_MIN", 0)


make = feeder_factory(B, lambda: [ops.RandomResizedCrop(16), ops.RandomHorizontalFlip()], seed=5,
                      shuffle=True, decode_threads=2, augment_threads=0)


@pytest.mark.parametrize("shuffle,extra", [(True, {}), ("shards", {"shuffle_shards": 2}),
                                           ("shards", {"shuffle_window": 5})])
def test_lazy_orders_through_the_feeder_exactly_once(lazy, jpeg_blobs, shuffle, extra):
    src = ShardedMemory(jpeg_blobs, _ranges(60, [7, 9, 4, 11, 6, 13]))
    for epoch in range(2):
        seen = collections.Counter()
        for rank in range(3):
            with make(src, shuffle=shuffle, rank=rank, world_size=3, **extra) as f:
                f.set_epoch(epoch)
                batches, err = drain(f)
                assert err is None, err
                got = labels_of(batches)
                layout = shard_layout(src, shuffle, f.config.shuffle_window, f.config.shuffle_shards)
                assert got == pass_order(60, B, shuffle, False, False, 5, epoch, rank, 3, layout)
                seen.update(got)
        assert seen == collections.Counter(range(60))


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("shuffle,extra", [(True, {}), ("shards", {"shuffle_shards": 2})])
def test_compact_state_resumes_exactly(lazy, jpeg_blobs, ordered, shuffle, extra):
    src = ShardedMemory(jpeg_blobs, _ranges(60, [7, 9, 4, 11, 6, 13]))
    with make(src, shuffle=shuffle, ordered=ordered, **extra) as f:
        full, err = drain(f)
        assert err is None
    with make(src, shuffle=shuffle, ordered=ordered, **extra) as f:
        head, err = drain(f, limit=3)
        assert err is None
        state = f.state_dict()
    assert state["version"] == 2 and state["epoch"] == 0 and state["batches"] == 3
    assert "delivered" not in state and isinstance(state["position"], int)
    if ordered:
        assert state["position"] == 3 * B and state["after"] == []
    state = pickle.loads(pickle.dumps(state))
    with make(src, shuffle=shuffle, ordered=ordered, **extra) as f:
        f.load_state_dict(state)
        rest, err = drain(f)
        assert err is None
    got = labels_of(head) + labels_of(rest)
    assert sorted(got) == list(range(60))
    if ordered:
        assert got == labels_of(full)
        for (x, y), (wx, wy) in zip(head + rest, full):  # pixel for pixel
            np.testing.assert_array_equal(y, wy)
            np.testing.assert_array_equal(x, wx)


def test_compact_state_refuses_damage_clearly(lazy, jpeg_blobs):
    src = MemorySource(jpeg_blobs)
    with make(src) as f:
        drain(f, limit=2)
        state = f.state_dict()
    cases = [({"position": 61}, r"state\['position'\] must be an int in \[0, 60\]"),
             ({"position": "3"}, r"state\['position'\]"),
             ({"after": [30, 20]}, r"state\['after'\] must hold increasing positions"),
             ({"after": "x"}, r"state\['after'\] must be a list of ints"),
             ({"skipped": [3]}, "no sample is ever skipped"),
             ({"position": 5}, "not the start|cannot hold|full batches"),
             ({"batches": 40}, "more than the 8 batches")]
    for change, message in cases:
        with make(src) as f:
            with pytest.raises(ValueError, match=message):
                f.load_state_dict({**state, **change})


def test_compact_state_with_skips_resumes_every_sample_once(lazy, jpeg_blobs):
    blobs = list(jpeg_blobs)
    for i in (3, 17, 40):
        blobs[i] = b"not an image"
    src = MemorySource(blobs)
    with make(src, on_error="skip", ordered=False) as f:
        head, err = drain(f, limit=4)
        assert err is None
        state = f.state_dict()
    with make(src, on_error="skip", ordered=False) as f:
        f.load_state_dict(state)
        rest, err = drain(f)
        assert err is None
    got = labels_of(head) + labels_of(rest)
    assert sorted(got) == sorted(set(range(60)) - {3, 17, 40})


def test_format_one_states_still_load_and_large_ones_are_refused(jpeg_blobs, monkeypatch):
    src = MemorySource(jpeg_blobs)
    with make(src) as f:
        drain(f, limit=2)
        old = f.state_dict()
    assert old["version"] == 1
    monkeypatch.setattr(resume_mod, "COMPACT_ABOVE", 0)
    with make(src) as f:
        f.load_state_dict(old)  # a format-1 state loads into a feeder that writes format 2
        state = f.state_dict()
        assert state["version"] == 2 and state["position"] == 2 * B
    monkeypatch.setattr(resume_mod, "LAZY_MIN", 10)
    with make(src) as f:
        with pytest.raises(ValueError, match="format 1 .* cannot be resumed"):
            f.load_state_dict(old)


def test_compact_state_is_small_for_a_billion_samples(lazy):
    class Huge:
        def __len__(self):
            return 10**9

        def read(self, index):
            raise AssertionError("not read")

    with Feeder(Huge(), 256, seed=1, shuffle=True, image_size=(8, 8)) as f:
        f.set_epoch(3)
        f.skip(1000)
        state = f.state_dict()
    assert state["version"] == 2 and state["position"] == 256_000
    assert len(pickle.dumps(state)) < 64 << 10


def test_shuffle_shards_needs_shuffle_shards(jpeg_blobs):
    with pytest.raises(ValueError, match="shuffle_shards=2 is the window of the block shuffle"):
        Feeder(MemorySource(jpeg_blobs), B, shuffle=True, shuffle_shards=2)
    with pytest.raises(ValueError, match="shuffle_shards must be None or an int >= 1"):
        Feeder(ShardedMemory(jpeg_blobs, [(0, 60)]), B, shuffle="shards", shuffle_shards=0)


def test_shuffle_window_where_it_is_unused_is_refused(jpeg_blobs):
    # It applies only to shuffle="shards" without shuffle_shards: given elsewhere
    # it was silently ignored.
    with pytest.raises(ValueError, match="shuffle_window=64 is the sample window .* shuffle=True"):
        Feeder(MemorySource(jpeg_blobs), B, shuffle=True, shuffle_window=64)
    with pytest.raises(ValueError, match="shuffle_window=64 .* shuffle_shards=2"):
        Feeder(ShardedMemory(jpeg_blobs, [(0, 60)]), B, shuffle="shards", shuffle_shards=2,
               shuffle_window=64)
    with Feeder(ShardedMemory(jpeg_blobs, [(0, 60)]), B, shuffle="shards", shuffle_window=64,
                image_size=(8, 8)) as f:
        assert f.config.shuffle_window == 64


def test_a_world_size_change_at_resume_is_refused(lazy, jpeg_blobs):
    src = ShardedMemory(jpeg_blobs, _ranges(60, [7, 9, 4, 11, 6, 13]))
    with make(src, shuffle="shards", shuffle_shards=2, rank=0, world_size=2) as f:
        drain(f, limit=1)
        state = f.state_dict()
    with make(src, shuffle="shards", shuffle_shards=2, rank=0, world_size=3) as f:
        with pytest.raises(ValueError, match=r"cannot resume: world_size differs \(saved 2, "
                                             r"this feeder 3\)"):
            f.load_state_dict(state)
        f.set_epoch(1)  # the next epoch with the new world size: no state needed
        batches, err = drain(f)
        assert err is None and len(labels_of(batches)) == 20
