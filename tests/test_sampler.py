"""Epoch order and shards."""

from __future__ import annotations

import numpy as np

from feeder._sampler import epoch_indices, num_batches


def test_permutation_is_seeded_by_seed_and_epoch():
    a = epoch_indices(100, True, seed=1, epoch=0)
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, epoch_indices(100, True, seed=1, epoch=0))
    assert not np.array_equal(a, epoch_indices(100, True, seed=1, epoch=1))
    assert not np.array_equal(a, epoch_indices(100, True, seed=2, epoch=0))
    assert epoch_indices(5, False, 0, 3).tolist() == [0, 1, 2, 3, 4]


def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder():
    for n, world in [(100, 4), (103, 4), (10, 3), (7, 7)]:
        shards = [epoch_indices(n, True, 5, 2, rank, world).tolist() for rank in range(world)]
        sizes = {len(s) for s in shards}
        assert sizes == {n // world}
        flat = [i for s in shards for i in s]
        assert len(flat) == len(set(flat)) == (n // world) * world


def test_num_batches():
    assert num_batches(10, 3, drop_last=True) == 3
    assert num_batches(10, 3, drop_last=False) == 4
    assert num_batches(0, 3, drop_last=False) == 0
