"""Aspect-ratio grouping (``group_by_aspect_ratio``): batches of one aspect-ratio
group as torchvision's GroupedBatchSampler makes them, every sample exactly once,
deterministic in (seed, epoch), rank-sharded, resumable; sizes read from the
image headers once per source (or from ``source.image_sizes()``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, collect as collect_pass, collected
from feeder import Feeder
from feeder.decode import header_size
from feeder.order.group import group_ids, grouped_order
from tests.support.fields import rgb_png
from tests.engine.test_variable_size import Sized, collect


def _mixed(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """Landscape and portrait images, mixed at random."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        short, long = int(rng.integers(12, 20)), int(rng.integers(24, 36))
        out.append((short, long) if rng.random() < 0.5 else (long, short))
    return out


@pytest.fixture(scope="module")
def mixed():
    return Sized(_mixed(50))


def _portrait(source: Sized, index: int) -> bool:
    h, w = source.images[index].shape[:2]
    return h > w


def test_grouped_order_is_a_permutation_in_batches_of_one_group():
    rng = np.random.default_rng(1)
    groups = rng.integers(0, 3, 101)
    order = rng.permutation(101).tolist()
    out = grouped_order(order, groups, 4)
    assert sorted(out) == list(range(101))
    batches = [out[i:i + 4] for i in range(0, len(out), 4)]
    mixed = [b for b in batches if len({int(groups[i]) for i in b}) > 1]
    # Only the leftovers (fewer than batch_size per group) can share a batch.
    assert len(mixed) <= 2
    assert all(b in batches[-3:] for b in mixed)
    # The order within a group is the order walked (GroupedBatchSampler).
    for g in range(3):
        assert [i for i in out if groups[i] == g] == [i for i in order if groups[i] == g]


def test_group_ids_follow_torchvision_bins():
    sizes = np.array([[100, 50], [100, 100], [50, 100], [100, 300], [-1, -1]])
    # factor 0: one bin at 1 (portrait 0, square and landscape 1).
    assert group_ids(sizes, 0).tolist() == [0, 1, 1, 1, -1]
    # factor 1: bins 0.5, 1, 2 (bisect_right): w/h 0.5 -> 1, 1.0 -> 2, 2.0 and 3.0 -> 3.
    assert group_ids(sizes, 1).tolist() == [1, 2, 3, 3, -1]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_batches_hold_one_orientation_and_every_sample_once(mixed, isolation):
    with Feeder(mixed, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=0, seed=2,
                isolation=isolation) as f:
        batches = collect(f)
    got = [i for b in batches for i in b["label"].tolist()]
    assert sorted(got) == list(range(len(mixed)))
    uniform = [len({_portrait(mixed, i) for i in b["label"].tolist()}) == 1 for b in batches]
    assert all(uniform[:-2]), uniform  # the last two batches take the leftovers


class _Decoded:
    """``mixed``'s images given decoded, as numpy arrays or CHW tensors."""

    def __init__(self, sized: Sized, tensors: bool) -> None:
        self.images = sized.images
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.images)

    def read(self, index: int):
        img = self.images[index]
        return (torch.from_numpy(img).permute(2, 0, 1) if self.tensors else img), index


@pytest.mark.parametrize("tensors", [False, True], ids=["numpy", "torch"])
def test_decoded_images_are_grouped_as_their_files(mixed, tensors):
    def batches(source):
        with Feeder(source, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=0, seed=2) as f:
            return collect(f)
    got, want = batches(_Decoded(mixed, tensors)), batches(mixed)
    assert [b["label"].tolist() for b in got] == [b["label"].tolist() for b in want]
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(got, want))


def test_grouping_saves_padding_against_random_batches(mixed):
    def padded(group):
        with Feeder(mixed, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=group,
                    seed=2) as f:
            total = 0
            for b in collect(f):
                hw = b["size"]
                total += b["image"].shape[2] * b["image"].shape[3] * len(hw) - int((hw[:, 0] * hw[:, 1]).sum())
            return total
    assert padded(0) * 2 <= padded(False)


# Grouping by aspect ratio alone (no transforms), and by planned size under jitter.
@pytest.mark.parametrize("data, jitter, side", [("mixed", False, 40), ("many", True, 48)])
def test_order_is_deterministic_in_seed_and_epoch(request, data, jitter, side):
    source = request.getfixturevalue(data)

    def labels(seed, epoch):
        with Feeder(source, 4, _jitter() if jitter else [], max_image_size=(side, side),
                    group_by_aspect_ratio=True, shuffle=True, seed=seed) as f:
            f.set_epoch(epoch)
            return [b["label"].tolist() for b in collect(f)]
    first = labels(7, 0)
    assert labels(7, 0) == first
    assert labels(7, 1) != first
    assert labels(8, 0) != first


def test_a_pass_plans_its_grouped_order_once(many, monkeypatch):
    # The pass and the progress bookkeeping both need the grouped order; the
    # planned sizes behind it are computed once per pass, again for a new epoch.
    from feeder.engine import group

    calls = []
    plan = group.group_pass_order
    monkeypatch.setattr(group, "group_pass_order", lambda *a, **k: (calls.append(1), plan(*a, **k))[1])
    with Feeder(many, 4, _jitter(), max_image_size=(48, 48), group_by_aspect_ratio=True,
                shuffle=True, seed=2) as f:
        first = [b["label"].tolist() for b in collect(f, limit=2)]
        f.state_dict()  # a mid-pass state counts positions along that order
        assert len(calls) == 1
        f.set_epoch(1)
        second = [b["label"].tolist() for b in collect(f, limit=2)]
        f.state_dict()
        assert len(calls) == 2 and first != second
def test_ranks_get_disjoint_grouped_shards(mixed):
    seen = []
    for rank in range(2):
        with Feeder(mixed, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=0, seed=3,
                    rank=rank, world_size=2) as f:
            batches = collect(f)
        labels = [i for b in batches for i in b["label"].tolist()]
        assert len(labels) == f.num_samples
        seen.extend(labels)
        uniform = [len({_portrait(mixed, i) for i in b["label"].tolist()}) == 1 for b in batches]
        assert all(uniform[:-2])
    assert sorted(seen) == list(range(len(mixed)))


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_resume_mid_epoch_continues_the_grouped_order(mixed, isolation):
    kw = dict(max_image_size=(40, 40), group_by_aspect_ratio=True, seed=4, isolation=isolation)
    with Feeder(mixed, 4, [], **kw) as f:
        reference = [b["label"].tolist() for b in collect(f)]
    with Feeder(mixed, 4, [], **kw) as f:
        first = [b["label"].tolist() for b in collect(f, limit=5)]
        state = f.state_dict()
    assert first == reference[:5]
    with Feeder(mixed, 4, [], **kw) as g:
        g.load_state_dict(state)
        rest = [b["label"].tolist() for b in collect(g)]
    assert rest == reference[5:]


def test_grouping_setting_is_checked_on_resume(mixed):
    with Feeder(mixed, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=True, seed=0) as f:
        state = f.state_dict()
    with Feeder(mixed, 4, [], max_image_size=(40, 40), seed=0) as g:
        with pytest.raises(ValueError, match="group_by_aspect_ratio"):
            g.load_state_dict(state)


def test_headers_are_read_once_per_source():
    source = Sized(_mixed(20, seed=5))
    with Feeder(source, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=True) as f:
        collect(f)
        assert source.reads == 40  # the headers, then the samples
        collect(f)
        assert source.reads == 60  # the samples only
    with Feeder(source, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=True) as g:
        collect(g)
        assert source.reads == 80  # another feeder on the same source reuses them


def test_sizes_from_the_source_are_used_without_reading_headers():
    source = Sized(_mixed(20, seed=6))
    source.image_sizes = lambda: [img.shape[:2] for img in source.images]
    with Feeder(source, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=0, seed=1) as f:
        batches = collect(f)
    assert source.reads == 20
    uniform = [len({_portrait(source, i) for i in b["label"].tolist()}) == 1 for b in batches]
    assert all(uniform[:-2])


def test_wrong_sizes_from_the_source_are_an_error():
    source = Sized(_mixed(6, seed=6))
    source.image_sizes = lambda: [(10, 10)] * 5
    with Feeder(source, 2, [], max_image_size=(40, 40), group_by_aspect_ratio=True) as f:
        with pytest.raises(Exception, match=r"image_sizes\(\) must give \(height, width\) for each of its 6"):
            collect(f)


def test_an_unreadable_header_fails_as_its_sample_does():
    source = Sized(_mixed(10, seed=7))
    source.blobs[4] = b"not an image"
    with Feeder(source, 2, [], max_image_size=(40, 40), group_by_aspect_ratio=True,
                on_error="skip", seed=0) as f:
        batches = collect(f)
        assert f.stats().skipped == 1
    assert sorted(i for b in batches for i in b["label"].tolist()) == [0, 1, 2, 3, 5, 6, 7, 8, 9]


def test_grouping_works_with_fixed_sizes_too(mixed):
    from feeder import ops
    with Feeder(mixed, 4, [ops.CenterCrop(8)], group_by_aspect_ratio=0, seed=0) as f:
        batches = list(f)
    labels = [i for _, lab in batches for i in lab.tolist()]
    assert sorted(labels) == list(range(len(mixed)))


def test_header_size_reads_jpeg_png_and_orientation():
    import simplejpeg
    img = np.zeros((12, 30, 3), np.uint8)
    assert header_size(rgb_png(img)) == (12, 30)
    assert header_size(simplejpeg.encode_jpeg(img)) == (12, 30)
    with pytest.raises(Exception, match="not a decodable image"):
        header_size(b"garbage-bytes-here")


@pytest.mark.parametrize("value, match", [(-1, "group factor"), (1.5, "group factor"),
                                          ("yes", "group factor")])
def test_bad_group_option_is_an_error(mixed, value, match):
    with pytest.raises(ValueError, match=match):
        Feeder(mixed, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=value)


# -- sizes stored by feeder-pack ------------------------------------------------------

def _folder(root, sizes):
    import os
    os.makedirs(root / "c0")
    for i, (h, w) in enumerate(sizes):
        (root / "c0" / f"{i:03d}.png").write_bytes(rgb_png(np.full((h, w, 3), 9, np.uint8)))


def test_pack_stores_image_sizes_and_grouping_reads_no_header(tmp_path, monkeypatch):
    import json
    from feeder.pack import pack, parse_size
    from feeder.shards import TarShards
    sizes = _mixed(24, seed=9)
    _folder(tmp_path / "src", sizes)
    res = pack(str(tmp_path / "src"), str(tmp_path / "out"), shard_size=parse_size("8KB"))
    assert len(res.shards) > 1
    # The sizes are in each shard's index, not in the shard list (which stays small).
    manifest = json.loads((tmp_path / "out" / "train.json").read_text())
    assert all("image_sizes" not in entry for entry in manifest["shardlist"])
    shards = TarShards(str(tmp_path / "out" / "train.json"))
    assert shards.image_sizes().tolist() == [list(s) for s in sizes]
    # Grouping takes them from the indices: no header is read.
    monkeypatch.setattr("feeder.order.group.header_size", lambda *a: pytest.fail("read a header"))
    with Feeder(shards, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=0, seed=0) as f:
        batches = list(f)
    portrait = [h > w for h, w in sizes]
    uniform = [len({portrait[i] for i in b["label"].tolist()}) == 1 for b in batches]
    assert all(uniform[:-2])
    # Lazily indexed: image_sizes() reads every index (once), the sizes the same.
    lazy = TarShards(str(tmp_path / "out" / "train.json"), lazy_index=True)
    assert lazy.indices_loaded == 1
    assert lazy.image_sizes().tolist() == [list(s) for s in sizes]
    # Indices without sizes (another tool's, or an older pack's): the sizes are unknown.
    for shard in res.shards:
        idx = shard[:-4] + ".idx"
        text = open(idx).read()
        open(idx, "w").write(text[:text.index("# image_sizes ")])
    old = TarShards(str(tmp_path / "out" / "train.json"))
    assert len(old) == len(sizes) and old.image_sizes() is None


def test_an_older_shard_list_with_image_sizes_still_gives_them(tmp_path, monkeypatch):
    """Lists written by feeder-pack before the sizes moved into the indices."""
    import json
    from feeder.storage.tar import ShardIndex, encode_image_sizes
    from feeder.pack import pack, parse_size
    from feeder.shards import TarShards
    sizes = _mixed(24, seed=12)
    _folder(tmp_path / "src", sizes)
    res = pack(str(tmp_path / "src"), str(tmp_path / "out"), shard_size=parse_size("8KB"))
    manifest = json.loads((tmp_path / "out" / "train.json").read_text())
    at = 0
    for shard, entry in zip(res.shards, manifest["shardlist"]):
        idx = shard[:-4] + ".idx"
        ix = ShardIndex.from_text(open(idx).read(), idx)
        ix.image_sizes = None  # the index of that version: no sizes line
        open(idx, "w").write(ix.to_text())
        entry["image_sizes"] = encode_image_sizes(sizes[at:at + entry["nsamples"]])
        at += entry["nsamples"]
    (tmp_path / "out" / "old.json").write_text(json.dumps(manifest))
    for lazy in (False, True):
        old = TarShards(str(tmp_path / "out" / "old.json"), lazy_index=lazy)
        monkeypatch.setattr("feeder.order.group.header_size", lambda *a: pytest.fail("read a header"))
        assert old.image_sizes().tolist() == [list(s) for s in sizes]
        if lazy:
            assert old.indices_loaded == 1  # from the list: no index read for them
        monkeypatch.undo()
    # Damaged sizes are refused, naming the shard.
    manifest["shardlist"][0]["image_sizes"] = "AAAA"
    (tmp_path / "out" / "bad.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="image_sizes is not base64"):
        TarShards(str(tmp_path / "out" / "bad.json"))


def test_damaged_sizes_in_an_index_name_the_file_and_line(tmp_path):
    from feeder.storage.tar import ShardFormatError, ShardIndex
    text = "v1.2 2\njpg 512 10 a.jpg\njpg 1536 10 b.jpg\n"
    assert ShardIndex.from_text(text, "s.idx").image_sizes is None
    good = ShardIndex.from_text(text + "# image_sizes AQAAAAIAAAADAAAABAAAAA==\n", "s.idx")
    assert good.image_sizes.tolist() == [[1, 2], [3, 4]]
    assert ShardIndex.from_text(good.to_text(), "t.idx").image_sizes.tolist() == [[1, 2], [3, 4]]
    with pytest.raises(ShardFormatError, match=r"s\.idx: line 4 \(image sizes\): .*2 samples"):
        ShardIndex.from_text(text + "# image_sizes AQAAAAIAAAA=\n", "s.idx")  # one pair for two
    with pytest.raises(ShardFormatError, match=r"s\.idx: line 1 announces 2 samples but the index has 3"):
        ShardIndex.from_text(text + "jpg 2560 10 c.jpg\n", "s.idx")
    # Other comment lines after the samples are skipped (a later version's).
    assert len(ShardIndex.from_text(text + "# something else\n", "s.idx")) == 2


def test_resumed_pack_stores_the_sizes_of_its_earlier_shards(tmp_path):
    import json
    import os
    from feeder.pack import pack, parse_size
    sizes = _mixed(24, seed=10)
    _folder(tmp_path / "src", sizes)
    ref = pack(str(tmp_path / "src"), str(tmp_path / "ref"), shard_size=parse_size("8KB"))
    out = tmp_path / "out"
    pack(str(tmp_path / "src"), str(out), shard_size=parse_size("8KB"))
    os.unlink(out / "train.json")
    os.unlink(ref.shards[-1].replace(str(tmp_path / "ref"), str(out)))  # the last shard redone
    res = pack(str(tmp_path / "src"), str(out), shard_size=parse_size("8KB"))
    assert res.resumed == len(ref.shards) - 1
    assert (json.loads((out / "train.json").read_text())["shardlist"]
            == json.loads((tmp_path / "ref" / "train.json").read_text())["shardlist"])


# -- grouping by planned size as well (variable sizes whose transforms can plan them) --

def _jitter():
    from feeder import ops
    # The shorter side drawn per image (detection's multi-scale training), longer capped.
    return [ops.RandomResize(8, 24, max_long=48), ops.RandomHorizontalFlip()]


def _unplanned():
    from feeder import ops

    class Unplanned(ops.Transform):
        """Keeps the image, but cannot say its output size before running."""

        def apply(self, img, rng, out=None, ctx=None):
            return img

    return Unplanned()


@pytest.fixture(scope="module")
def many():
    return Sized(_mixed(96, seed=11))


def _padded(batches) -> int:
    total = 0
    for b in batches:
        hw = b["size"]
        total += b["image"].shape[2] * b["image"].shape[3] * len(hw) - int((hw[:, 0] * hw[:, 1]).sum())
    return total


def test_grouped_order_by_area_sorts_each_window_of_a_group():
    rng = np.random.default_rng(3)
    groups = rng.integers(0, 2, 203)
    areas = rng.integers(1, 1000, 203)
    order = rng.permutation(203).tolist()
    out = grouped_order(order, groups, 4, areas, window=3)
    assert sorted(out) == list(range(203))
    assert grouped_order(order, groups, 4, areas, window=3) == out  # a pure function
    batches = [out[i:i + 4] for i in range(0, len(out), 4)]
    mixed = [k for k, b in enumerate(batches) if len({int(groups[i]) for i in b}) > 1]
    assert all(k >= len(batches) - 2 for k in mixed)  # only the leftovers share a batch
    position = {index: k for k, index in enumerate(order)}
    for g in range(2):
        walked = [i for i in order if groups[i] == g]
        # Each full window of 12 of the group is sorted by area, ties in walked order...
        for w in range(len(walked) // 12):
            window = walked[w * 12:(w + 1) * 12]
            ranked = sorted(window, key=lambda i: areas[i])
            cut = [ranked[k:k + 4] for k in range(0, 12, 4)]
            for batch in cut:
                assert batch in batches
            # ... and its batches come in the order of their earliest sample.
            got = sorted(cut, key=lambda b: batches.index(b))
            assert got == sorted(cut, key=lambda b: min(position[i] for i in b))
    # Batches of similar areas: a smaller spread than by aspect ratio alone.
    def spread(o):
        bs = [o[i:i + 4] for i in range(0, len(o) - 3, 4)]
        return np.mean([areas[b].max() - areas[b].min() for b in bs])
    assert spread(out) * 2 < spread(grouped_order(order, groups, 4))


def test_planned_sizes_are_the_delivered_sizes(many):
    from feeder.order.group import image_sizes, planned_sizes
    with Feeder(many, 4, _jitter(), max_image_size=(48, 48), group_by_aspect_ratio=0,
                shuffle=True, seed=5) as f:
        f.set_epoch(3)
        batches = collect(f)
        planned = planned_sizes(f.chain, image_sizes(many, range(len(many))), range(len(many)),
                                f.seed, 3)
    delivered = {int(i): tuple(s) for b in batches for i, s in zip(b["label"].tolist(), b["size"].tolist())}
    assert len(delivered) == len(many)
    assert all(tuple(planned[i]) == delivered[i] for i in range(len(many)))
    assert len(set(delivered.values())) > 10  # the sizes were drawn, not fixed


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_jittered_batches_hold_similar_sizes_every_sample_once(many, isolation):
    kw = dict(max_image_size=(48, 48), group_by_aspect_ratio=0, shuffle=True, seed=2)
    with Feeder(many, 4, _jitter(), isolation=isolation, **kw) as f:
        sized = collect(f)
    got = [i for b in sized for i in b["label"].tolist()]
    assert sorted(got) == list(range(len(many)))
    uniform = [len({_portrait(many, i) for i in b["label"].tolist()}) == 1 for b in sized]
    assert all(uniform[:-2]), uniform
    # A transform that cannot plan its size: the same output sizes grouped by aspect ratio alone.
    with Feeder(many, 4, [*_jitter(), _unplanned()], **kw) as f:
        aspect = collect(f)
    with Feeder(many, 4, _jitter(), max_image_size=(48, 48), shuffle=True, seed=2) as f:
        random = collect(f)
    assert sorted(i for b in aspect for i in b["label"].tolist()) == list(range(len(many)))
    # (On these 96 small images: about 1.9x less padding than by aspect alone.)
    assert _padded(sized) * 1.5 <= _padded(aspect) <= _padded(random), (
        _padded(sized), _padded(aspect), _padded(random))


def test_grouping_falls_back_to_aspect_ratio_alone_when_sizes_cannot_be_planned(many):
    # In the walked order (no shuffle), aspect-only grouping keeps each group's
    # samples in order (GroupedBatchSampler); the planned sizes reorder them.
    def walked(transforms, **kw):
        with Feeder(many, 4, transforms, group_by_aspect_ratio=0, shuffle=False, seed=0, **kw) as f:
            batches = collect(f) if kw else list(f)  # fixed sizes: (images, labels) pairs
            labels = [i for b in batches for i in (b["label"] if kw else b[1]).tolist()]
        assert sorted(labels) == list(range(len(many)))
        return [[i for i in labels if _portrait(many, i) == p] for p in (False, True)]

    def in_order(groups):
        return all(g == sorted(g) for g in groups)

    assert in_order(walked([*_jitter(), _unplanned()], max_image_size=(48, 48)))
    assert not in_order(walked(_jitter(), max_image_size=(48, 48)))
    from feeder import ops
    assert in_order(walked([ops.CenterCrop(8)]))  # one fixed size: nothing to sort by


def test_jittered_ranks_get_disjoint_grouped_shards(many):
    seen = []
    for rank in range(2):
        with Feeder(many, 4, _jitter(), max_image_size=(48, 48), group_by_aspect_ratio=0, seed=3,
                    shuffle=True, rank=rank, world_size=2) as f:
            labels = [i for b in collect(f) for i in b["label"].tolist()]
        assert len(labels) == f.num_samples
        seen.extend(labels)
    assert sorted(seen) == list(range(len(many)))


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_resume_mid_epoch_continues_the_size_grouped_order(many, isolation):
    kw = dict(max_image_size=(48, 48), group_by_aspect_ratio=True, seed=4, shuffle=True,
              isolation=isolation)
    with Feeder(many, 4, _jitter(), **kw) as f:
        f.set_epoch(1)
        reference = [b["label"].tolist() for b in collect(f)]
    with Feeder(many, 4, _jitter(), **kw) as f:
        f.set_epoch(1)
        first = [b["label"].tolist() for b in collect(f, limit=5)]
        state = f.state_dict()
    assert first == reference[:5]
    with Feeder(many, 4, _jitter(), **kw) as g:
        g.load_state_dict(state)
        rest = [b["label"].tolist() for b in collect(g)]
    assert rest == reference[5:]


def test_resuming_a_pack_of_an_earlier_version_adds_the_sizes_to_its_indices(tmp_path):
    import json
    import os
    from feeder.storage.tar import ShardIndex
    from feeder.pack import pack, parse_size
    from feeder.shards import TarShards
    sizes = _mixed(24, seed=13)
    _folder(tmp_path / "src", sizes)
    out = tmp_path / "out"
    res = pack(str(tmp_path / "src"), str(out), shard_size=parse_size("8KB"))
    os.unlink(out / "train.json")
    os.unlink(res.shards[-1])  # the last shard redone
    for shard in res.shards[:-1]:  # the earlier version's indices: no sizes line
        idx = shard[:-4] + ".idx"
        ix = ShardIndex.from_text(open(idx).read(), idx)
        ix.image_sizes = None
        open(idx, "w").write(ix.to_text())
    again = pack(str(tmp_path / "src"), str(out), shard_size=parse_size("8KB"))
    assert again.resumed == len(res.shards) - 1
    assert all("image_sizes" not in e
               for e in json.loads((out / "train.json").read_text())["shardlist"])
    assert TarShards(str(out / "train.json")).image_sizes().tolist() == [list(s) for s in sizes]


# -- sizes as decoded: EXIF orientation, caches keyed by it, no transient failure kept --

def _exif_jpeg(h: int, w: int, orientation: int, value: int) -> bytes:
    """A JPEG stored ``h`` x ``w`` whose EXIF orientation is ``orientation``."""
    import io
    from PIL import Image
    img = Image.fromarray(np.full((h, w, 3), value, np.uint8))
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif.tobytes(), quality=90)
    return buf.getvalue()


def _rotated_photos(n: int, seed: int = 0) -> tuple[list[bytes], list[bool]]:
    """Photos all stored landscape; about half carry EXIF orientation 6 or 8 (a
    portrait photo as cameras store it). Returns the JPEGs and which are portrait
    once oriented."""
    rng = np.random.default_rng(seed)
    blobs, portrait = [], []
    for i in range(n):
        h, w = int(rng.integers(16, 24)), int(rng.integers(32, 40))
        turned = bool(rng.random() < 0.5)
        blobs.append(_exif_jpeg(h, w, int(rng.choice([6, 8])) if turned else 1, i))
        portrait.append(turned)
    return blobs, portrait


class Photos:
    """JPEGs from memory (no image_sizes(): grouping reads their headers)."""

    def __init__(self, blobs):
        self.blobs = blobs
        self.reads = 0

    def __len__(self):
        return len(self.blobs)

    def read(self, index):
        self.reads += 1
        return self.blobs[index], index


def _grouped(source, exif, **kw):
    """One pass's batches as (source indices, delivered (height, width)s)."""
    with Feeder(source, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=0, seed=5,
                shuffle=True, exif_orientation=exif, decode_threads=2, augment_threads=0,
                **kw) as f:
        return collected(f, keep=lambda b: (f.last_batch.indices.tolist(), b["size"].tolist()))


def _homogeneous(batches, portrait):
    """Every batch but the last two (the groups' leftovers) of one orientation."""
    uniform = [len({portrait[i] for i in indices}) == 1 for indices, _ in batches]
    return all(uniform[:-2]), uniform


def test_packed_shards_group_by_oriented_sizes(tmp_path):
    """feeder-pack's indices give the sizes as stored and which images EXIF
    orientation transposes: exif_orientation=True groups by the oriented sizes
    (stored sizes would mix portrait and landscape in most batches)."""
    import os
    from feeder.pack import pack, parse_size
    from feeder.shards import TarShards
    blobs, portrait = _rotated_photos(32, seed=1)
    os.makedirs(tmp_path / "src" / "c0")
    for i, blob in enumerate(blobs):
        (tmp_path / "src" / "c0" / f"{i:03d}.jpg").write_bytes(blob)
    res = pack(str(tmp_path / "src"), str(tmp_path / "out"), shard_size=parse_size("8KB"))
    assert len(res.shards) > 1
    listing = str(tmp_path / "out" / "train.json")
    for lazy in (False, True):
        shards = TarShards(listing, lazy_index=lazy)
        stored = shards.image_sizes()
        assert (stored[:, 0] < stored[:, 1]).all()  # every photo stored landscape
        assert [bool(h > w) for h, w in shards.oriented_image_sizes()] == portrait
    shards = TarShards(listing)
    batches = _grouped(shards, True)
    ok, uniform = _homogeneous(batches, portrait)
    assert ok, uniform
    # The delivered images are oriented: portrait where the grouping said so.
    for indices, sizes in batches:
        assert [h > w for h, w in sizes] == [portrait[i] for i in indices]
    assert sorted(i for indices, _ in batches for i in indices) == list(range(32))


def test_header_scan_groups_by_oriented_sizes_whichever_feeder_scanned_first():
    """The header cache is kept per exif_orientation: a feeder's order does not
    depend on which setting read the same source first."""
    blobs, portrait = _rotated_photos(32, seed=2)
    alone = _grouped(Photos(blobs), True)
    ok, uniform = _homogeneous(alone, portrait)
    assert ok, uniform
    shared = Photos(blobs)
    stored_first = _grouped(shared, False)  # scans the stored sizes: every photo landscape
    after = _grouped(shared, True)
    assert [i for i, _ in after] == [i for i, _ in alone]
    assert [i for i, _ in _grouped(shared, False)] == [i for i, _ in stored_first]


class Flaky(Photos):
    """Reads of the listed samples fail with an OSError ``failures`` times each."""

    def __init__(self, blobs, bad, failures):
        super().__init__(blobs)
        self.left = {i: failures for i in bad}

    def read(self, index):
        if self.left.get(index, 0) > 0:
            self.left[index] -= 1
            raise ConnectionResetError(f"storage hiccup reading {index}")
        return super().read(index)


def test_a_transient_read_failure_in_the_scan_is_retried_not_kept():
    """A read that failed once must not leave the sample's size unknown for the
    process: the grouped order (and a restarted job's resume) would change."""
    from feeder.order.group import READ_ATTEMPTS
    blobs, portrait = _rotated_photos(24, seed=3)
    reference = [i for i, _ in _grouped(Photos(blobs), True)]
    flaky = Flaky(blobs, bad=[2, 5], failures=READ_ATTEMPTS - 1)
    assert [i for i, _ in _grouped(flaky, True)] == reference
    # A storage that keeps failing fails the pass, naming the sample; nothing is
    # kept: once it recovers, the order is the one of a fresh process.
    down = Flaky(blobs, bad=[4], failures=READ_ATTEMPTS)
    with Feeder(down, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=0, seed=5,
                shuffle=True, exif_orientation=True, decode_threads=2, augment_threads=0) as f:
        _, err = collect_pass(f)
        assert err is not None and "sample 4" in str(err) and "ConnectionResetError" in str(err)
    assert [i for i, _ in _grouped(down, True)] == reference


class Missing(Photos):
    """The listed samples' files are absent (``FileNotFoundError``) until ``restore``."""

    def __init__(self, blobs, gone):
        super().__init__(blobs)
        self.gone = set(gone)

    def read(self, index):
        if index in self.gone:
            raise FileNotFoundError(2, "No such file or directory", f"img_{index}.jpg")
        return super().read(index)


def test_a_missing_file_in_the_scan_is_a_skip_not_a_failed_pass():
    """A file the storage says is absent fails its sample, as without grouping
    (a counted skip under on_error="skip"), not the whole pass; its size is not
    kept, so once it is back the order is a fresh process's."""
    blobs, _ = _rotated_photos(24, seed=6)
    reference = [i for i, _ in _grouped(Photos(blobs), True)]
    missing = Missing(blobs, gone=[3])
    with Feeder(missing, 4, [], max_image_size=(40, 40), group_by_aspect_ratio=0, seed=5,
                shuffle=True, exif_orientation=True, decode_threads=2, augment_threads=0,
                on_error="skip") as f:
        batches = collected(f, keep=lambda b: b["label"].tolist())
        assert f.stats().skipped == 1
    delivered = [i for b in batches for i in b]
    assert sorted(delivered) == [i for i in range(24) if i != 3]
    missing.gone.clear()
    assert [i for i, _ in _grouped(missing, True)] == reference


def test_a_resume_whose_grouped_order_differs_is_refused():
    """The same settings with other image sizes regroup otherwise: positions along
    that order would lose samples; the state says so instead."""
    blobs, _ = _rotated_photos(24, seed=4)
    kw = dict(max_image_size=(40, 40), group_by_aspect_ratio=0, seed=5, shuffle=True,
              decode_threads=2, augment_threads=0)
    with Feeder(Photos(blobs), 4, [], **kw) as f:
        collected(f, limit=2)
        state = f.state_dict()
    assert state["grouped_order"] is not None
    with Feeder(Photos(blobs), 4, [], **kw) as g:
        g.load_state_dict(state)  # the same sizes: accepted
    other = Photos(blobs)
    other.image_sizes = lambda: [(30, 20) if i % 3 else (20, 30) for i in range(len(blobs))]
    with Feeder(other, 4, [], **kw) as g:
        with pytest.raises(ValueError, match="cannot resume: grouped_order of epoch 0 differs"):
            g.load_state_dict(state)
