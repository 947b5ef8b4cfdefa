"""Elastic resume: a run preempted under one world size continues under another.
``load_state_dict`` takes every rank's state; the new ranks deliver exactly the
samples the old ranks had not, none twice, none lost, mid-epoch, with grouping
and the block shuffle, through several changes of the world size."""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import feeder as feeder_pkg
from tests.support import REPO_DIR, MemorySource, collect, drain, labels_of
from feeder import Feeder, Mixture, ops
from feeder.order.plan import EpochPlan, OrderOptions, elastic_sizes
from feeder.order.sequence import Handled

B = 4
N = 60


class Sharded(MemorySource):
    """A memory source cut into shards of 7 to 13 samples, as TarShards is."""

    def shard_ranges(self):
        cuts = [0, 7, 16, 20, 31, 37, 50, N]
        return list(zip(cuts, cuts[1:]))


SETTINGS = {
    "shuffled": dict(shuffle=True),
    "mixture": dict(shuffle=True),
    "grouped": dict(shuffle=True, group_by_aspect_ratio=0),
    "block shuffle": dict(shuffle="shards", shuffle_shards=2),
    "in order": dict(shuffle=False),
}


def _source(setting, blobs):
    """The source of a setting: for "mixture", a weighted mixture of two sources
    (labels unique over both), the smaller drawn more often than it has samples,
    so that it repeats within an epoch."""
    if setting != "mixture":
        return Sharded(blobs)
    return Mixture([MemorySource(blobs[:40], list(range(40))),
                    MemorySource(blobs[40:], list(range(40, 60)))], weights=[0.3, 0.7])


def _make(source, rank, world, drop_last, ordered=True, **options) -> Feeder:
    return Feeder(source, B, [ops.Resize((16, 16))], seed=11, rank=rank, world_size=world,
                  drop_last=drop_last, ordered=ordered, decode_threads=2, augment_threads=0,
                  **options)


def _run_until(source, world, batches, drop_last, ordered, options, states=None):
    """Each rank of ``world`` continues (from ``states``, every old rank's) and
    delivers ``batches[rank]`` batches (None: to the end of the pass); returns
    (labels per rank, state per rank)."""
    got, saved = [], []
    for rank in range(world):
        with _make(source, rank, world, drop_last, ordered, **options) as f:
            f.set_epoch(2)
            if states is not None:
                f.load_state_dict(pickle.loads(pickle.dumps(states)))
            out, err = drain(f, limit=batches[rank])
            assert err is None, err
            got.append(labels_of(out))
            saved.append(f.state_dict())
    return got, saved


def _epoch(source, world, drop_last, options) -> list[int]:
    """Every sample the uninterrupted run of ``world`` ranks delivers in epoch 2."""
    out = []
    for rank in range(world):
        with _make(source, rank, world, drop_last, **options) as f:
            f.set_epoch(2)
            batches, err = drain(f)
            assert err is None, err
            out += labels_of(batches)
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("old, new", [(1, 3), (4, 2), (2, 5)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_new_world_delivers_exactly_what_the_old_one_left(jpeg_blobs, setting, old, new,
                                                             drop_last):
    options = SETTINGS[setting]
    source = _source(setting, jpeg_blobs)
    whole = _epoch(source, old, drop_last, options)
    before, states = _run_until(source, old, [1 + r % 3 for r in range(old)], drop_last, True,
                                options)
    after, _ = _run_until(source, new, [None] * new, drop_last, True, options, states)
    delivered = [i for part in before + after for i in part]
    # None twice, none lost: each sample as often as the epoch draws it (once,
    # but for the mixture's repeated source).
    assert collections.Counter(delivered) == collections.Counter(whole)
    # DDP steps the ranks together: the same number of batches wherever the rest allows.
    left = len(whole) - sum(map(len, before))
    sizes = elastic_sizes(left, new, B)
    assert [len(a) for a in after] == sizes
    if len({-(-s // B) for s in sizes}) == 1:
        for rank in range(new):
            with _make(source, rank, new, drop_last, **options) as f:
                f.load_state_dict(states)
                assert -(-len(list(f.sampler)) // B) == -(-sizes[0] // B)  # this rank's batches


@pytest.mark.parametrize("setting", ["shuffled", "grouped", "block shuffle", "mixture"])
def test_the_world_changes_twice_within_an_epoch(jpeg_blobs, setting):
    """4 ranks, then 2 (each delivers a batch and is preempted again), then 3,
    out of order (ordered=False): the three runs together deliver the epoch once."""
    options = SETTINGS[setting]
    source = _source(setting, jpeg_blobs)
    whole = _epoch(source, 4, False, options)
    first, states = _run_until(source, 4, [2, 1, 0, 3], False, False, options)
    second, states = _run_until(source, 2, [1, 2], False, False, options, states)
    assert all("levels" in s for s in states)
    third, after = _run_until(source, 3, [None] * 3, False, False, options, states)
    delivered = [i for part in first + second + third for i in part]
    assert collections.Counter(delivered) == collections.Counter(whole)
    assert all(s["epoch"] is None and s["next_epoch"] == 3 for s in after)  # the epoch is done


def test_a_resharded_pass_resumes_under_its_own_world_size(jpeg_blobs):
    """A state saved after a world-size change, loaded by the same world (alone or
    as the list), continues that rank's share exactly."""
    source = Sharded(jpeg_blobs)
    options = SETTINGS["shuffled"]
    _, states = _run_until(source, 2, [2, 1], False, True, options)
    head, mid = _run_until(source, 3, [1, 1, 2], False, True, options, states)
    rest_list, _ = _run_until(source, 3, [None] * 3, False, True, options, mid)
    rest_one = []
    for rank in range(3):
        with _make(source, rank, 3, False, **options) as f:
            f.load_state_dict(mid[rank])
            rest_one.append(labels_of(drain(f)[0]))
    assert rest_one == rest_list
    reference, _ = _run_until(source, 3, [None] * 3, False, True, options, states)
    assert [h + r for h, r in zip(head, rest_list)] == reference  # ordered: the same batches


@pytest.mark.parametrize("new", [1, 3])
def test_the_batch_count_continues_to_the_new_worlds_length(jpeg_blobs, caplog, new):
    """The rest's batches are numbered so that the pass ends at len(feeder), and a
    pass that skipped nothing says nothing about skips."""
    source = Sharded(jpeg_blobs)
    _, states = _run_until(source, 2, [1, 2], False, True, SETTINGS["shuffled"])
    for rank in range(new):
        with _make(source, rank, new, False, **SETTINGS["shuffled"]) as f:
            f.load_state_dict(states)
            numbers, err = collect(f, keep=lambda batch: f.last_batch.number)
            assert err is None, err
            assert numbers == list(range(len(f) - len(numbers), len(f)))
    assert not [r for r in caplog.records if "ended after" in r.getMessage()]


def test_every_rank_finished_continues_at_the_next_epoch(jpeg_blobs):
    source = Sharded(jpeg_blobs)
    _, states = _run_until(source, 2, [None, None], True, True, SETTINGS["shuffled"])
    with _make(source, 0, 3, True, **SETTINGS["shuffled"]) as f:
        f.load_state_dict(states)
        state = f.state_dict()
        assert state["epoch"] is None and state["next_epoch"] == 3
        resumed = list(f.sampler)
    with _make(source, 0, 3, True, **SETTINGS["shuffled"]) as fresh:
        fresh.set_epoch(3)
        assert resumed == list(fresh.sampler)


def test_one_ranks_state_under_another_world_size_says_what_to_pass(jpeg_blobs):
    source = Sharded(jpeg_blobs)
    _, states = _run_until(source, 2, [1, 1], False, True, SETTINGS["shuffled"])
    with _make(source, 0, 3, False, **SETTINGS["shuffled"]) as f:
        with pytest.raises(ValueError, match=r"world_size differs .*list of every rank's state_dict"):
            f.load_state_dict(states[0])


@pytest.mark.parametrize("damage, message", [
    (lambda s: s[:1], r"1 states of ranks \[0\] under world_size=2"),
    (lambda s: [s[0], s[0]], r"ranks \[0, 0\]"),
    (lambda s: [], "empty list"),
    (lambda s: [s[0], dict(s[1], epoch=0)], r"inside epochs \[0, 2\]"),
    (lambda s: [s[0], dict(s[1], settings=dict(s[1]["settings"], seed=3))], "seed differs"),
    (lambda s: [s[0], {"version": 9}], r"state\[1\] is not a feeder state"),
    (lambda s: [s[0], dict(s[1], levels=[[2, [[0, []]]]])], "levels"),
])
def test_a_damaged_list_of_states_is_refused_naming_why(jpeg_blobs, damage, message):
    source = Sharded(jpeg_blobs)
    _, states = _run_until(source, 2, [1, 2], False, True, SETTINGS["shuffled"])
    with _make(source, 0, 3, False, **SETTINGS["shuffled"]) as f:
        with pytest.raises(ValueError, match=message):
            f.load_state_dict(damage(states))


def test_the_plans_resharded_orders_partition_what_is_left():
    class Length:
        def __len__(self):
            return 103

        def read(self, index):
            raise AssertionError

    plan = EpochPlan(Length(), OrderOptions(batch_size=4, shuffle=True, drop_last=False))

    handled = (Handled(8, (9, 11)), Handled(0), Handled(34))
    levels = ((3, handled),)
    left = plan.left(5, 7, levels)[:]
    parts = [plan.order(5, r, 2, 7, levels=levels)[:] for r in range(2)]
    assert parts[0] + parts[1] == left
    done = set()
    for r, h in enumerate(handled):
        order = plan.order(5, r, 3, 7)[:]
        done |= {order[p] for p in range(h.position)} | {order[p] for p in h.after}
    assert set(left) == set(range(103)) - done and len(left) == 103 - len(done)


SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r})
    import torch
    import torch.distributed as dist
    from tests.support import MemorySource
    from tests.support.faults import distinct_jpegs
    from feeder import Feeder, Mixture, ops

    phase, out_dir = sys.argv[1], sys.argv[2]
    source = MemorySource(distinct_jpegs(50, seed=3, side=16))
    feeder = Feeder(source, 4, [ops.CenterCrop(16)], shuffle=True, seed=7, drop_last=False,
                    decode_threads=2)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    feeder.set_epoch(1)
    got = []
    if phase == "first":
        it = iter(feeder)
        for _ in range(2 + rank):
            got += next(it)[1].tolist()
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, feeder.state_dict())
        if rank == 0:  # a checkpoint, as a trainer writes it
            torch.save(states, os.path.join(out_dir, "states.pt"))
    else:
        feeder.load_state_dict(torch.load(os.path.join(out_dir, "states.pt")))
        got = [v for _, y in feeder for v in y.tolist()]
    with open(os.path.join(out_dir, f"{{phase}}{{rank}}.json"), "w") as f:
        json.dump(got, f)
    feeder.close()
    dist.destroy_process_group()
""")


def test_torchrun_two_ranks_then_three(tmp_path):
    """Real torchrun processes (gloo): two ranks gather their states and stop
    mid-epoch; three ranks load the list and finish the epoch."""
    pytest.importorskip("torch.distributed.run")
    script = tmp_path / "elastic.py"
    script.write_text(SCRIPT.format(repo=REPO_DIR))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(feeder_pkg.__file__)),
               OMP_NUM_THREADS="1")
    for phase, world in (("first", 2), ("second", 3)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", str(script), phase, str(tmp_path)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, f"torchrun failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    first = [json.loads((tmp_path / f"first{r}.json").read_text()) for r in range(2)]
    second = [json.loads((tmp_path / f"second{r}.json").read_text()) for r in range(3)]
    assert [len(g) for g in first] == [8, 12]
    delivered = [i for part in first + second for i in part]
    assert sorted(delivered) == list(range(50))


def test_a_level_past_its_order_is_refused_not_taken_as_all_delivered(jpeg_blobs):
    """A state's earlier world sizes (``levels``) whose positions run past the
    orders they index would drop those orders' samples: refused, naming it."""
    source = Sharded(jpeg_blobs)
    options = SETTINGS["shuffled"]
    _, states = _run_until(source, 2, [1, 1], False, True, options)
    _, moved = _run_until(source, 3, [0, 0, 0], False, True, options, states)
    levels = moved[0]["levels"]
    damaged = [[levels[0][0], [[10 ** 6, []]] + levels[0][1][1:]]]
    with _make(source, 0, 3, False, **options) as f:
        with pytest.raises(ValueError, match=r"state\['levels'\]\[0\]: rank 0 of 2"):
            f.load_state_dict(dict(moved[0], levels=damaged))
    with _make(source, 0, 4, False, **options) as f:
        with pytest.raises(ValueError, match=r"state\['levels'\]\[0\]: rank 0 of 2"):
            f.load_state_dict([dict(s, levels=damaged) for s in moved])
