"""feeder.Mixture: weighted mixtures of sources, their epoch orders (exact
proportions, per-source passes) and a feeder over them (ranks, grouping, resume,
the isolated engine)."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

import feeder
from tests.support import JOIN_TIMEOUT_S, MemorySource, collect, collected, encode_jpeg
from feeder import Feeder, Mixture, ops
from feeder.order.mixture import Interleave, apportion
from feeder.order.plan import EpochPlan, OrderOptions
from feeder.synthetic import make_image


class Length:
    """``n`` samples; ``read`` gives an (image, label) pair without pixels to decode."""

    def __init__(self, n: int, sizes: np.ndarray | None = None) -> None:
        self.n, self.sizes = n, sizes

    def __len__(self) -> int:
        return self.n

    def read(self, index: int):
        return b"", index

    def image_sizes(self):
        return self.sizes


class Fields:
    """Dict samples with the given field names (the image and label made up)."""

    def __init__(self, n: int, names: tuple[str, ...]) -> None:
        self.n, self.names = n, names

    def __len__(self) -> int:
        return self.n

    def read(self, index: int) -> dict:
        return {name: (b"" if name == "image" else index) for name in self.names}


BLOBS = [encode_jpeg(make_image(40 + i % 3 * 8, 48 + i % 5 * 4, seed=i)) for i in range(40)]


def sources(*lengths: int, start: int = 0) -> list[MemorySource]:
    """Memory sources of JPEGs whose labels are 1000 * source + index."""
    out = []
    for k, n in enumerate(lengths):
        out.append(MemorySource(BLOBS[start:start + n], labels=[1000 * k + i for i in range(n)]))
        start += n
    return out


def depth_bound(counts, k) -> float:
    depth = math.ceil(math.log2(len(counts))) if len(counts) > 1 else 0
    return 1 + depth * (1 + 1 / counts[k]) / 2


# -- construction -----------------------------------------------------------------------------

@pytest.mark.parametrize("weights,error,match", [
    ([1.0], ValueError, "1 weights for 2 sources"),
    ([1.0, 0.0], ValueError, "'source 1' must be positive"),
    ([1.0, -2], ValueError, "'source 1' must be positive"),
    ([1.0, float("nan")], ValueError, "positive and finite"),
    ([float("inf"), 1.0], ValueError, "positive and finite"),
    ([True, 1.0], TypeError, "must be a number"),
    (["1", 1.0], TypeError, "must be a number"),
    ("11", TypeError, "weights must be a list"),
])
def test_bad_weights_fail_at_construction(weights, error, match):
    with pytest.raises(error, match=match):
        Mixture([Length(5), Length(7)], weights)


def test_bad_options_fail_at_construction():
    with pytest.raises(ValueError, match=r"samples_per_epoch=0 must be in \[1, 2\^62\]"):
        Mixture([Length(5), Length(7)], samples_per_epoch=0)
    with pytest.raises(TypeError, match="samples_per_epoch must be an int"):
        Mixture([Length(5), Length(7)], samples_per_epoch=12.0)
    with pytest.raises(ValueError, match="'source 1' .* is empty"):
        Mixture([Length(5), Length(0)])
    with pytest.raises(TypeError, match=r"sources\[1\] \(str\) is not a source"):
        Mixture([Length(5), "data/train"])
    with pytest.raises(ValueError, match="sources is empty"):
        Mixture([])
    with pytest.raises(ValueError, match="distinct"):
        Mixture([Length(5), Length(7)], names=["a", "a"])
    with pytest.raises(ValueError, match="'web' gets weight 1e-06, 0 of the 12"):
        Mixture([Length(5), Length(7)], [1, 1e-6], names=["curated", "web"])


def test_a_mixture_of_mixtures_is_refused_at_construction():
    """An inner mixture drawn as a plain source would lose its weights and never
    have its indices past len() read."""
    inner = Mixture([Length(3), Length(100)], [0.5, 0.5], samples_per_epoch=10)
    with pytest.raises(TypeError, match=r"sources\[0\] \(Mixture\) orders its own epochs"):
        Mixture([inner, Length(10)])


def test_weights_are_normalised_and_default_to_the_lengths():
    mix = Mixture([Length(30), Length(10)], [3, 1])
    assert mix.weights == (0.75, 0.25) and len(mix) == 40 and mix.counts == (30, 10)
    assert Mixture([Length(30), Length(10)]).weights == (0.75, 0.25)


def test_pairs_and_dicts_cannot_mix():
    with pytest.raises(ValueError, match="'web' .* gives \\(image, label\\) pairs but 'seg' "
                                         "\\(Fields\\) gives dicts of \\['image', 'mask'\\]"):
        Mixture([Length(5), Fields(5, ("image", "mask"))], names=["web", "seg"])


def test_dicts_of_other_fields_cannot_mix():
    with pytest.raises(ValueError, match="'source 1' \\(Fields\\) gives the fields \\['boxes', 'image'\\] "
                                         ".*missing \\['mask'\\], extra \\['boxes'\\]"):
        Mixture([Fields(5, ("image", "mask")), Fields(5, ("image", "boxes"))])
    Mixture([Fields(5, ("image", "mask")), Fields(3, ("mask", "image"))])  # the same fields


def test_shard_shuffle_is_refused_at_construction():
    with pytest.raises(ValueError, match="shuffle='shards' does not apply to a Mixture"):
        Feeder(Mixture(sources(4, 4)), batch_size=2, transforms=[ops.Resize((8, 8))], shuffle="shards")


# -- the index space --------------------------------------------------------------------------

def test_indices_reads_and_descriptions_go_to_the_source():
    a, b = sources(3, 5)
    mix = Mixture([a, b], names=["curated", "web"])
    assert [mix.locate(i) for i in (0, 2, 3, 7)] == [(0, 0), (0, 2), (1, 0), (1, 4)]
    assert mix.read(4) == b.read(1)
    assert mix.describe(4) == "web: mem://1"
    assert mix.source_of([7, 0, 3]).tolist() == [1, 0, 1]
    with pytest.raises(IndexError, match="out of range: the sources hold 8"):
        mix.read(8)


def test_image_sizes_come_from_the_sources_when_all_give_them():
    sa, sb = np.array([[10, 20]] * 3), np.array([[30, 40]] * 2)
    mix = Mixture([Length(3, sa), Length(2, sb)], samples_per_epoch=6)
    assert mix.image_sizes().tolist() == [[10, 20]] * 3 + [[30, 40]] * 2  # by index
    assert Mixture([Length(3, sa), Length(2)]).image_sizes() is None


def test_a_mixture_pickles():
    mix = pickle.loads(pickle.dumps(Mixture(sources(3, 5), [1, 2])))
    assert mix.weights == pytest.approx((1 / 3, 2 / 3))
    assert mix.epoch_order(1, 2, True)[:] == Mixture(sources(3, 5), [1, 2]).epoch_order(1, 2, True)[:]


# -- proportions ------------------------------------------------------------------------------

def test_apportion_is_the_largest_remainder():
    from fractions import Fraction as F
    assert apportion([F(1, 3)] * 3, 10) == [4, 3, 3]
    assert apportion([F(1, 2), F(1, 4), F(1, 4)], 9) == [5, 2, 2]


@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_every_prefix_holds_the_proportions(k):
    rng = np.random.default_rng(k)
    for trial in range(25):
        raw = rng.uniform(0.1, 1.0, k) ** 2  # skewed weights too
        lengths = rng.integers(100, 400, k).tolist()
        n = int(rng.integers(sum(lengths), 3 * sum(lengths) + 2))
        mix = Mixture([Length(m) for m in lengths], raw.tolist(), samples_per_epoch=n)
        w = np.asarray(mix.weights)
        assert np.all(np.abs(np.asarray(mix.counts) - w * n) < 1)
        source, _ = Interleave(mix.counts)(np.arange(n))
        drawn = np.cumsum(np.eye(k, dtype=np.int64)[source], axis=0)  # [n, k] counts per prefix
        dev = np.abs(drawn - np.outer(np.arange(1, n + 1), w))
        for s in range(k):
            assert dev[:, s].max() < depth_bound(mix.counts, s), (trial, s, raw, n)
        # a contiguous share (a rank's) within twice that
        a, b = n // 3, 2 * n // 3
        share = drawn[b - 1] - drawn[a - 1]
        assert np.all(np.abs(share - w * (b - a)) < 2 * max(depth_bound(mix.counts, s) for s in range(k)))


def test_the_proportions_hold_in_every_epoch_and_seed():
    mix = Mixture([Length(7), Length(50), Length(13)], [0.2, 0.5, 0.3])
    for seed in range(3):
        for epoch in range(4):
            order = np.asarray(mix.epoch_order(seed, epoch, True)[:])
            assert np.bincount(mix.source_of(order), minlength=3).tolist() == list(mix.counts)


# -- per-source passes ------------------------------------------------------------------------

@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("per_epoch", [80, 30])
def test_each_source_draws_every_sample_once_per_pass(shuffle, per_epoch):
    lengths = [7, 50, 13]
    mix = Mixture([Length(m) for m in lengths], [0.2, 0.5, 0.3], samples_per_epoch=per_epoch)
    draws: list[list[int]] = [[], [], []]
    for epoch in range(6 * 80 // per_epoch):
        order = np.asarray(mix.epoch_order(3, epoch, shuffle)[:])
        for k in range(3):
            mine = order[mix.source_of(order) == k] - mix.offsets[k]
            draws[k].extend(mine.tolist())
    for k, m in enumerate(lengths):
        passes = [draws[k][p:p + m] for p in range(0, len(draws[k]) - m + 1, m)]
        assert len(passes) >= 2
        for p in passes:  # every whole pass: each sample once
            assert sorted(p) == list(range(m))
        if shuffle:
            assert passes[0] != passes[1]  # a fresh permutation per pass
        else:
            assert passes[0] == list(range(m))
    # the large source streams on: epoch 1 continues its pass where epoch 0 stopped
    assert mix.counts[1] < lengths[1] * 2


def test_the_order_is_a_function_of_seed_and_epoch():
    mix = Mixture([Length(20), Length(30)], [1, 3])
    assert mix.epoch_order(1, 2, True)[:] == mix.epoch_order(1, 2, True)[:]
    assert mix.epoch_order(1, 2, True)[:] != mix.epoch_order(2, 2, True)[:]
    assert mix.epoch_order(1, 2, True)[:] != mix.epoch_order(1, 3, True)[:]


def test_a_billion_sample_mixture_takes_any_slice_lazily():
    mix = Mixture([Length(10 ** 9), Length(10 ** 6), Length(12345)], [0.6, 0.3, 0.1])
    order = mix.epoch_order(0, 5, True)
    mid = len(order) // 2
    got = order.take(mid, mid + 4096)
    assert len(got) == 4096 and len(np.unique(got)) == 4096
    counts = np.bincount(mix.source_of(got), minlength=3)
    assert np.all(np.abs(counts - 4096 * np.asarray(mix.weights)) < 2 * 3)


# -- the epoch plan ---------------------------------------------------------------------------

@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_take_disjoint_contiguous_shares(drop_last):
    mix = Mixture([Length(40), Length(63)], [1, 1])
    plan = EpochPlan(mix, OrderOptions(batch_size=4, drop_last=drop_last))
    whole = mix.epoch_order(7, 1, True)[:]
    orders = [plan.order(1, rank, 3, seed=7)[:] for rank in range(3)]
    if drop_last:
        assert {len(o) for o in orders} == {len(mix) // 3 // 4 * 4}
        assert orders == [whole[r * 34:r * 34 + len(orders[0])] for r in range(3)]
    else:
        assert [i for o in orders for i in o] == whole


def feeder_over(mix, **kw) -> Feeder:
    kw.setdefault("seed", 5)
    kw.setdefault("shuffle", True)
    kw.setdefault("decode_threads", 2)
    kw.setdefault("timeout", JOIN_TIMEOUT_S)
    return Feeder(mix, kw.pop("batch_size", 4), [ops.Resize((24, 24))], **kw)


def test_a_feeder_delivers_the_plan_and_names_the_sources():
    mix = Mixture(sources(6, 14), [0.5, 0.5])
    with feeder_over(mix) as f:
        assert len(f) == 5
        got = collected(f, keep=lambda b: (b[1].tolist(), f.last_batch.sources.tolist()))
    labels = [lab for y, _ in got for lab in y]
    origins = [k for _, s in got for k in s]
    assert origins == [lab // 1000 for lab in labels]
    assert np.bincount(origins).tolist() == [10, 10]
    small = [lab for lab in labels if lab < 1000]  # a pass of 6, then 4 of the next
    assert sorted(small[:6]) == list(range(6)) and len(set(small[6:])) == 4


@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_in_a_feeder(rank):
    mix = Mixture(sources(6, 18), [1, 2])
    with feeder_over(mix, rank=rank, world_size=2) as f:
        got = [lab for _, y in collected(f) for lab in y.tolist()]
        assert len(got) == len(f) * 4 == 12
    assert sum(lab < 1000 for lab in got) == 4  # a third of each rank's share


def test_grouping_delivers_the_same_samples():
    mix = Mixture(sources(12, 20), [1, 1])
    plain = feeder_over(mix, shuffle=True)
    with plain:
        want = sorted(lab for _, y in collected(plain) for lab in y.tolist())
    grouped = feeder_over(mix, group_by_aspect_ratio=0, drop_last=False)
    with grouped:
        got = sorted(lab for _, y in collected(grouped) for lab in y.tolist())
    assert got == want


def test_resume_delivers_exactly_the_rest():
    mix = Mixture(sources(6, 20), [0.4, 0.6])
    with feeder_over(mix) as f:
        reference = [y.tolist() for _, y in collected(f)]
    with feeder_over(mix) as f:
        first, err = collect(f, limit=2)
        assert err is None
        state = f.state_dict()
    with feeder_over(Mixture(sources(6, 20), [0.4, 0.6])) as f:
        f.load_state_dict(pickle.loads(pickle.dumps(state)))
        rest = [y.tolist() for _, y in collected(f)]
    assert [y.tolist() for _, y in first] + rest == reference


@pytest.mark.parametrize("weights, sizes, what", [([0.6, 0.4], (6, 20), r"\(16, 10\)"),
                                                  ([0.4, 0.6], (7, 20), r"\(7, 20\)"),
                                                  ([0.6, 0.4], (20, 6), r"\(20, 6\)")])
def test_resume_refuses_the_state_of_a_mixture_built_otherwise(weights, sizes, what):
    """Other weights, another source length or the sources in another order give
    another epoch order: resuming on it would repeat and lose samples."""
    with feeder_over(Mixture(sources(6, 20), [0.4, 0.6], samples_per_epoch=26)) as f:
        _, err = collect(f, limit=2)
        assert err is None
        state = f.state_dict()
    with feeder_over(Mixture(sources(*sizes), weights, samples_per_epoch=26)) as f:
        with pytest.raises(ValueError, match=f"cannot resume: source_order differs .*{what}"):
            f.load_state_dict(state)


@pytest.mark.parametrize("start_method", ["spawn"])
def test_the_isolated_engine_delivers_the_same_batches(start_method):
    mix = Mixture(sources(6, 10), [1, 1])
    with feeder_over(mix) as f:
        want = [(x.numpy().copy(), y.tolist()) for x, y in collected(f)]
    with feeder_over(mix, isolation="process", start_method=start_method) as f:
        got = [(x.numpy().copy(), y.tolist()) for x, y in collected(f)]
        assert f.last_batch.sources.tolist() == [lab // 1000 for lab in got[-1][1]]
    assert [y for _, y in got] == [y for _, y in want]
    for (x, _), (wx, _) in zip(got, want):
        np.testing.assert_array_equal(x, wx)


@pytest.mark.parametrize("ordered", [True, False])
def test_resume_with_samples_drawn_twice_in_an_epoch(ordered):
    # 3 samples drawn 12 times an epoch: batches repeat samples, within and across them
    mix = Mixture(sources(3, 21), [0.5, 0.5])
    with feeder_over(mix, ordered=ordered) as f:
        reference = [y.tolist() for _, y in collected(f)]
    with feeder_over(mix, ordered=ordered) as f:
        first, err = collect(f, limit=3)
        assert err is None
        state = f.state_dict()
    with feeder_over(Mixture(sources(3, 21), [0.5, 0.5]), ordered=ordered) as f:
        f.load_state_dict(state)
        rest = [y.tolist() for _, y in collected(f)]
    got = [y.tolist() for _, y in first] + rest
    if ordered:
        assert got == reference
    assert sorted(sum(got, [])) == sorted(sum(reference, []))
    assert sorted(sum(got, [])).count(0) == 4  # each small sample 4 times: 4 passes of 3


def test_resume_with_bad_samples_drawn_twice_loads_at_every_batch():
    # Source 0's 7 samples are drawn 10 times an epoch, two of them corrupt: each
    # of those is skipped twice, so a state's skipped draws outnumber its skipped
    # samples. Every mid-epoch state must load and deliver exactly the rest.
    def mix():
        blobs = list(BLOBS[:7])
        blobs[1] = blobs[4] = b"\xff\xd8 not a JPEG"
        return Mixture([MemorySource(blobs, labels=list(range(7))),
                        MemorySource(BLOBS[7:20], labels=[1000 + i for i in range(13)])],
                       weights=[0.5, 0.5])

    with feeder_over(mix(), on_error="skip") as f:
        reference = [y.tolist() for _, y in collected(f)]
    # 20 draws, the 4 of samples 1 and 4 skipped
    assert len(sum(reference, [])) == 16 and not {1, 4} & set(sum(reference, []))
    for k in range(1, len(reference)):
        with feeder_over(mix(), on_error="skip") as f:
            first, err = collect(f, limit=k)
            assert err is None
            state = f.state_dict()
        with feeder_over(mix(), on_error="skip") as f:
            f.load_state_dict(state)
            rest = [y.tolist() for _, y in collected(f)]
        got = [y.tolist() for _, y in first] + rest
        assert sorted(sum(got, [])) == sorted(sum(reference, [])), k


class Unreadable(Length):
    def read(self, index: int):
        raise AssertionError(f"read({index}): the sizes are given")


def test_grouping_takes_the_sources_sizes_without_reading():
    tall, wide = np.array([[40, 20]] * 12), np.array([[20, 40]] * 20)
    mix = Mixture([Length(12, tall), Length(20, wide)])
    mix.sources = (Unreadable(12, tall), Unreadable(20, wide))  # built: now refuse every read
    plan = EpochPlan(mix, OrderOptions(batch_size=4, group_by_aspect_ratio=0))
    order = plan.order(0, 0, 1, seed=3)[:]
    assert sorted(order) == sorted(mix.epoch_order(3, 0, True)[:])
    for b in range(0, len(order), 4):  # every batch one shape
        assert len({int(i) < 12 for i in order[b:b + 4]}) == 1


class Arrays:
    """Decoded images (uint8 HWC arrays), labels 2000 + index."""

    def __len__(self) -> int:
        return 10

    def read(self, index: int):
        return np.full((30, 20, 3), index, np.uint8), 2000 + index


def test_shards_files_and_decoded_arrays_mix(packed, image_folder):
    folder, _ = packed
    shards = feeder.TarShards(f"{folder}/*.tar")
    mix = Mixture([shards, feeder.ImageFolder(image_folder), Arrays()], [0.5, 0.3, 0.2],
                  names=["shards", "folder", "arrays"])
    assert "shards: " in mix.describe(0) and mix.describe(len(shards)).startswith("folder: ")
    with feeder_over(mix, batch_size=5) as f:
        got = collected(f, keep=lambda b: (b[1].tolist(), f.last_batch.sources.tolist()))
    origins = np.array([k for _, s in got for k in s])
    labels = [lab for y, _ in got for lab in y]
    assert np.bincount(origins, minlength=3).tolist() == list(mix.counts)
    arrays = [lab for lab, k in zip(labels, origins) if k == 2]  # in delivery order
    assert sorted(arrays[:10]) == list(range(2000, 2010))  # its first pass: each once
    assert len(set(arrays[10:])) == len(arrays[10:])  # then into its second
    shard_labels = [lab for lab, k in zip(labels, origins) if k == 0]
    assert len(set(shard_labels)) == len(shard_labels)  # 0.5 of the positions: under one pass


def test_epochs_past_int64_products_deal_the_same(monkeypatch):
    import feeder.order.mixture as mixture_mod

    counts = [123_457, 98_765, 4_321]
    positions = np.arange(0, sum(counts), 997)
    want = Interleave(counts)(positions)
    monkeypatch.setattr(mixture_mod, "_INT64_EPOCH", 1000)  # Python integers from here
    got = Interleave(counts)(positions)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    huge = Interleave([4 * 10 ** 9, 10 ** 9])  # 5e9 positions: i * c overflows int64
    source, draw = huge(np.array([5 * 10 ** 9 - 1, 2_500_000_000]))
    # floor((i * 4e9 + 2.5e9) / 5e9) of the first i positions go to source 0
    assert source.tolist() == [0, 0] and draw.tolist() == [4 * 10 ** 9 - 1, 2 * 10 ** 9]


def test_a_single_source_is_that_source_in_its_passes():
    mix = Mixture([Length(9)], samples_per_epoch=20)
    order = mix.epoch_order(0, 0, True)[:]
    assert sorted(order[:9]) == list(range(9)) and sorted(order[9:18]) == list(range(9))


class Later(Fields):
    """Dict samples whose reads fail until ``ready`` (storage mounted after the mixture was built)."""

    ready = False

    def read(self, index: int) -> dict:
        if not self.ready:
            raise OSError("not mounted yet")
        return {"image": BLOBS[index], "label": index}

    def describe(self, index: int) -> str:
        return f"later://{index}"


def test_pairs_and_dicts_unknown_at_construction_fail_at_the_first_batch():
    later = Later(4, ("image", "label"))
    mix = Mixture([MemorySource(BLOBS[:4]), later], names=["pairs", "dicts"])
    later.ready = True
    with feeder_over(mix, shuffle=False) as f:
        _, err = collect(f)
    assert isinstance(err, feeder.SampleError)
    # whichever sample a read thread fixed the batch's kind with, both are named
    text = str(err)
    assert ("sample 4 (dicts: later://0)" in text and "sample 4 is a dict but sample 0 was not" in text
            or "sample 0 (pairs: mem://0)" in text and "sample 0 is a (bytes, label) pair but sample 4"
            in text), text


def test_epochs_shorter_than_the_sources():
    mix = Mixture(sources(6, 30), [0.5, 0.5], samples_per_epoch=16)
    assert mix.index_count == 36 and len(mix) == 16
    seen = []
    with feeder_over(mix) as f:
        for epoch in range(4):
            f.set_epoch(epoch)
            seen.append([lab for _, y in collected(f) for lab in y.tolist()])
    web = [lab for epoch in seen for lab in epoch if lab >= 1000]
    assert len(web) == 32 and len(set(web[:30])) == 30  # a pass of 30 across four epochs
    with feeder_over(mix) as f:  # resume in the middle of epoch 2
        f.set_epoch(2)
        first, err = collect(f, limit=2)
        assert err is None
        state = f.state_dict()
    with feeder_over(Mixture(sources(6, 30), [0.5, 0.5], samples_per_epoch=16)) as f:
        f.load_state_dict(state)
        rest = [lab for _, y in collected(f) for lab in y.tolist()]
    assert [lab for _, y in first for lab in y.tolist()] + rest == seen[2]
    with pytest.raises(ValueError, match="on_error='skip' needs every sample index below"):
        feeder_over(mix, on_error="skip")


def test_grouping_epochs_shorter_than_the_sources():
    tall, wide = np.array([[40, 20]] * 12), np.array([[20, 40]] * 20)
    mix = Mixture([Unreadable(12, tall), Unreadable(20, wide)], samples_per_epoch=16)
    plan = EpochPlan(mix, OrderOptions(batch_size=4, group_by_aspect_ratio=0))
    order = plan.order(1, 0, 1, seed=3)[:]
    assert sorted(order) == sorted(mix.epoch_order(3, 1, True)[:])
    assert max(order) >= 16  # indices past len(mix): the sizes cover them


class Hinted(Length):
    def __init__(self, n: int, blocks: bool | None) -> None:
        super().__init__(n)
        self.reads_may_block, self.hints = blocks, []

    def will_read(self, indices):
        self.hints.append(list(indices))

    def oriented_image_sizes(self):
        return np.full((self.n, 2), 7)


def test_hints_and_read_modes_go_to_the_sources():
    a, b = Hinted(3, False), Hinted(4, True)
    mix = Mixture([a, b])
    assert mix.reads_may_block is True
    assert Mixture([Hinted(3, False), Hinted(4, False)]).reads_may_block is False
    assert Mixture([Hinted(3, False), Hinted(4, None)]).reads_may_block is None
    mix.will_read([4, 0, 6, 2])
    assert a.hints == [[0, 2]] and b.hints == [[1, 3]]
    assert mix.oriented_image_sizes().shape == (7, 2) and mix.image_sizes() is None
