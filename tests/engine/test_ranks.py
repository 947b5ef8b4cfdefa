"""feeder.engine.ranks: which shard this process reads (given, torch.distributed,
the launcher's environment) and the base seed every rank agrees on."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.distributed as dist

from feeder.engine.ranks import EpochSampler, Ranks, agreed_seed, launcher_shard, local_seed, shard


@pytest.fixture
def no_launcher(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture
def group(tmp_path, no_launcher):
    """A one-process gloo group (the only one a single test process can form)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "4"}, {"RANK": "2"}])
def test_launcher_without_both_variables_is_rank_0_of_1(monkeypatch, no_launcher, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launcher_shard() == (0, 1)


def test_launcher_environment(monkeypatch, no_launcher):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launcher_shard() == (3, 4)
    assert shard(None, None) == (3, 4)
    assert shard(1, 2) == (1, 2)  # given by hand: the environment is not read


@pytest.mark.parametrize("rank, world", [("4", "4"), ("-1", "4"), ("x", "4"), ("0", "four"),
                                         ("0", "0"), ("", "")])
def test_broken_launcher_environment_names_both_variables(monkeypatch, no_launcher, rank, world):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError) as err:
        launcher_shard()
    assert f"RANK={rank!r}" in str(err.value) and f"WORLD_SIZE={world!r}" in str(err.value)


def test_shard_without_a_group(no_launcher):
    assert shard(None, None) == (0, 1)
    assert shard(2, 5) == (2, 5)
    # Only one of the two given: not a shard by hand; the environment decides.
    assert shard(2, None) == (0, 1)


def test_shard_follows_a_group_of_one(group):
    assert shard(None, None) == (0, 1)
    assert shard(0, 1) == (0, 1)
    # A group of one process contradicts nothing: ranks given by hand still shard it
    # (one process emulating several ranks).
    assert shard(1, 3) == (1, 3)


def test_local_seed_follows_torch_manual_seed(no_launcher):
    torch.manual_seed(123)
    a = local_seed(None, None)
    torch.manual_seed(123)
    assert local_seed(None, None) == a and local_seed(None, None) != a
    assert 0 <= a < 2**62


def test_local_seed_is_0_for_ranks_by_hand_without_a_group(no_launcher, caplog):
    with caplog.at_level(logging.INFO, logger="feeder.engine.ranks"):
        assert local_seed(1, 2) == 0
    assert "seed 0 on every rank" in caplog.text
    torch.manual_seed(11)
    expected = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    torch.manual_seed(11)
    assert local_seed(0, 1) == expected != 0  # one rank: the drawn seed


def test_agreed_seed_without_a_group_is_0(no_launcher):
    assert agreed_seed(987, 2) == 0
    assert agreed_seed(0, 8) == 0


def test_agreed_seed_in_a_group_is_rank_0s(group):
    assert agreed_seed(987, 1) == 987
    # With a group to agree through, ranks by hand keep the drawn seed (not 0).
    torch.manual_seed(5)
    expected = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    torch.manual_seed(5)
    assert local_seed(1, 2) == expected != 0


def test_ranks_seed_given_or_drawn(no_launcher):
    r = Ranks(None, None)
    r.choose_seed(42)
    assert (r.seed, r.agreed) == (42, True)
    r.agree(4)  # a given seed is every rank's already
    assert r.seed == 42
    torch.manual_seed(7)
    r = Ranks(None, None)
    r.choose_seed(None)
    torch.manual_seed(7)
    assert r.seed == local_seed(None, None) and not r.agreed
    drawn = r.seed
    r.agree(1)  # one rank: nothing to agree
    assert (r.seed, r.agreed) == (drawn, False)
    r.agree(2)  # no group: seed 0, once
    assert (r.seed, r.agreed) == (0, True)
    r.seed = 99
    r.agree(2)
    assert r.seed == 99


def test_ranks_shard_is_read_at_each_call(monkeypatch, no_launcher):
    r = Ranks(None, None)
    assert r.shard() == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert r.shard() == (1, 2)
    assert Ranks(0, 3).shard() == (0, 3)


class _Feeder:
    num_samples = 5

    def __init__(self):
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def _next_pass_indices(self):
        return iter([4, 2, 0])


def test_epoch_sampler_forwards_to_its_feeder():
    f = _Feeder()
    s = EpochSampler(f)
    s.set_epoch(3)
    assert f.epochs == [3] and len(s) == 5 and list(s) == [4, 2, 0]
    assert "set_epoch" in repr(s)


def test_epoch_sampler_holds_its_feeder_weakly():
    f = _Feeder()
    s = EpochSampler(f)
    del f
    gc.collect()
    with pytest.raises(ReferenceError, match="garbage-collected"):
        s.set_epoch(1)
    with pytest.raises(ReferenceError):
        len(s)
