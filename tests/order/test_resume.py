"""Mid-epoch resume: Feeder.state_dict() / load_state_dict()."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from feeder import Feeder, ops
from feeder.ops import RandomHorizontalFlip, RandomResizedCrop

from tests.support import CountingSource, MemorySource, drain, labels_of
from tests.support.faults import feeder_factory

B = 8


def transforms():
    return [RandomResizedCrop(32), RandomHorizontalFlip()]


make = feeder_factory(B, transforms, seed=5, shuffle=True, decode_threads=2, augment_threads=0)


def epochs(feeder, n):
    out = []
    for _ in range(n):
        batches, err = drain(feeder)
        assert err is None, err
        out.append(batches)
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for (x, y), (wx, wy) in zip(got, want):
        np.testing.assert_array_equal(y, wy)
        np.testing.assert_array_equal(x, wx)


@pytest.fixture
def reference(source):
    with make(source) as f:
        return epochs(f, 2)


def interrupted(source, taken, **kw):
    """A feeder that delivered ``taken`` batches of epoch 0, then stopped; its state."""
    with make(source, **kw) as f:
        batches, err = drain(f, limit=taken)
        assert err is None and len(batches) == taken
        return batches, f.state_dict()


@pytest.mark.parametrize("via", ["pickle", "torch"])
def test_ordered_resume_is_bit_identical(source, reference, tmp_path, via):
    first, state = interrupted(source, 3)
    assert_same(first, reference[0][:3])
    if via == "torch":
        torch.save({"feeder": state}, tmp_path / "ckpt.pt")
        state = torch.load(tmp_path / "ckpt.pt")["feeder"]
    else:
        state = pickle.loads(pickle.dumps(state))
    # Other thread counts and queue sizes: the output does not depend on them.
    with make(source, decode_threads=3, augment_threads=1, queue_size=1) as f:
        f.load_state_dict(state)
        rest, following = epochs(f, 2)
        assert f.last_batch.epoch == 1
    assert_same(rest, reference[0][3:])
    assert_same(following, reference[1])


def test_batch_numbers_continue(source):
    _, state = interrupted(source, 2)
    with make(source) as f:
        f.load_state_dict(state)
        batches, err = drain(f, limit=1)
        assert err is None
        assert (f.last_batch.epoch, f.last_batch.number) == (0, 2)
        state2 = f.state_dict()
    assert state2["epoch"] == 0 and state2["batches"] == 3


def test_resume_does_not_read_delivered_samples(mixed_blobs):
    src = CountingSource(mixed_blobs)
    first, state = interrupted(src, 4)
    delivered = set(labels_of(first))
    src.reads.clear()
    with make(src) as f:
        f.load_state_dict(state)
        (rest,) = epochs(f, 1)
    assert not delivered & set(src.reads)
    assert sorted(delivered | set(labels_of(rest))) == list(range(len(mixed_blobs)))
    assert all(n == 1 for n in src.reads.values())


@pytest.mark.parametrize("ordered,on_error", [(True, "skip"), (False, "skip"), (False, "raise")])
def test_every_undelivered_sample_exactly_once(mixed_blobs, ordered, on_error):
    blobs = list(mixed_blobs)
    bad = {5, 17, 18, 40} if on_error == "skip" else set()
    for i in bad:
        blobs[i] = b"not an image"
    src = CountingSource(blobs)
    kw = dict(ordered=ordered, on_error=on_error)
    first, state = interrupted(src, 3, **kw)
    handled = set(labels_of(first))
    skipped_before = {i for i in bad if src.reads[i]} - handled
    src.reads.clear()
    with make(src, **kw) as f:
        f.load_state_dict(state)
        (rest,) = epochs(f, 1)
    again = labels_of(rest)
    assert len(again) == len(set(again))  # nothing twice in the resumed pass
    assert not handled & set(again)  # nothing delivered in both runs
    assert handled | set(again) == set(range(len(blobs))) - bad
    assert not handled & set(src.reads)  # no delivered sample read again
    # A sample skipped before the state was taken is not tried again either,
    # when the state records it (it failed in a batch already delivered or in flight).
    saved_skipped = np.unpackbits(np.frombuffer(state["skipped"], np.uint8),
                                  count=len(blobs)).astype(bool)
    assert not {i for i in skipped_before if saved_skipped[i]} & set(src.reads)


@pytest.mark.parametrize("passes_before", [0, 1], ids=["before-any-pass", "between-passes"])
def test_state_outside_a_pass(source, reference, passes_before):
    with make(source) as f:
        if passes_before:
            epochs(f, passes_before)
        state = f.state_dict()
    assert state["epoch"] is None and state["next_epoch"] == passes_before
    with make(source) as f:
        f.load_state_dict(state)
        assert_same(epochs(f, 1)[0], reference[passes_before])


@pytest.mark.parametrize("ordered,on_error,drop_last", [
    (True, "raise", False), (False, "raise", True), (True, "skip", False), (False, "skip", True)])
def test_state_after_last_batch_before_end(mixed_blobs, ordered, on_error, drop_last):
    """Every batch taken but not yet StopIteration (a loop that stops at len(feeder),
    as Lightning's does): the pass is finished, and the next one is the next
    epoch, as in the uninterrupted run (not an empty rest of this one)."""
    source = MemorySource(mixed_blobs[:-1])  # 59 samples: a short last batch, or a dropped tail
    kw = dict(ordered=ordered, on_error=on_error, drop_last=drop_last)
    with make(source, **kw) as f:
        whole = epochs(f, 2)
    n = len(whole[0])
    _, state = interrupted(source, n, **kw)
    assert state["epoch"] is None and state["next_epoch"] == 1
    # A state saved with the pass marked unfinished loads as finished too.
    _, unfinished = interrupted(source, n - 1, **kw)
    with make(source, **kw) as f:
        f.load_state_dict(unfinished)
        it = iter(f)
        next(it)
        old = f.state_dict()
        assert old["epoch"] is None and old["next_epoch"] == 1
    # One written by hand (or by an earlier version) with the epoch still open.
    bits = np.zeros(len(source), bool)
    bits[labels_of(whole[0])] = True
    hand = dict(unfinished, epoch=0, next_epoch=1, batches=n, delivered=np.packbits(bits).tobytes())
    for saved in (state, old, hand):
        with make(source, **kw) as f:
            f.load_state_dict(saved)
            (following,) = epochs(f, 1)
        if ordered:
            assert_same(following, whole[1])
        else:
            assert sorted(labels_of(following)) == sorted(labels_of(whole[1]))


def test_seed_none_takes_saved_seed(source, reference):
    _, state = interrupted(source, 2)
    with make(source, seed=None) as f:
        f.load_state_dict(state)
        (rest,) = epochs(f, 1)
    assert_same(rest, reference[0][2:])


def test_set_epoch_after_load(source, reference):
    _, state = interrupted(source, 2)
    with make(source) as f:
        f.load_state_dict(state)
        f.set_epoch(1)  # another epoch: starts it from its beginning
        assert_same(epochs(f, 1)[0], reference[1])
    with make(source) as f:
        f.load_state_dict(state)
        f.set_epoch(0)  # the unfinished epoch itself: the resume stands
        assert_same(epochs(f, 1)[0], reference[0][2:])


@pytest.mark.parametrize("field,kw,saved,mine", [
    ("batch_size", None, "8", "4"),
    ("seed", dict(seed=6), "5", "6"),
    ("shuffle", dict(shuffle=False), "True", "False"),
    ("drop_last", dict(drop_last=True), "False", "True"),
    ("ordered", dict(ordered=False), "True", "False"),
    ("on_error", dict(on_error="skip"), "'raise'", "'skip'"),
    ("world_size", dict(rank=0, world_size=2), "1", "2"),
    ("transforms", "flip", "RandomHorizontalFlip", "RandomResizedCrop"),
    ("source_length", "short", "60", "59"),
])
def test_mismatch_is_rejected(source, field, kw, saved, mine):
    _, state = interrupted(source, 1)
    if kw is None:
        f = Feeder(source, 4, transforms(), seed=5, shuffle=True)
    elif kw == "flip":
        f = Feeder(source, B, [RandomResizedCrop(32)], seed=5, shuffle=True)
    elif kw == "short":
        f = make(MemorySource(source.blobs[:59]))
    else:
        f = make(source, **kw)
    with f, pytest.raises(ValueError, match=field) as info:
        f.load_state_dict(state)
    assert saved in str(info.value) and mine in str(info.value)


def test_image_size_mismatch(source):
    with Feeder(source, B, image_size=(16, 16), seed=1) as f:
        state = f.state_dict()
    with Feeder(source, B, image_size=(16, 20), seed=1) as f, \
            pytest.raises(ValueError, match=r"image_size.*\(16, 16\).*\(16, 20\)"):
        f.load_state_dict(state)


def test_not_a_state(source):
    with make(source) as f:
        with pytest.raises(ValueError, match="version"):
            f.load_state_dict({"version": 99})
        with pytest.raises(ValueError, match="version"):
            f.load_state_dict([1, 2])


def test_damaged_ordered_state_is_rejected(source):
    """Under ordered=True, on_error="raise" the delivered samples must be the
    head of the epoch's order: anything else could not give the same batches."""
    _, state = interrupted(source, 2)
    bits = np.unpackbits(np.frombuffer(state["delivered"], np.uint8), count=60).astype(bool)
    first = int(np.flatnonzero(bits)[0])
    bits[first] = False
    bits[int(np.flatnonzero(~bits)[-1])] = True
    state["delivered"] = np.packbits(bits).tobytes()
    with make(source) as f, pytest.raises(ValueError, match="delivered"):
        f.load_state_dict(state)


def test_another_ranks_state_positions_this_rank_by_its_batches(source):
    """Trainers that checkpoint from rank 0 only (Lightning under DDP): with ordered
    batches, rank 1 continues its own shard after as many batches as rank 0 took."""
    ranks = dict(world_size=2)
    with make(source, rank=1, **ranks) as f:
        whole = epochs(f, 2)
    _, state = interrupted(source, 2, rank=0, **ranks)
    with make(source, rank=1, **ranks) as f:
        f.load_state_dict(state)
        rest, following = epochs(f, 2)
    assert_same(rest, whole[0][2:])
    assert_same(following, whole[1])
    for saving, loading in ((dict(ordered=False),) * 2, (dict(on_error="skip"),) * 2,
                            (dict(world_size=3), {})):
        _, state = interrupted(source, 1, rank=0, **{**ranks, **saving})
        with make(source, rank=1, **{**ranks, **loading}) as f:
            with pytest.raises(ValueError, match=r"cannot resume: (rank|world_size) differs"):
                f.load_state_dict(state)


# -- impossible states are refused, naming the field ---------------------------------------

def bits_of(state, field, n=60):
    return np.unpackbits(np.frombuffer(state[field], np.uint8), count=n).astype(bool)


def with_bits(state, field, bits):
    return {**state, field: np.packbits(bits).tobytes()}


def refused(source, state, match, **kw):
    with make(source, **kw) as f:
        with pytest.raises(ValueError, match=match) as info:
            f.load_state_dict(state)
        # A refused state changes nothing: the next pass is a first pass of epoch 0.
        assert f.state_dict()["epoch"] is None and f.state_dict()["next_epoch"] == 0
    return str(info.value)


def test_skipped_bit_under_raise_is_refused(source):
    """A skipped bit for a sample never handed out would drop that sample from the
    resumed pass: under on_error="raise" nothing is ever skipped."""
    for ordered in (True, False):
        _, state = interrupted(source, 2, ordered=ordered)
        delivered = bits_of(state, "delivered")
        skipped = np.zeros(60, bool)
        skipped[int(np.flatnonzero(~delivered)[0])] = True
        msg = refused(source, with_bits(state, "skipped", skipped), r"state\['skipped'\]",
                      ordered=ordered)
        assert f"sample {int(np.flatnonzero(skipped)[0])}" in msg and "on_error='raise'" in msg


@pytest.mark.parametrize("ordered", [True, False])
def test_sample_both_delivered_and_skipped_is_refused(source, ordered):
    _, state = interrupted(source, 2, on_error="skip", ordered=ordered)
    skipped = bits_of(state, "delivered").copy()
    msg = refused(source, with_bits(state, "skipped", skipped),
                  r"state\['delivered'\] and state\['skipped'\] both mark", on_error="skip",
                  ordered=ordered)
    assert "sample" in msg


def test_sample_outside_this_ranks_pass_is_refused(source):
    kw = dict(rank=0, world_size=2, ordered=False)
    _, state = interrupted(source, 1, **kw)
    # Rank 1's first sample is never handed out by rank 0's pass.
    from feeder.engine.sampler import pass_order
    theirs = pass_order(60, B, True, False, False, 5, 0, 1, 2)
    marked = bits_of(state, "delivered").copy()
    marked[theirs[0]] = True
    msg = refused(source, with_bits(state, "delivered", marked), r"state\['delivered'\] marks", **kw)
    assert f"sample {theirs[0]}" in msg and "never hands out" in msg


@pytest.mark.parametrize("change, field", [
    (dict(batches=2), "delivered"),        # 8 samples cannot fill 2 batches without skips
    (dict(batches=0), "delivered"),        # delivered samples but no batch
    (dict(batches=99), "batches"),         # more batches than the pass has
    (dict(batches=1.0), "batches"), (dict(batches=True), "batches"),
    (dict(epoch="0"), "epoch"), (dict(epoch=-1), "epoch"), (dict(next_epoch=None), "next_epoch"),
    (dict(skipped_total=-1), "skipped_total"), (dict(skipped_total=None), "skipped_total"),
    (dict(delivered=b"\x00"), "delivered"), (dict(skipped=None), "skipped"),
])
def test_counts_and_types_out_of_range_are_refused(source, change, field):
    _, state = interrupted(source, 1, ordered=False)
    refused(source, {**state, **change}, rf"state\['{field}'\]", ordered=False)


def test_batch_count_under_skip_fits_the_delivered_samples(source):
    _, state = interrupted(source, 1, ordered=False, on_error="skip")
    refused(source, {**state, "batches": 0}, r"state\['delivered'\] marks 8 samples",
            ordered=False, on_error="skip")


def test_padding_bits_and_bitmaps_without_a_pass_are_refused(source):
    _, state = interrupted(source, 1, ordered=False)
    padded = bytearray(state["skipped"])
    padded[-1] |= 1  # 60 samples: the last byte's low 4 bits are padding
    refused(source, {**state, "skipped": bytes(padded)}, r"state\['skipped'\].*past the last",
            ordered=False)
    with make(source) as f:
        idle = f.state_dict()
    refused(source, {**idle, "delivered": state["delivered"]},
            r"state\['delivered'\] must be None when state\['epoch'\] is None")


@pytest.mark.parametrize("name, value", [("seed", True), ("batch_size", 8.0), ("drop_last", 0)])
def test_settings_of_another_type_are_refused(source, name, value):
    _, state = interrupted(source, 1, seed=1)
    state = {**state, "settings": {**state["settings"], name: value}}
    refused(source, state, f"{name} differs", seed=1)
    if name == "seed":
        with Feeder(source, B, transforms(), seed=None) as f, pytest.raises(ValueError, match="seed"):
            f.load_state_dict(state)


# -- every setting that changes the order is saved and checked ---------------------------

def test_every_order_setting_is_saved_and_checked(source):
    """A setting saved only when set loaded into a feeder without it: the resumed
    pass would count positions along another order."""
    class Sharded(MemorySource):
        def __init__(self, blobs, cut):
            super().__init__(blobs)
            self.cut = cut

        def shard_ranges(self):
            return [(a, min(a + self.cut, len(self))) for a in range(0, len(self), self.cut)]

    blobs = source.blobs[:40]
    kw = dict(shuffle="shards", seed=1, decode_threads=1, augment_threads=0)
    with Feeder(Sharded(blobs, 5), 4, transforms(), shuffle_shards=2, **kw) as f:
        drain(f, limit=2)
        state = f.state_dict()
    for name in ("shuffle_window", "shuffle_shards", "max_image_size", "size_divisibility",
                 "group_by_aspect_ratio", "max_pixels", "shard_layout"):
        assert name in state["settings"], name
    for other, field, saved, mine in (
            (dict(), "shuffle_shards", "2", "None"),
            (dict(shuffle_shards=3), "shuffle_shards", "2", "3"),
            (dict(shuffle_window=7), "shuffle_window", "8192", "7"),
            (dict(shuffle_shards=2, cut=4), "shard_layout", "8 shards", "10 shards")):
        cut = other.pop("cut", 5)
        with Feeder(Sharded(blobs, cut), 4, transforms(), **kw, **other) as g:
            with pytest.raises(ValueError, match=f"cannot resume: {field} differs") as info:
                g.load_state_dict(state)
        assert saved in str(info.value) and mine in str(info.value)


@pytest.mark.parametrize("saved, mine", [
    (ops.RandomResizedCrop(32), ops.RandomResizedCrop(32, antialias=False)),
    (ops.Resize(32), ops.Resize(32, antialias=False)),
    (ops.RandomResize(32, 40), ops.RandomResize(32, 40, antialias=False)),
    (ops.ScaleJitter((32, 32)), ops.ScaleJitter((32, 32), antialias=False)),
    (ops.ScaleJitter((32, 32)), ops.ScaleJitter((32, 32), interpolation="nearest")),
    (ops.RandomShortestSize(32), ops.RandomShortestSize(32, antialias=False)),
    (ops.RandomShortestSize(32), ops.RandomShortestSize(32, interpolation="area")),
    (ops.RandomZoomOut(), ops.RandomZoomOut(mask_fill=0)),
    (ops.RandomResizedCrop(32), ops.RandomResizedCrop(32, ratio=(0.75, 1.3334))),
], ids=lambda t: type(t).__name__)
def test_a_resume_with_another_transform_setting_is_refused(source, saved, mine):
    """The transforms are compared by their reprs: a repr that leaves out a
    setting lets a resumed run change its pixels unnoticed."""
    assert repr(saved) != repr(mine)
    kw = dict(seed=1, decode_threads=1, augment_threads=0)
    if not isinstance(saved, ops.RandomResizedCrop):  # the others' sizes vary
        kw["max_image_size"] = (640, 640)
    with Feeder(source, 4, [saved], **kw) as f:
        drain(f, limit=2)
        state = f.state_dict()
    with Feeder(source, 4, [mine], **kw) as g:
        with pytest.raises(ValueError, match="cannot resume: transforms differ"):
            g.load_state_dict(state)


def test_a_state_of_the_previous_version_loads_with_absent_settings_as_defaults(source):
    """States saved before every setting was recorded lack those left at their
    default: they load as before; a setting this feeder does not know is refused."""
    first, state = interrupted(source, 2)
    old = dict(state["settings"])
    for name in ("shuffle_window", "shuffle_shards", "max_image_size", "size_divisibility",
                 "group_by_aspect_ratio", "max_pixels", "shard_layout"):
        del old[name]
    with make(source) as f:
        f.load_state_dict({**state, "settings": old})
        rest, = epochs(f, 1)
    with make(source) as f:
        whole, = epochs(f, 1)
    assert_same(first + rest, whole)
    refused(source, {**state, "settings": {**state["settings"], "sort_by": 1}},
            r"state\['settings'\] holds 'sort_by'")
    refused(source, {**state, "settings": {**old, "max_image_size": (40, 40)}},
            r"max_image_size differs \(saved \(40, 40\), this feeder None\)")
    # max_pixels decides which samples fail, so which come under on_error="skip".
    refused(source, {**state, "settings": {**old, "max_pixels": 1000}},
            r"max_pixels differs \(saved 1000, this feeder \d+\)")


@pytest.mark.parametrize("epoch", [2**64, 2**64 + 1, -1, 1.0, True, "3", None])
def test_set_epoch_refuses_epochs_outside_the_keyed_range(source, epoch):
    with make(source) as f:
        with pytest.raises(ValueError, match=r"epoch must be an int in \[0, 2\*\*64\)"):
            f.set_epoch(epoch)


def test_the_epoch_after_the_last_is_refused_not_wrapped(source):
    with make(source) as f:
        f.set_epoch(2**64 - 1)
        last, = epochs(f, 1)
        # The epoch after the last would repeat epoch 0: the next pass refuses to start.
        _, err = drain(f)
        assert isinstance(err, ValueError) and "past the last epoch" in str(err), err
        with pytest.raises(ValueError, match="past the last epoch"):
            list(f.sampler)
        f.set_epoch(0)
        zero, = epochs(f, 1)
    assert labels_of(last) != labels_of(zero)


def test_states_with_epochs_outside_the_keyed_range_are_refused(source):
    _, state = interrupted(source, 1)
    refused(source, {**state, "epoch": 2**64}, r"state\['epoch'\] must be an int >= 0 and <= 2\*\*64 - 1")
    refused(source, {**state, "next_epoch": 2**64 + 1}, r"state\['next_epoch'\]")
