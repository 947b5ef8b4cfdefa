"""Hostile configurations and inputs: transforms that would blow up an image,
configuration mistakes that must never pass for bad files, options that would
produce garbage, and the precision of low-precision normalization."""

from __future__ import annotations

import os
import tracemalloc
from dataclasses import fields

import numpy as np
import pytest
import torch

from tests.support import MemorySource, drain, encode_png
from feeder import ConfigError, Feeder, SampleError, SampleRNG, TransformError, ops
from feeder.engine.config import Config
from feeder.ops.chain import Chain
from feeder.ops import SampleContext
from feeder.ops.fused import ResizeCenterCrop
from feeder.synthetic import make_image


def noise(h: int, w: int, seed: int) -> np.ndarray:
    # Noise, not a smooth picture: any misplaced sampling position shows.
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def run_chain(transforms, img, image_size=None, max_pixels=1 << 28, key=3):
    chain = Chain(transforms, image_size, max_pixels)
    out = np.zeros(chain.image_size + (3,), np.uint8)
    chain.run(img, key, SampleContext(img.shape[:2]), out)
    return out


def naive(transforms, img, key=3):
    for i, t in enumerate(transforms):
        img = t(img, SampleRNG(key, i))
    return img


# -- Resize(int) + CenterCrop computes only what it keeps -----------------------------------

@pytest.mark.parametrize("interpolation", ["bilinear", "nearest", "bicubic", "area", "lanczos"])
@pytest.mark.parametrize("shape", [(120, 200), (375, 500), (500, 375), (60, 70), (3, 400), (1000, 1500)])
@pytest.mark.parametrize("size, crop", [(256, 224), (64, 48), (100, (120, 90)), (50, 50)])
def test_fused_resize_center_crop_matches_resize_then_crop(interpolation, shape, size, crop):
    img = make_image(*shape, seed=shape[0])
    ts = [ops.Resize(size, interpolation=interpolation), ops.CenterCrop(crop)]
    got = run_chain(ts, img).astype(int)
    want = naive(ts, img).astype(int)
    assert got.shape == want.shape
    diff = np.abs(got - want)
    # Only the rounding of interpolation weights differs (Lanczos' the most).
    assert diff.mean() < 0.4 and diff.max() <= 8, (diff.mean(), diff.max())


def test_fused_padding_is_center_crops_zero_border():
    img = noise(60, 80, 1)
    ts = [ops.Resize(32), ops.CenterCrop((48, 50))]  # resized to 32x42: padded both ways
    got, want = run_chain(ts, img).astype(int), naive(ts, img).astype(int)
    np.testing.assert_array_equal(got == 0, want == 0)
    assert (got[:8] == 0).all() and (got[40:] == 0).all() and (got[:, :4] == 0).all()
    assert np.abs(got - want).max() <= 2


def test_chain_fuses_the_pair_keeping_hint_positions_and_the_buffer():
    ts = [ops.Resize(40), ops.CenterCrop(32), ops.RandomHorizontalFlip(0.5)]
    chain = Chain(ts, None)
    assert chain.image_size == (32, 32)
    assert isinstance(chain._writer[1], ResizeCenterCrop)
    # Reduced-scale JPEG decoding is still asked for the Resize target.
    assert chain.plan(1200, 1600, 1)[0] == (40, 53)
    img = noise(120, 160, 2)
    out = np.zeros((32, 32, 3), np.uint8)
    # The flip keeps its position in the list (stream 2): the same flips as unfused.
    for key in range(8):
        chain.run(img, key, SampleContext((120, 160)), out)
        want = naive(ts, img, key)
        assert np.abs(out.astype(int) - want.astype(int)).max() <= 3


@pytest.mark.parametrize("big_shape, center, axis", [((2, 60000), 30000, 1), ((10000, 1), 5000, 0)])
def test_elongated_png_through_resize_center_crop_is_delivered(big_shape, center, axis):
    big = noise(*big_shape, seed=5)
    # An analogous small image: the same pixels around the centre, at the same
    # scale (the shorter side stays), so its slow resize-then-crop is the reference.
    k = 50
    sl = [slice(None), slice(None)]
    sl[axis] = slice(center - k, center + k)
    small = big[tuple(sl)]
    ts = [ops.Resize(256), ops.CenterCrop(224)]
    want = naive(ts, small)
    src = MemorySource([encode_png(big), encode_png(big)])
    with Feeder(src, 2, ts, seed=0, decode_threads=1, augment_threads=0) as f:
        batches, err = drain(f)
    assert err is None, err
    (images, _), = batches
    for img in images:
        diff = np.abs(img.transpose(1, 2, 0).astype(int) - want.astype(int))
        assert diff.max() <= 2, diff.max()


def test_resize_over_max_pixels_raises_before_computing():
    src = MemorySource([encode_png(noise(2, 3000, 1))], names=["thin.png"])
    with Feeder(src, 1, [ops.Resize(256)], image_size=(224, 224), max_pixels=10**6,
                on_error="raise", decode_threads=1) as f:
        _, err = drain(f)
    assert isinstance(err, SampleError) and err.path == "thin.png"
    assert isinstance(err.__cause__, TransformError), repr(err.__cause__)
    msg = str(err.__cause__)
    assert "Resize(256" in msg and "max_pixels=1000000" in msg
    assert "(256, 384000) image (height, width)" in msg


def test_resize_of_a_huge_target_allocates_nothing_large():
    # 2x60000 resized to a 256 shorter side: 256x7680000, about 5.9 GB of RGB.
    img = noise(2, 60000, 1)
    tracemalloc.start()
    try:
        with pytest.raises(TransformError, match=r"Resize\(256.*\(256, 7680000\) image "
                                                     r"\(height, width\).*max_pixels"):
            run_chain([ops.Resize(256), ops.RandomHorizontalFlip()], img, image_size=(256, 256))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, peak


def test_user_transform_over_max_pixels_is_reported_after_it_runs():
    def grow(img, rng):
        return np.zeros((2000, 2000, 3), np.uint8)
    with pytest.raises(TransformError, match=r"grow produced a \(2000, 2000\) image "
                                             r"\(height, width\).*max_pixels=1000000"):
        run_chain([grow, ops.CenterCrop(16)], noise(20, 20, 0), max_pixels=10**6)


def test_fixed_output_over_max_pixels_rejected_at_construction():
    with pytest.raises(ValueError, match="max_pixels"):
        Chain([ops.RandomResizedCrop(2000)], None, 10**6)
    with pytest.raises(ValueError, match="max_pixels"):
        Chain([], (2000, 2000), 10**6)


# -- configuration mistakes are errors, never skips ---------------------------------------

@pytest.mark.parametrize("bad", [(0, 32), (32, -1), (32.5, 32), (True, 32), True, 224, "32x32", (32,),
                                 (32, 32, 3), None.__class__])
def test_image_size_must_be_two_positive_ints(source, bad):
    with pytest.raises(ValueError, match=r"image_size must be \(height, width\), two positive ints"):
        Feeder(source, 4, [ops.RandomHorizontalFlip()], image_size=bad)


def test_a_transform_class_or_one_transform_is_refused_at_construction(source):
    # A class is callable, so it would be taken for fn(img, rng) and constructed
    # with an image at the first batch; one transform is not a list of them.
    with pytest.raises(TypeError, match=r"RandomHorizontalFlip is a class, not a transform: "
                                        r"write RandomHorizontalFlip\(\.\.\.\)"):
        Feeder(source, 4, [ops.RandomResizedCrop(16), ops.RandomHorizontalFlip])
    with pytest.raises(TypeError, match=r"batch_transforms\[0\]: MixUp is a class"):
        Feeder(source, 4, [ops.RandomResizedCrop(16)], batch_transforms=[ops.MixUp])
    for one in (ops.RandomResizedCrop(16), lambda img, rng: img, "flip"):
        with pytest.raises(TypeError, match="transforms must be a list of transforms"):
            Feeder(source, 4, one)
    # A lone torchvision pipeline is told what replaces it, not to wrap it in a list.
    compose = type("Compose", (), {"__module__": "torchvision.transforms.transforms",
                                   "__call__": lambda self, img: img})()
    with pytest.raises(TypeError, match=r"is a torchvision transform \(torchvision\.transforms"):
        Feeder(source, 4, compose)


@pytest.mark.skipif(not hasattr(os, "sysconf"), reason="the machine's memory is read by os.sysconf")
def test_a_batch_larger_than_the_machine_is_refused_at_construction(source):
    # Its buffer is allocated at the first pass; the size is known now.
    with pytest.raises(ValueError, match=r"batch_size=1000000000000 of 32x32 images needs "
                                         r"[\d,.]+ GiB for one batch buffer, more than this "
                                         r"machine's [\d,.]+ GiB of memory"):
        Feeder(source, 10**12, [ops.Resize((32, 32))])


def test_image_size_accepts_numpy_ints(source):
    with Feeder(source, 4, [ops.RandomHorizontalFlip()], image_size=(np.int64(32), 40)) as f:
        assert f.image_size == (32, 40) and type(f.image_size[0]) is int


def _sized_source(shapes):
    blobs = [encode_png(make_image(h, w, seed=i)) for i, (h, w) in enumerate(shapes)]
    return MemorySource(blobs, names=[f"img{i}.png" for i in range(len(shapes))])


@pytest.mark.parametrize("transforms", [[], [ops.RandomHorizontalFlip()], [lambda img, rng: img]])
def test_wrong_size_without_resize_is_raised_under_skip(transforms):
    src = _sized_source([(48, 64)] * 6)
    with Feeder(src, 3, transforms, image_size=(32, 32), on_error="skip", shuffle=False,
                decode_threads=1) as f:
        batches, err = drain(f)
        skipped = f.stats().skipped
    assert batches == [] and skipped == 0
    assert isinstance(err, SampleError) and isinstance(err.__cause__, ConfigError), repr(err)
    msg = str(err)
    assert f"img{err.index}.png" in msg and "image_size=(32, 32)" in msg and "(48, 64) (height, width" in msg
    assert "Resize" in msg


def test_mixed_sizes_under_skip_raise_at_the_first_mismatch():
    shapes = [(32, 32)] * 5 + [(48, 64)] + [(32, 32)] * 4 + [(48, 64)] * 2
    src = _sized_source(shapes)
    with Feeder(src, 5, [ops.RandomHorizontalFlip()], image_size=(32, 32), on_error="skip",
                shuffle=False, decode_threads=1, augment_threads=0) as f:
        batches, err = drain(f)
        skipped = f.stats().skipped
    assert skipped == 0
    assert isinstance(err, SampleError) and isinstance(err.__cause__, ConfigError), repr(err)
    assert err.index == 5 and err.path == "img5.png"
    assert len(batches) == 1  # the first batch, all 32x32, came through whole


def test_user_transform_of_wrong_size_for_one_sample_is_raised_under_skip():
    def shrink_third(img, rng):
        return img[:10, :10] if img[0, 0, 0] == 3 else img
    imgs = [np.full((32, 32, 3), i, np.uint8) for i in range(6)]
    src = MemorySource([encode_png(i) for i in imgs])
    with Feeder(src, 2, [shrink_third], image_size=(32, 32), on_error="skip", shuffle=False,
                decode_threads=1) as f:
        _, err = drain(f)
    assert isinstance(err, SampleError) and isinstance(err.__cause__, ConfigError) and err.index == 3
    assert "shrink_third" in str(err)


# -- options that would produce garbage are rejected ----------------------------------------

@pytest.mark.parametrize("option, value", [
    ("dtype", torch.int8), ("dtype", torch.int32), ("dtype", torch.int64), ("dtype", torch.bool),
    ("dtype", torch.complex64), ("dtype", "float16"), ("dtype", np.float32),
    ("normalize", ((0.5, 0.5, 0.5), (0.2, 0.0, 0.2))),
    ("normalize", ((0.5, 0.5, 0.5), (0.2, float("nan"), 0.2))),
    ("normalize", ((0.5, float("nan"), 0.5), (0.2, 0.2, 0.2))),
    ("normalize", ((0.5, 0.5, float("inf")), (0.2, 0.2, 0.2))),
    ("shuffle", "False"), ("shuffle", 0), ("shuffle", None), ("drop_last", "no"), ("drop_last", 1),
    ("ordered", 0), ("ordered", "True"),
    ("seed", 2**64), ("seed", -1), ("seed", 1.5), ("seed", True), ("seed", "0"),
    ("memory_format", "nchw"), ("memory_format", torch.preserve_format), ("memory_format", None),
    ("memory_format", ["contiguous"]),
])
def test_bad_option_rejected_naming_it(source, option, value):
    with pytest.raises(ValueError, match=option) as info:
        Feeder(source, 4, [ops.CenterCrop(16)], **{option: value})
    shown = str(info.value)
    assert repr(value) in shown or str(value) in shown or option == "normalize"


@pytest.mark.parametrize("std, dtype, words", [
    (1e-300, torch.float32, "std 1e-300 of channel 1"),   # 0 in float32
    (1e-40, torch.float32, "std 1e-40 of channel 1"),     # a float32 denormal
    (-1e-300, torch.float16, "std -1e-300 of channel 1"),
    (1e39, torch.float32, "std 1e+39 of channel 1"),      # 1 / std underflows in float32
    (1e-6, torch.float16, "channel 1 maps"),               # values up to 5e5: inf in float16
    (0.0, torch.float64, "std of channel 1"),
    (float("inf"), torch.float32, "std of channel 1"),
    (float("nan"), torch.float32, "std of channel 1"),
])
def test_normalize_std_that_gives_inf_or_nan_is_refused_naming_the_channel(source, std, dtype, words):
    with pytest.raises(ValueError, match="normalize") as info:
        Feeder(source, 4, [ops.CenterCrop(16)], dtype=dtype,
               normalize=((0.5, 0.5, 0.5), (0.2, std, 0.2)))
    assert words in str(info.value)


def test_normalize_mean_not_finite_names_the_channel(source):
    with pytest.raises(ValueError, match="mean of channel 2 must be finite"):
        Feeder(source, 4, [ops.CenterCrop(16)], normalize=((0.5, 0.5, float("-inf")), (0.2,) * 3))


def test_normalize_tiny_std_is_accepted_where_the_dtype_holds_it(source):
    # 1e-300 is a normal float64: a float64 feeder computes in float64 and holds the result.
    with Feeder(source, 4, [ops.CenterCrop(16)], dtype=torch.float64, seed=0,
                normalize=((0.5, 0.5, 0.5), (0.2, 1e-300, 0.2))) as f:
        batches, err = drain(f, limit=1)
    assert err is None and np.isfinite(batches[0][0]).all()


@pytest.mark.parametrize("option, value", [
    ("dtype", torch.uint8), ("dtype", torch.float16), ("dtype", torch.bfloat16),
    ("dtype", torch.float32), ("dtype", torch.float64), ("shuffle", np.bool_(False)),
    ("drop_last", np.True_), ("ordered", False), ("seed", 2**64 - 1), ("seed", 0),
    ("memory_format", "contiguous"), ("memory_format", torch.contiguous_format),
    ("memory_format", "channels_last"), ("memory_format", torch.channels_last),
])
def test_good_option_accepted(source, option, value):
    with Feeder(source, 4, [ops.CenterCrop(16)], **{option: value}) as f:
        batches, err = drain(((x.float(), y) for x, y in f), limit=1)  # numpy has no bfloat16
    assert err is None and len(batches) == 1


def test_flags_keep_their_meaning(source):
    with Feeder(source, 4, [ops.CenterCrop(16)], shuffle=np.bool_(False), seed=1) as f:
        batches, err = drain(f)
    assert err is None
    assert [int(v) for _, y in batches for v in y] == list(range(len(source)))


# -- every Feeder option refuses inf, NaN and negative numbers, naming the value -------------

@pytest.mark.parametrize("option", ["batch_size", *(f.name for f in fields(Config) if f.name != "batch_size")])
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), float("-inf"), -1])
def test_every_feeder_option_refuses_non_finite_and_negative_numbers(source, option, bad):
    # Accepted at construction, such a value would fail every sample (or every batch).
    if option == "batch_size":
        make = lambda: Feeder(source, bad, [ops.CenterCrop(16)])  # noqa: E731
    else:
        make = lambda: Feeder(source, 4, [ops.CenterCrop(16)], **{option: bad})  # noqa: E731
    with pytest.raises(ValueError) as info:
        make()
    assert option in str(info.value) and repr(bad) in str(info.value), str(info.value)
