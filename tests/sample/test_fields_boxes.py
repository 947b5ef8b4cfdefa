"""Boxes: mapped with their image's crop, scale and flip (checked against the
painted rectangles they came with), clipped or dropped, their per-box arrays
filtered with them, delivered as a list of float32 [Ni, 4] tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.support import collect, encode_jpeg
from feeder import ConfigError, Feeder, SampleError, ops
from feeder.decode import decode_image, decode_scale
from tests.support.fields import DictSource, coordinate_image, rectangles_image, rgb_png

COLORS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]


def scene(i: int) -> tuple[int, int, np.ndarray]:
    """Non-overlapping rectangles at places that depend on ``i``."""
    rng = np.random.default_rng(i)
    h, w = int(rng.integers(90, 140)), int(rng.integers(90, 140))
    boxes = []
    for k in range(6):
        col, row = k % 3, k // 3
        x0 = col * w / 3 + rng.uniform(1, 8)
        y0 = row * h / 2 + rng.uniform(1, 8)
        boxes.append([x0, y0, x0 + rng.uniform(8, w / 3 - 10), y0 + rng.uniform(8, h / 2 - 10)])
    return h, w, np.floor(np.array(boxes, np.float32))


def det_source(n: int = 12):
    def make(i):
        h, w, boxes = scene(i)
        img = rectangles_image(h, w, boxes, COLORS)
        return {"image": rgb_png(img), "boxes": boxes, "box_labels": np.arange(6),
                "box_ids": np.stack([np.arange(6), np.full(6, i)], 1), "id": i}
    return DictSource(n, make)


def painted_extent(image: torch.Tensor, color, tolerance: int = 60):
    """(x0, y0, x1, y1) of the pixels of ``image`` ([3, H, W]) close to ``color``, or None."""
    img = image.permute(1, 2, 0).numpy().astype(int)
    near = (np.abs(img - np.array(color)).max(axis=2) <= tolerance)
    if not near.any():
        return None
    ys, xs = np.nonzero(near)
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


def check_boxes_match_rectangles(batch, slack: float) -> int:
    checked = 0
    for img, boxes, labels, ids in zip(batch["image"], batch["boxes"], batch["box_labels"],
                                       batch["box_ids"]):
        assert boxes.dtype == torch.float32 and boxes.ndim == 2 and boxes.shape[1] == 4
        assert labels.shape == (len(boxes),) and labels.dtype == torch.int64
        assert ids[:, 0].tolist() == labels.tolist()  # a per-box [N, 2] array, filtered alike
        h, w = img.shape[1:]
        assert (boxes[:, 0] >= 0).all() and (boxes[:, 2] <= w).all() and (boxes[:, 1] >= 0).all()
        assert (boxes[:, 3] <= h).all() and (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
        present = set()
        for box, k in zip(boxes.tolist(), labels.tolist()):
            extent = painted_extent(img, COLORS[k])
            x0, y0, x1, y1 = box
            if extent is None:
                # Kept, yet no pixel centre inside: only a box thinner than a pixel.
                assert min(x1 - x0, y1 - y0) < 1.5, (k, box)
                continue
            present.add(k)
            for got, want in zip(extent, box):
                assert abs(got - want) <= slack, (k, box, extent)
            checked += 1
        for k in set(range(6)) - set(labels.tolist()):  # dropped: not in the image at all
            assert painted_extent(img, COLORS[k], tolerance=20) is None, k
    return checked


@pytest.mark.parametrize("transforms, slack", [
    ([ops.RandomResizedCrop(64, scale=(0.2, 1.0), interpolation="nearest"), ops.RandomHorizontalFlip()], 1.01),
    ([ops.RandomResizedCrop((48, 80), scale=(0.3, 1.0)), ops.RandomHorizontalFlip()], 1.6),
    ([ops.Resize(72), ops.CenterCrop(64), ops.RandomHorizontalFlip(p=1.0)], 1.6),
    ([ops.CenterCrop(150)], 0.01),  # padding: boxes move by the pad, nothing is cut
    ([ops.Resize((60, 90), interpolation="nearest")], 1.01),
])
def test_boxes_land_on_their_painted_rectangles(transforms, slack):
    with Feeder(det_source(), 4, transforms, seed=7, decode_threads=2) as f:
        batches, err = collect(f)
    assert err is None
    checked = sum(check_boxes_match_rectangles(b, slack) for b in batches)
    assert checked > 30
    assert isinstance(batches[0]["boxes"], list) and len(batches[0]["boxes"]) == 4


def test_boxes_are_clipped_to_the_crop_and_dropped_outside_it():
    """A centre crop of known geometry: a box across its edge is clipped, one
    outside it dropped with its label, one with no area after clipping too."""
    img = np.zeros((100, 100, 3), np.uint8)
    boxes = np.array([[10, 10, 40, 40],    # crosses the crop's top-left corner
                      [0, 0, 20, 20],      # outside the 50x50 centre crop (25..75)
                      [30, 30, 70, 70],    # inside
                      [60, 10, 75, 30],    # touches the crop's right edge only above it: dropped
                      [75, 30, 90, 60]],   # starts at the crop's right edge: no area inside
                     np.float32)

    def make(i):
        return {"image": rgb_png(img), "boxes": boxes, "box_labels": np.arange(5) * 10}
    with Feeder(DictSource(2, make), 2, [ops.CenterCrop(50)], shuffle=False) as f:
        (batch,), err = collect(f)
    assert err is None
    assert batch["boxes"][0].tolist() == [[0, 0, 15, 15], [5, 5, 45, 45], [35, 0, 50, 5]]
    assert batch["box_labels"][0].tolist() == [0, 20, 30]


def test_a_flip_mirrors_boxes_exactly():
    img = np.zeros((40, 60, 3), np.uint8)
    boxes = np.array([[5.5, 1, 20.25, 10], [40, 30, 60, 40]], np.float32)

    def make(i):
        return {"image": rgb_png(img), "boxes": boxes}
    with Feeder(DictSource(2, make), 2, [ops.RandomHorizontalFlip(p=1.0)], image_size=(40, 60),
                shuffle=False) as f:
        (batch,), err = collect(f)
    assert batch["boxes"][0].tolist() == [[39.75, 1, 54.5, 10], [0, 30, 20, 40]]


def test_samples_without_boxes_give_empty_tensors():
    img = rgb_png(np.zeros((30, 30, 3), np.uint8))

    def make(i):
        n = i % 3
        return {"image": img, "boxes": np.full((n, 4), [1, 1, 5, 5], np.float32) if n else [],
                "box_labels": np.arange(n)}
    with Feeder(DictSource(6, make), 3, [ops.Resize((15, 15))], shuffle=False) as f:
        batches, err = collect(f)
    assert err is None
    counts = [len(b) for batch in batches for b in batch["boxes"]]
    assert counts == [0, 1, 2, 0, 1, 2]
    assert batches[0]["boxes"][0].shape == (0, 4) and batches[0]["box_labels"][0].shape == (0,)
    assert batches[0]["boxes"][1].tolist() == [[0.5, 0.5, 2.5, 2.5]]


@pytest.mark.parametrize("decode, augment", [(1, 0), (3, 0), (2, 2)])
@pytest.mark.parametrize("ordered", [True, False])
def test_boxes_are_the_same_for_any_threads_and_order(decode, augment, ordered):
    chain = [ops.RandomResizedCrop(48, scale=(0.2, 1.0)), ops.RandomHorizontalFlip()]

    def per_sample(**kw):
        with Feeder(det_source(14), 4, chain, seed=1, drop_last=False, **kw) as f:
            batches, err = collect(f)
        assert err is None
        return {i: (b["boxes"][k], b["box_labels"][k], b["image"][k])
                for b in batches for k, i in enumerate(b["id"].tolist())}
    reference = per_sample(decode_threads=1, ordered=True)
    got = per_sample(decode_threads=decode, augment_threads=augment, ordered=ordered)
    assert sorted(got) == list(range(14))
    for i, (boxes, labels, img) in reference.items():
        assert torch.equal(got[i][0], boxes) and torch.equal(got[i][1], labels)
        assert torch.equal(got[i][2], img)


def test_skips_keep_boxes_with_their_samples():
    good = det_source(24)

    def make(i):
        s = good.read(i)
        if i in (2, 9, 10):
            s["boxes"] = s["boxes"][:, :3]  # malformed: the sample's fault, skipped
        return s
    with Feeder(DictSource(24, make), 4, [ops.RandomResizedCrop(64, scale=(0.3, 1.0))],
                on_error="skip", seed=2, decode_threads=2, ordered=False, drop_last=False) as f:
        batches, err = collect(f)
        assert f.stats().skipped == 3
    assert err is None
    ids = sorted(i for b in batches for i in b["id"].tolist())
    assert ids == [i for i in range(24) if i not in (2, 9, 10)]
    for b in batches:
        for ids_k, i in zip(b["box_ids"], b["id"].tolist()):
            assert (ids_k[:, 1] == i).all()  # each sample's per-box rows are its own
        check_boxes_match_rectangles(b, 1.6)


@pytest.mark.parametrize("boxes, words", [
    ([[0, 0, 10]], "[N, 4]"),
    ([[5, 0, 1, 10]], "x1 < x0"),
    ([[0, 0, math.inf, 10]], "not finite"),
    ("0 0 10 10", "float [N, 4]"),
])
def test_malformed_boxes_are_their_sample_s_error(boxes, words):
    img = rgb_png(np.zeros((20, 20, 3), np.uint8))

    def make(i):
        return {"image": img, "boxes": boxes if i == 1 else [[0, 0, 5, 5]]}
    with Feeder(DictSource(4, make), 2, [ops.CenterCrop(10)], shuffle=False, decode_threads=1) as f:
        batches, err = collect(f)
    assert isinstance(err, SampleError) and err.index == 1 and err.field == "boxes", repr(err)
    assert err.stage == "read" and words in str(err)


def test_an_image_only_resize_on_a_sample_with_boxes_is_an_error():
    def half(img, rng):
        return np.ascontiguousarray(img[::2, ::2])
    with Feeder(det_source(4), 4, [half, ops.CenterCrop(30)]) as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and isinstance(err.__cause__, ConfigError)
    assert "half" in str(err)


def test_a_sample_transform_gets_boxes_in_its_image_s_pixels():
    """A user's vertical flip moves boxes itself; they must still match the rectangles."""
    @ops.SampleTransform
    def vflip(sample, rng):
        img = np.ascontiguousarray(sample["image"][::-1])
        h = img.shape[0]
        b = sample["boxes"].copy()
        b[:, [1, 3]] = h - sample["boxes"][:, [3, 1]]
        return {**sample, "image": img, "boxes": b}
    chain = [ops.RandomResizedCrop(64, scale=(0.3, 1.0), interpolation="nearest"), vflip,
             ops.RandomHorizontalFlip()]
    with Feeder(det_source(), 4, chain, seed=4) as f:
        batches, err = collect(f)
    assert err is None
    assert sum(check_boxes_match_rectangles(b, 1.01) for b in batches) > 30


def test_the_decode_scale_is_libjpeg_s_not_the_ratio_of_sizes():
    """A 161-pixel JPEG decoded at 1/8 has 21 pixels, each 8 source pixels wide
    (the last partly past the edge): the ratio 21/161 would misplace the far ones."""
    data = encode_jpeg(coordinate_image(161, 161), quality=98)
    decoded, full = decode_image(data, hint=lambda h, w, k: (1, 1))
    assert decoded.shape[:2] == (21, 21) and full == (161, 161)
    sy, sx = decode_scale(full, decoded.shape[:2])
    assert (sy, sx) == (1 / 8, 1 / 8)
    for j in (4, 12, 19):
        shown = (j + 0.5) / sx - 0.5  # the source pixel under decoded pixel j's centre
        assert abs(int(decoded[10, j, 0]) - shown) <= 2, (j, decoded[10, j, 0], shown)
