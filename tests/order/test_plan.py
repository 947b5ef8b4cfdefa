"""feeder.order.plan: the one place a feeder's epoch orders come from. The pass
dispatches the plan's order and resume counts along the same one, so they agree
by construction."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import feeder.order.plan as plan_mod
from tests.support import BlockingSource, MemorySource, collect, collected
from feeder import Feeder, ops
from feeder.order.epoch import pass_sequence
from feeder.order.plan import EpochPlan, OrderOptions


class Length:
    """A source of ``n`` samples that is never read (orders need only the length)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def read(self, index: int):
        raise AssertionError(f"read({index}): an order reads no sample")


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_ranks_orders_are_disjoint_and_cover_the_epoch(drop_last):
    n, world = 103, 3
    plan = EpochPlan(Length(n), OrderOptions(batch_size=4, drop_last=drop_last))
    orders = [plan.order(5, rank, world, seed=7)[:] for rank in range(world)]
    flat = [i for order in orders for i in order]
    assert len(flat) == len(set(flat))
    if drop_last:  # equal whole batches on every rank
        assert {len(o) for o in orders} == {n // world // 4 * 4}
    else:
        assert sorted(flat) == list(range(n))
    again = EpochPlan(Length(n), OrderOptions(batch_size=4, drop_last=drop_last))
    assert [again.order(5, r, world, seed=7)[:] for r in range(world)] == orders
    assert plan.order(6, 0, world, seed=7)[:] != orders[0]
    assert plan.order(5, 0, world, seed=8)[:] != orders[0]


def test_an_ungrouped_order_is_the_passs_sequence():
    plan = EpochPlan(Length(50), OrderOptions(batch_size=8, shuffle=True, drop_last=True, skip=True))
    assert plan.order(2, 1, 2, seed=3)[:] == pass_sequence(50, 8, True, True, True, 3, 2, 1, 2)[:]


def test_a_shard_shuffle_needs_a_source_with_shards():
    with pytest.raises((TypeError, ValueError), match="shard"):
        EpochPlan(Length(10), OrderOptions(batch_size=2, shuffle="shards"))


def _grouped_feeder(blobs, **kw) -> Feeder:
    return Feeder(MemorySource(blobs), 4, [ops.Resize((24, 24))], group_by_aspect_ratio=0, seed=3,
                  ordered=True, decode_threads=2, augment_threads=0, drop_last=False, **kw)


def _labels(batches) -> list[int]:
    return [int(v) for b in batches for v in b[1]]


def test_the_pass_and_resume_share_the_plans_grouped_order(jpeg_blobs, monkeypatch):
    """A grouped order is computed once per epoch and feeder: the pass dispatches
    it, the state counts along it, and a resumed feeder continues along its own
    plan's, which is the same order."""
    computed: list[int] = []
    real = plan_mod.group_sequence

    def counted(order, source, options, chain, seed, epoch, stopped=None):
        computed.append(epoch)
        return real(order, source, options, chain, seed, epoch, stopped)

    monkeypatch.setattr(plan_mod, "group_sequence", counted)
    with _grouped_feeder(jpeg_blobs) as f:
        it = iter(f)
        head = collected(it, limit=3, keep=lambda b: (None, b[1].clone()))
        state = f.state_dict()
        rest = collected(it, keep=lambda b: (None, b[1].clone()))
    assert computed == [0]  # the pass's and the state's order: one computation
    plan = EpochPlan(MemorySource(jpeg_blobs), OrderOptions.of(f.config), f.chain)
    expected = plan.order(0, 0, 1, seed=3)[:]
    assert _labels(head) + _labels(rest) == expected
    computed.clear()
    with _grouped_feeder(jpeg_blobs) as g:
        g.load_state_dict(state)
        resumed = collected(g, keep=lambda b: (None, b[1].clone()))
    assert _labels(resumed) == _labels(rest) == expected[12:]
    assert computed == [0]  # checked against the state, then dispatched: once


def test_a_stopped_pass_ends_its_grouping_scan(jpeg_blobs):
    """Closing the feeder while the grouped order's header scan runs ends the pass
    (no hang, no error from the scan)."""
    source = BlockingSource(jpeg_blobs, stuck=7)
    f = Feeder(source, 4, [ops.Resize((24, 24))], group_by_aspect_ratio=0, seed=3,
               decode_threads=2, augment_threads=0)
    it = iter(f)
    out: list = []

    t = threading.Thread(target=lambda: out.append(collect(it)), daemon=True)
    t.start()
    assert source.entered.wait(30)
    f.close()
    source.release.set()
    t.join(30)
    assert not t.is_alive()
    batches, err = out[0]
    assert batches == [] and (err is None or "closed" in str(err).lower()), err


class OwnOrder(Length):
    """``n`` positions per epoch over ``count`` sample indices, in an order it gives itself."""

    def __init__(self, n: int, count: int, order) -> None:
        super().__init__(n)
        self.index_count = count
        self.given = order

    def epoch_order(self, seed: int, epoch: int, shuffle: bool):
        return self.given(seed, epoch, shuffle)


@pytest.mark.parametrize("kind", [list, np.asarray])
def test_a_source_may_give_its_own_order_as_a_list_or_an_array(kind):
    """Each rank takes its contiguous share of what ``epoch_order`` gives."""
    def given(seed, epoch, shuffle):
        return kind([(seed + 3 * epoch + 5 * k) % 40 for k in range(12)])

    plan = EpochPlan(OwnOrder(12, 40, given), OrderOptions(batch_size=2, drop_last=True))
    whole = list(given(7, 1, True))
    assert plan.order(1, 0, 2, seed=7)[:] == whole[:6]
    assert plan.order(1, 1, 2, seed=7)[:] == whole[6:]


@pytest.mark.parametrize("order, error, match", [
    ([0, 1, 40, 2], ValueError, "sample index 40, outside \\[0, 40\\)"),
    ([0, -1, 2, 3], ValueError, "sample index -1"),
    ([0.5, 1.0, 2.0, 3.0], TypeError, "1-D int array"),
    ([[0, 1], [2, 3]], TypeError, "1-D int array"),
    ([0, 1, 2], ValueError, "gave 3 positions for a source of 4"),
])
def test_an_own_order_out_of_its_indices_is_refused_naming_the_source(order, error, match):
    plan = EpochPlan(OwnOrder(4, 40, lambda *_: order), OrderOptions(batch_size=2))
    with pytest.raises(error, match=match) as got:
        plan.order(0, 0, 1, seed=0)
    assert "OwnOrder.epoch_order()" in str(got.value)
