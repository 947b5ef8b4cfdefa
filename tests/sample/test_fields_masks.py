"""Masks: decoded to their stored values, moved with their image by every
transform (checked against images whose pixels say where they came from),
delivered as uint8 or int64 per batch, and failing as their sample's fault."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from tests.support import collect, encode_jpeg
from feeder import ConfigError, DecodeError, Feeder, SampleError, ops
from feeder.decode import decode_mask
from feeder.testing import work_of
from tests.support.fields import (DictSource, cell_mask, check_mask_follows_image, coordinate_image, png,
                            rgb_png)


# -- decoding --------------------------------------------------------------------------

def test_gray_masks_decode_to_their_stored_values():
    rng = np.random.default_rng(0)
    for depth in (1, 2, 4, 8):
        values = rng.integers(0, 1 << depth, (7, 13)).astype(np.uint8)
        got = decode_mask(png(values, depth))
        assert got.dtype == np.uint8 and np.array_equal(got, values), depth
    wide = rng.integers(0, 65536, (5, 9)).astype(np.uint16)
    got = decode_mask(png(wide, 16))
    assert got.dtype == np.uint16 and np.array_equal(got, wide)
    # A transparent gray value is metadata, not a class.
    assert np.array_equal(decode_mask(png(values, 8, gray_trns=3)), values)


def test_palette_masks_decode_to_their_indices_not_their_colours():
    rng = np.random.default_rng(1)
    # Duplicate colours and a transparent entry: only the indices tell classes apart.
    palette = [(0, 0, 0), (128, 0, 0), (128, 0, 0), (0, 128, 0), (0, 0, 0)] + [(9, 9, 9)] * 3
    for depth in (4, 8):
        values = rng.integers(0, len(palette), (11, 6)).astype(np.uint8)
        got = decode_mask(png(values, depth, palette=palette))
        assert got.dtype == np.uint8 and np.array_equal(got, values), depth
    values = rng.integers(0, 2, (6, 19)).astype(np.uint8)
    assert np.array_equal(decode_mask(png(values, 1, palette=[(255, 255, 255), (0, 0, 0)])), values)


@pytest.mark.parametrize("data, words", [
    (rgb_png(np.zeros((4, 4, 3), np.uint8)), "single-channel"),
    (encode_jpeg(np.zeros((16, 16, 3), np.uint8)), "must be a PNG"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 30, "corrupt"),
    (b"", "empty"),
])
def test_masks_that_are_not_single_channel_pngs_are_refused(data, words):
    with pytest.raises(DecodeError, match=words):
        decode_mask(data)


# -- masks follow their image -----------------------------------------------------------

def seg_source(n: int, sizes=((96, 120), (130, 100), (80, 80)), fmt: str = "png", step: int = 1):
    """Images whose pixels encode their coordinates, masks of their grid cells."""
    cache = {}

    def make(i):
        h, w = sizes[i % len(sizes)]
        if (h, w) not in cache:
            img = coordinate_image(h, w, step)
            data = rgb_png(img) if fmt == "png" else encode_jpeg(img, quality=97)
            cache[(h, w)] = (data, png(cell_mask(h, w, 8 * step)))
        data, mask = cache[(h, w)]
        return {"image": data, "mask": mask, "id": i}
    return DictSource(n, make)


@pytest.mark.parametrize("transforms", [
    [ops.RandomResizedCrop(48, scale=(0.2, 1.0)), ops.RandomHorizontalFlip()],
    [ops.RandomHorizontalFlip(p=1.0), ops.RandomResizedCrop((40, 56), scale=(0.3, 1.0))],
    [ops.Resize(64), ops.CenterCrop(48)],                   # fused resize + crop
    [ops.Resize(30), ops.CenterCrop((40, 48))],             # fused, the crop larger: padding
    [ops.Resize((50, 70)), ops.RandomHorizontalFlip(p=1.0)],
    [ops.CenterCrop(112)],                                  # larger than some images: padding
    [ops.Resize(40), ops.RandomHorizontalFlip(), ops.CenterCrop(36)],
])
def test_masks_follow_the_image_through_every_builtin_transform(transforms):
    with Feeder(seg_source(12), 4, transforms, seed=5, decode_threads=2) as f:
        batches, err = collect(f)
    assert err is None
    checked = 0
    for b in batches:
        assert b["mask"].dtype == torch.uint8 and b["mask"].shape[1:] == b["image"].shape[2:]
        for img, mask in zip(b["image"], b["mask"]):
            checked += check_mask_follows_image(img.numpy(), mask.numpy())
    assert checked > 1000


def test_masks_follow_a_jpeg_decoded_at_a_reduced_scale():
    """A large JPEG is decoded at 1/2..1/8 scale for a small crop; the full-size mask
    must still land on the pixels the crop shows."""
    src = seg_source(6, sizes=((720, 960), (800, 640)), fmt="jpeg", step=4)
    chain = [ops.RandomResizedCrop(40, scale=(0.5, 1.0)), ops.RandomHorizontalFlip()]
    with Feeder(src, 3, chain, seed=2, decode_threads=2) as f:
        plan = work_of(f).plan
        batches, err = collect(f)
    assert plan is not None and err is None
    for b in batches:
        for img, mask in zip(b["image"], b["mask"]):
            # Cells of 32 source pixels; JPEG and the reduced decode leave the
            # coordinates within a few source pixels.
            check_mask_follows_image(img.numpy(), mask.numpy(), step=4, cell=32, margin=6)


def test_nearest_neighbour_never_mixes_class_ids():
    values = np.where((np.arange(90)[:, None] + np.arange(70)[None, :]) % 7 < 3, 3, 200).astype(np.uint8)
    image = rgb_png(coordinate_image(90, 70))

    def make(i):
        return {"image": image, "mask": png(values)}
    chain = [ops.RandomResizedCrop(33, scale=(0.1, 1.0), ratio=(0.5, 2.0)), ops.RandomHorizontalFlip()]
    with Feeder(DictSource(16, make), 8, chain, seed=0) as f:
        batches, err = collect(f)
    assert err is None
    assert set(torch.cat([b["mask"] for b in batches]).unique().tolist()) <= {3, 200}


@pytest.mark.parametrize("decode, augment", [(1, 0), (3, 0), (2, 2)])
@pytest.mark.parametrize("ordered", [True, False])
def test_each_sample_s_mask_is_the_same_for_any_threads_and_order(decode, augment, ordered):
    chain = [ops.RandomResizedCrop(32, scale=(0.2, 1.0)), ops.RandomHorizontalFlip()]

    def per_sample(**kw):
        with Feeder(seg_source(18), 4, chain, seed=9, drop_last=False, **kw) as f:
            f.set_epoch(2)
            batches, err = collect(f)
        assert err is None
        out = {}
        for b in batches:
            for k, i in enumerate(b["id"].tolist()):
                out[i] = (b["image"][k], b["mask"][k])
        return out, [i for b in batches for i in b["id"].tolist()]
    reference, order = per_sample(decode_threads=1, augment_threads=0, ordered=True)
    got, got_order = per_sample(decode_threads=decode, augment_threads=augment, ordered=ordered)
    assert sorted(got) == list(range(18))
    if ordered:
        assert got_order == order
    for i, (img, mask) in reference.items():
        assert torch.equal(got[i][0], img) and torch.equal(got[i][1], mask)
        check_mask_follows_image(img.numpy(), mask.numpy())


def test_masks_as_arrays_and_16_bit_masks_make_int64_batches():
    """A batch is int64 when one of its masks is 16-bit, uint8 otherwise: decided by the
    batch's own samples, the same for any threads."""
    image = rgb_png(coordinate_image(20, 24))
    wide = np.full((20, 24), 40000, np.uint16)
    wide[:, 12:] = 300

    def make(i):
        if i in (5, 6):
            return {"image": image, "mask": png(wide, 16), "id": i}
        return {"image": image, "mask": np.full((20, 24), i, np.uint8), "id": i}
    for threads in (1, 3):
        with Feeder(DictSource(12, make), 4, [ops.Resize((10, 12))], shuffle=False,
                    decode_threads=threads) as f:
            batches, err = collect(f)
        assert err is None
        assert [b["mask"].dtype for b in batches] == [torch.uint8, torch.int64, torch.uint8]
        middle = batches[1]["mask"]
        assert middle[0].unique().tolist() == [4]
        assert middle[1].unique().tolist() == [300, 40000] and (middle[1][:, :6] == 40000).all()
        assert middle[3].unique().tolist() == [7]


def test_16_bit_masks_survive_skips_that_move_them_between_buffers():
    image = rgb_png(coordinate_image(16, 16))

    def make(i):
        if i % 5 == 1:
            return {"image": b"corrupt", "mask": png(np.zeros((16, 16), np.uint8)), "id": i}
        mask = np.full((16, 16), 1000 + i, np.uint16) if i % 3 == 0 else np.full((16, 16), i, np.uint8)
        return {"image": image, "mask": mask, "id": i}
    with Feeder(DictSource(30, make), 4, [ops.RandomHorizontalFlip()], image_size=(16, 16), shuffle=True, seed=4,
                on_error="skip", decode_threads=2, drop_last=False) as f:
        batches, err = collect(f)
    assert err is None
    seen = []
    for b in batches:
        wide = any(i % 3 == 0 for i in b["id"].tolist())
        assert b["mask"].dtype == (torch.int64 if wide else torch.uint8)
        for i, m in zip(b["id"].tolist(), b["mask"]):
            assert m.unique().tolist() == [1000 + i if i % 3 == 0 else i]
            seen.append(i)
    assert sorted(seen) == [i for i in range(30) if i % 5 != 1]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_corrupt_mask_is_its_sample_s_error_naming_the_field(on_error):
    good = seg_source(20)

    def make(i):
        s = good.read(i)
        if i == 7:
            s["mask"] = s["mask"][:40]  # truncated PNG
        if i == 13:
            s["mask"] = png(np.zeros((10, 10), np.uint8))  # not its image's size
        return s
    names = [f"/data/seg/{i:03d}.png" for i in range(20)]
    with Feeder(DictSource(20, make, names), 4, [ops.CenterCrop(32)], shuffle=False,
                on_error=on_error, decode_threads=2) as f:
        batches, err = collect(f)
        skipped = f.stats()
    if on_error == "raise":
        assert isinstance(err, SampleError) and err.index == 7 and err.field == "mask"
        assert err.stage == "decode" and "/data/seg/007.png" in str(err) and "field 'mask'" in str(err)
        assert len(batches) == 1
    else:
        assert err is None and skipped.skipped == 2
        assert "/data/seg/013.png" in skipped.skipped_paths
        ids = sorted(i for b in batches for i in b["id"].tolist())
        assert ids == [i for i in range(20) if i not in (7, 13)]
        for b in batches:
            for img, mask in zip(b["image"], b["mask"]):
                check_mask_follows_image(img.numpy(), mask.numpy())


# -- user transforms -------------------------------------------------------------------

def test_an_image_only_callable_keeps_working_when_it_keeps_the_geometry():
    def invert(img, rng):
        out = img.copy()
        out[..., 2] = 255 - img[..., 2]  # B: 128 -> 127, coordinates untouched
        return out
    with Feeder(seg_source(8), 4, [ops.RandomResizedCrop(40), invert, ops.RandomHorizontalFlip()],
                seed=1) as f:
        batches, err = collect(f)
    assert err is None
    for b in batches:
        assert (b["image"][:, 2] == 127).all()
        for img, mask in zip(b["image"], b["mask"]):
            check_mask_follows_image(img.numpy(), mask.numpy())


def test_an_image_only_callable_that_changes_the_size_of_a_sample_with_a_mask_is_an_error():
    def shrink(img, rng):
        return np.ascontiguousarray(img[::2, ::2])
    shrink.output_size = None
    for on_error in ("raise", "skip"):
        with Feeder(seg_source(8), 4, [shrink, ops.CenterCrop(20)], on_error=on_error) as f:
            _, err = collect(f)
        assert isinstance(err, SampleError) and isinstance(err.__cause__, ConfigError), repr(err)
        assert "shrink" in str(err) and "SampleTransform" in str(err)


def test_a_sample_transform_moves_the_mask_itself():
    """A vertical flip written by the user, applied to the whole sample."""
    @ops.SampleTransform
    def vflip(sample, rng):
        if rng.random() < 0.5:
            return sample
        out = dict(sample)
        out["image"] = np.ascontiguousarray(sample["image"][::-1])
        out["mask"] = np.ascontiguousarray(sample["mask"][::-1])
        return out
    chain = [ops.RandomResizedCrop(40, scale=(0.3, 1)), vflip, ops.RandomHorizontalFlip()]
    with Feeder(seg_source(12), 4, chain, seed=3) as f:
        batches, err = collect(f)
    assert err is None
    flipped = 0
    for b in batches:
        for img, mask in zip(b["image"], b["mask"]):
            check_mask_follows_image(img.numpy(), mask.numpy())
            flipped += int(img[1, 0, 0] > img[1, -1, 0])  # y decreasing downwards
    assert 0 < flipped < 12


def test_a_sample_transform_that_breaks_the_mask_is_named():
    @ops.SampleTransform
    def bad(sample, rng):
        return {**sample, "mask": sample["mask"][:3]}
    with Feeder(seg_source(4), 4, [ops.CenterCrop(20), bad]) as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and err.field == "mask" and "bad" in str(err)


@pytest.mark.parametrize("ordered", [True, False])
def test_late_bound_batches_carry_every_field(monkeypatch, ordered):
    """Every batch starts without a buffer: its first samples wait in scratch arrays,
    and their mask, boxes and numbers must reach the buffer with their image."""
    from feeder.engine.batch import BufferPool
    monkeypatch.setattr(BufferPool, "try_acquire", lambda self, owner=None: None)
    base = seg_source(21)

    def make(i):
        s = base.read(i)
        if i % 4 == 0:
            s["mask"] = png(cell_mask(*((96, 120), (130, 100), (80, 80))[i % 3]).astype(np.uint16) + 256, 16)
        h, w = ((96, 120), (130, 100), (80, 80))[i % 3]
        s["boxes"] = [[0, 0, w, h]]  # the whole image: the whole crop
        s["box_labels"] = [i]
        s["score"] = np.float32(i / 2)
        return s
    chain = [ops.RandomResizedCrop(40, scale=(0.5, 1.0)), ops.RandomHorizontalFlip()]
    with Feeder(DictSource(21, make), 4, chain, seed=6, decode_threads=3, ordered=ordered,
                drop_last=False) as f:
        batches, err = collect(f)
    assert err is None
    ids = []
    for b in batches:
        for k, i in enumerate(b["id"].tolist()):
            ids.append(i)
            assert b["score"][k].item() == i / 2
            mask = b["mask"][k].numpy().astype(np.int64)
            if i % 4 == 0:
                assert b["mask"].dtype == torch.int64 and (mask >= 256).all()
                mask = mask - 256
            check_mask_follows_image(b["image"][k].numpy(), mask)
            assert b["boxes"][k].tolist() == [[0, 0, 40, 40]] and b["box_labels"][k].tolist() == [i]
    assert sorted(ids) == list(range(21))


def test_a_resumed_pass_delivers_the_uninterrupted_run_s_masks():
    chain = [ops.RandomResizedCrop(32, scale=(0.3, 1.0)), ops.RandomHorizontalFlip()]

    def feeder():
        return Feeder(seg_source(24), 4, chain, seed=12, decode_threads=2)
    with feeder() as f:
        f.set_epoch(3)
        whole, err = collect(f)
    assert err is None and len(whole) == 6
    with feeder() as f:
        f.set_epoch(3)
        it = iter(f)
        for _ in range(2):
            next(it)
        state = f.state_dict()
        del it
    with feeder() as g:
        g.load_state_dict(state)
        rest, err = collect(g)
    assert err is None and len(rest) == 4
    for a, b in zip(whole[2:], rest):
        assert torch.equal(a["id"], b["id"]) and torch.equal(a["mask"], b["mask"])
        assert torch.equal(a["image"], b["image"])


@pytest.mark.parametrize("transforms", [
    [ops.Resize((13, 19), interpolation="nearest")],
    [ops.Resize((61, 90), interpolation="nearest")],
    [ops.Resize(20, interpolation="nearest"), ops.CenterCrop(17)],  # fused: a window
    [ops.RandomResizedCrop(23, interpolation="nearest"), ops.RandomHorizontalFlip()],
    # crops whose scale puts output centres exactly on input boundaries (12 -> 22)
    [ops.RandomResizedCrop(22, interpolation="nearest")],
    [ops.RandomCrop((24, 24)), ops.Resize((22, 22), interpolation="nearest")],
])
def test_a_nearest_resize_takes_the_image_s_pixels_where_the_mask_takes_its_ids(transforms):
    # The image holds the class ids on every channel: a nearest-neighbour resize
    # must pick the same input pixel for both (the one under each output
    # pixel's centre), not one half a pixel off (cv2's INTER_NEAREST).
    ids = np.random.default_rng(0).integers(0, 6, (30, 44), dtype=np.uint8)

    def make(i):
        return {"image": np.dstack([ids] * 3), "mask": ids}

    with Feeder(DictSource(64, make), 16, transforms, seed=1, timeout=60) as f:
        batches, err = collect(f)
    assert err is None
    for b in batches:
        images, masks = b["image"].numpy(), b["mask"].numpy()
        for k in range(len(masks)):
            np.testing.assert_array_equal(images[k, 0], masks[k])
            np.testing.assert_array_equal(images[k, 2], masks[k])
