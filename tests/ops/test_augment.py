"""feeder.ops.chain: the compiled transform chain (its output size, how it runs
transforms, plain callables and sample transforms, variable-size placement)."""

from __future__ import annotations

import numpy as np
import pytest

from feeder import ConfigError, FieldError, SampleRNG, TransformError, ops
from feeder.ops.chain import Chain, image_size_pair
from feeder.ops import Geometry, SampleContext
from feeder.synthetic import make_image


IMG = make_image(60, 80, seed=5)


def run(chain: Chain, img: np.ndarray, key: int = 1) -> tuple[np.ndarray, tuple[int, int]]:
    out = np.zeros(chain.image_size + (3,), np.uint8)
    size = chain.run(img, key, SampleContext(img.shape[:2]), out)
    return out, size


def one_by_one(transforms, img, key: int = 1) -> np.ndarray:
    """The transforms applied in order, each with the stream of its position."""
    for i, t in enumerate(transforms):
        img = t(img, SampleRNG(key, i))
    return img


@pytest.mark.parametrize("value, pair", [((3, 4), (3, 4)), ([5, 6], (5, 6)), ((np.int64(2), 7), (2, 7))])
def test_image_size_pair_accepts_two_positive_ints(value, pair):
    assert image_size_pair(value) == pair and all(type(v) is int for v in image_size_pair(value))


@pytest.mark.parametrize("value", [(0, 3), (3,), 3, (2.0, 3), (True, 3), "3x3", None])
def test_image_size_pair_refuses_anything_else(value):
    with pytest.raises(ValueError, match="image_size must be"):
        image_size_pair(value)


def test_the_output_size_comes_from_the_transforms_or_image_size():
    assert Chain([ops.RandomResizedCrop((24, 32)), ops.RandomHorizontalFlip()], None).image_size == (24, 32)
    assert Chain([ops.RandomHorizontalFlip()], (10, 12)).image_size == (10, 12)
    with pytest.raises(ValueError, match="cannot tell the output image size"):
        Chain([ops.RandomHorizontalFlip()], None)
    with pytest.raises(ValueError, match=r"image_size=\(10, 10\) but the transforms produce \(8, 8\)"):
        Chain([ops.CenterCrop(8)], (10, 10))
    with pytest.raises(ValueError, match="drop max_image_size"):
        Chain([ops.CenterCrop(8)], None, max_image_size=(16, 16))


@pytest.mark.parametrize("transforms", [
    [ops.CenterCrop(24)],
    [ops.RandomResizedCrop(20), ops.RandomHorizontalFlip()],
    [ops.Resize((30, 40)), ops.RandomHorizontalFlip(1.0), ops.CenterCrop((20, 28))],
])
def test_run_gives_what_the_transforms_give_one_by_one(transforms):
    for key in range(4):
        out, size = run(Chain(transforms, None), IMG, key)
        want = one_by_one(transforms, IMG, key)
        assert size == want.shape[:2]
        assert np.abs(out.astype(int) - want.astype(int)).max() <= 1


def test_a_plain_callable_gets_its_own_deterministic_stream():
    draws = []

    def shift(img, rng):
        draws.append(int(rng.integers(0, 1 << 30)))
        return np.roll(img, 1, axis=1)

    chain = Chain([shift, ops.CenterCrop(16)], None)
    run(chain, IMG, key=7)
    run(chain, IMG, key=7)
    run(chain, IMG, key=8)
    assert draws[0] == draws[1] != draws[2]
    assert draws[0] == int(SampleRNG(7, 0).integers(0, 1 << 30))  # the stream of its position


def test_a_callable_returning_no_image_is_named():
    def broken(img, rng):
        return None

    with pytest.raises(TransformError, match="broken"):
        run(Chain([broken, ops.CenterCrop(8)], None), IMG)


def test_a_callables_result_of_the_wrong_size_is_a_config_error():
    def cut(img, rng):
        return np.ascontiguousarray(img[:10, :12])

    with pytest.raises(ConfigError, match="cut"):
        run(Chain([cut], (10, 10)), IMG)
    out, size = run(Chain([cut], (10, 12)), IMG)
    assert size == (10, 12) and np.array_equal(out, IMG[:10, :12])


def test_something_neither_transform_nor_callable_is_refused():
    with pytest.raises(TypeError, match="neither a feeder transform nor callable"):
        Chain([ops.CenterCrop(8), 42], None)


def test_variable_sizes_are_placed_top_left_and_their_size_returned():
    chain = Chain([ops.Resize(20)], None, max_image_size=(40, 40), size_divisibility=16)
    assert chain.image_size == (48, 48) and chain.max_image_size == (40, 40)  # rounded up to 16
    out, size = run(chain, IMG)
    want = one_by_one([ops.Resize(20)], IMG)
    assert size == want.shape[:2] == (20, 26)
    assert np.abs(out[:20, :26].astype(int) - want.astype(int)).max() <= 1
    assert not out[20:].any() and not out[:, 26:].any()
    with pytest.raises(ValueError, match="above max_pixels"):
        Chain([ops.Resize(20)], None, max_pixels=100, max_image_size=(40, 40))


def test_a_sample_transform_sees_and_returns_the_fields():
    seen = []

    @ops.SampleTransform
    def drop_right_half(sample, rng):
        seen.append(sorted(sample))
        img = sample["image"]
        w = img.shape[1] // 2
        boxes = sample["boxes"].copy()
        boxes[:, 2] = np.minimum(boxes[:, 2], w)
        return {**sample, "image": np.ascontiguousarray(img[:, :w]), "boxes": boxes}

    chain = Chain([drop_right_half], (60, 40))
    assert chain.takes_samples
    out = np.zeros((60, 40, 3), np.uint8)
    fields = {"boxes": np.array([[10, 5, 70, 30]], np.float32), "label": np.asarray(3, np.int64)}
    got = chain.run_fields(IMG, 1, SampleContext((60, 80)), out, fields, Geometry(1.0, 0.0, 1.0, 0.0, 60, 80))
    assert seen == [["boxes", "image", "label"]]
    assert got["boxes"].tolist() == [[10, 5, 40, 30]] and got["label"] == 3
    assert np.array_equal(out, IMG[:, :40])


def test_a_resize_after_an_undeclared_size_change_sizes_what_it_returned():
    """A callable or sample transform that changes the size without declaring it
    (cutting a 60x80 image to its left 60x40): a Resize(shorter side) after it
    sizes the image it returned, not the decoded one the context describes."""
    def left_half(img, rng):
        return np.ascontiguousarray(img[:, :40])

    @ops.SampleTransform
    def left_half_sample(sample, rng):
        boxes = sample["boxes"].copy()
        boxes[:, 2] = np.minimum(boxes[:, 2], 40)
        return {**sample, "image": np.ascontiguousarray(sample["image"][:, :40]), "boxes": boxes}

    want = one_by_one([ops.Resize(30)], np.ascontiguousarray(IMG[:, :40]))
    assert want.shape[:2] == (45, 30)
    chain = Chain([left_half, ops.Resize(30)], None, max_image_size=(80, 80))
    out, size = run(chain, IMG)
    assert size == (45, 30)
    assert np.array_equal(out[:45, :30], want)
    chain = Chain([left_half_sample, ops.Resize(30)], None, max_image_size=(80, 80))
    out = np.zeros((*chain.image_size, 3), np.uint8)
    fields = {"boxes": np.array([[4, 6, 20, 30]], np.float32)}
    got, size = chain.run_fields_sized(IMG, 1, SampleContext((60, 80)), out, fields,
                                       Geometry(1.0, 0.0, 1.0, 0.0, 60, 80))
    assert size == (45, 30)
    assert np.array_equal(out[:45, :30], want)
    np.testing.assert_allclose(got["boxes"], [[3, 4.5, 15, 22.5]])


def test_a_sample_transform_that_changes_the_fields_is_a_config_error():
    @ops.SampleTransform
    def rename(sample, rng):
        return {"image": sample["image"], "cls": sample["label"]}

    @ops.SampleTransform
    def widen(sample, rng):
        return {**sample, "label": np.zeros(3)}

    @ops.SampleTransform
    def bad_mask(sample, rng):
        return {**sample, "mask": np.zeros((2, 2), np.uint8)}

    out = np.zeros((60, 80, 3), np.uint8)
    geometry = Geometry(1.0, 0.0, 1.0, 0.0, 60, 80)
    with pytest.raises(ConfigError, match=r"returned the fields \['cls', 'image'\]"):
        Chain([rename], (60, 80)).run_fields(IMG, 1, SampleContext((60, 80)), out,
                                             {"label": np.asarray(1, np.int64)}, geometry)
    with pytest.raises(ConfigError, match="changed field 'label' from int64 of shape"):
        Chain([widen], (60, 80)).run_fields(IMG, 1, SampleContext((60, 80)), out,
                                            {"label": np.asarray(1, np.int64)}, geometry)
    with pytest.raises(FieldError, match="not a uint8/uint16 array of the image's size"):
        Chain([bad_mask], (60, 80)).run_fields(IMG, 1, SampleContext((60, 80)), out,
                                               {"mask": np.zeros((60, 80), np.uint8)}, geometry)
