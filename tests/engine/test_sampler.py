"""Epoch order and shards."""

from __future__ import annotations

import numpy as np

import pytest

from feeder.engine.sampler import check_epoch, epoch_indices, num_batches, pass_order, shard_sizes


def test_permutation_is_seeded_by_seed_and_epoch():
    a = epoch_indices(100, True, seed=1, epoch=0)
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, epoch_indices(100, True, seed=1, epoch=0))
    assert not np.array_equal(a, epoch_indices(100, True, seed=1, epoch=1))
    assert not np.array_equal(a, epoch_indices(100, True, seed=2, epoch=0))
    assert epoch_indices(5, False, 0, 3).tolist() == [0, 1, 2, 3, 4]


def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder():
    for n, world in [(100, 4), (103, 4), (10, 3), (7, 7)]:
        shards = [epoch_indices(n, True, 5, 2, rank, world, even=True).tolist()
                  for rank in range(world)]
        sizes = {len(s) for s in shards}
        assert sizes == {n // world} and shard_sizes(n, world, even=True) == [n // world] * world
        flat = [i for s in shards for i in s]
        assert len(flat) == len(set(flat)) == (n // world) * world


@pytest.mark.parametrize("world", [2, 3, 7])
@pytest.mark.parametrize("shuffle", [True, False])
def test_uneven_shards_cover_every_sample_once(world, shuffle):
    n = 109
    shards = [pass_order(n, 8, shuffle, False, False, 5, 2, rank, world) for rank in range(world)]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(n))  # every sample, none twice
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sizes == shard_sizes(n, world, even=False)
    # Shuffle, then shard: every rank cuts the same permutation.
    whole = epoch_indices(n, shuffle, 5, 2).tolist()
    assert all(s == whole[rank::world] for rank, s in enumerate(shards))
    assert shards == [pass_order(n, 8, shuffle, False, False, 5, 2, rank, world)
                      for rank in range(world)]  # a pure function of its arguments


@pytest.mark.parametrize("length, batch_size, drop_last, world, named", [
    (0, 4, False, 1, ["len(source) == 0"]),
    (0, 4, True, 2, ["len(source) == 0"]),
    (109, 60, True, 2, ["every rank", "len(source)=109", "world_size=2", "54 samples",
                        "batch_size=60", "drop_last=True", "batch_size <= 54", "drop_last=False"]),
    (10, 4, True, 3, ["every rank", "len(source)=10", "3 samples", "batch_size <= 3"]),
    (3, 1, False, 7, ["ranks 3-6", "world_size=7", "0 samples", "fewer ranks"]),
    (6, 1, False, 7, ["rank 6", "0 samples", "fewer ranks"]),
])
def test_an_epoch_without_batches_is_refused(length, batch_size, drop_last, world, named):
    with pytest.raises(ValueError) as info:
        check_epoch(length, batch_size, drop_last, world)
    for text in named:
        assert text in str(info.value)


def test_an_epoch_with_batches_on_every_rank_passes():
    check_epoch(109, 109, False, 1)
    check_epoch(109, 54, True, 2)
    check_epoch(7, 1, True, 7)
    check_epoch(109, 500, False, 7)


def test_num_batches():
    assert num_batches(10, 3, drop_last=True) == 3
    assert num_batches(10, 3, drop_last=False) == 4
    assert num_batches(0, 3, drop_last=False) == 0


# -- iter(feeder.sampler): what the next pass dispatches ----------------------------------

@pytest.mark.parametrize("how", ["skip", "resume", "resume_unordered"])
def test_the_sampler_lists_what_the_next_pass_delivers(source, how):
    """After skip() or a resume the next pass leaves out what was handled; the
    sampler's iteration lists the same samples, in the same order."""
    from tests.support import drain, labels_of
    from feeder import Feeder, ops

    kw = dict(shuffle=True, seed=3, decode_threads=2, augment_threads=0,
              ordered=how != "resume_unordered")
    make = lambda: Feeder(source, 8, [ops.RandomResizedCrop(16)], **kw)  # noqa: E731
    with make() as f:
        if how == "skip":
            f.set_epoch(1)
            f.skip(2)
        else:
            f.set_epoch(1)
            head, err = drain(f, limit=3)
            assert err is None
            state = f.state_dict()
            f.close()
            f = make()
            f.load_state_dict(state)
        with f:
            listed = list(f.sampler)
            rest, err = drain(f)
            assert err is None
            again = list(f.sampler)  # the pass has ended: the next epoch, whole
    delivered = labels_of(rest)
    assert len(listed) == len(delivered) < len(source)
    if kw["ordered"]:
        assert listed == delivered
    else:
        assert sorted(listed) == sorted(delivered)
    assert len(again) == len(source)
