"""Transforms: torchvision semantics, determinism, writing into the buffer slot."""

from __future__ import annotations

import inspect
import math

import cv2
import numpy as np
import pytest

from feeder import SampleRNG, ops
from feeder.ops.chain import Chain
from feeder.ops import SampleContext
from feeder.synthetic import make_image

IMG = make_image(120, 200, 5)


def test_random_resized_crop_params_obey_scale_and_ratio():
    t = ops.RandomResizedCrop(32, scale=(0.2, 0.6), ratio=(0.5, 2.0))
    for k in range(300):
        top, left, h, w = t.params(120, 200, SampleRNG(k))
        assert 0 <= top <= 120 - h and 0 <= left <= 200 - w
        area = h * w / (120 * 200)
        assert 0.2 * 0.9 <= area <= 0.6 * 1.1  # rounding of h and w
        assert 0.5 * 0.85 <= w / h <= 2.0 * 1.15


@pytest.mark.parametrize("in_c", [True, False])
@pytest.mark.parametrize("scale, ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (0.1, 10.0)),
                                          ((0.99, 1.0), (0.2, 0.25))])
def test_random_resized_crop_params_draw_as_the_rng_methods_do(scale, ratio, in_c, monkeypatch):
    """params() spells SampleRNG's draws out on its state, in C when the extension
    is built (rrc_draws) and in Python when not: the same boxes, the same state
    after, as through uniform() and integers() (a subclass's)."""
    from feeder.ops import resize

    if in_c and resize._native_draws is None:
        pytest.skip("the extension feeder.decode._jpeg (with rrc_draws) is not built")
    if not in_c:
        monkeypatch.setattr(resize, "_native_draws", None)

    class Drawn(SampleRNG):
        __slots__ = ()

    t = ops.RandomResizedCrop(64, scale=scale, ratio=ratio)
    rnd = np.random.default_rng(0)
    for k in range(3000):
        h, w = (int(v) for v in rnd.integers(1, 400, 2))
        fast, drawn = SampleRNG(k * 7919, k % 3), Drawn(k * 7919, k % 3)
        if k % 2:
            fast.random(), drawn.random()  # a stream already drawn from
        assert t.params(h, w, fast) == t.params(h, w, drawn)
        assert fast.random() == drawn.random()


def test_random_resized_crop_fallback_is_central_crop():
    # No crop of scale 0.9..1.0 with ratio 3..4 fits a square: torchvision falls back.
    t = ops.RandomResizedCrop(16, scale=(0.9, 1.0), ratio=(3.0, 4.0))
    assert t.params(100, 100, SampleRNG(1)) == (33, 0, 33, 100)


def test_random_resized_crop_output_and_out_buffer():
    t = ops.RandomResizedCrop((24, 40))
    out = np.zeros((24, 40, 3), np.uint8)
    r = t.apply(IMG, SampleRNG(3), out=out)
    assert r is out and out.any()
    np.testing.assert_array_equal(t(IMG, SampleRNG(3)), out)  # same rng stream, same result


def test_reduced_scale_input_uses_the_same_crop():
    t = ops.RandomResizedCrop(32, scale=(0.5, 0.5), ratio=(1.0, 1.0))
    half = cv2.resize(IMG, (100, 60), interpolation=cv2.INTER_AREA)  # as a 1/2-scale decode
    for k in range(8):
        full_out = t(IMG, SampleRNG(k)).astype(int)
        half_out = t.apply(half, SampleRNG(k), ctx=SampleContext((120, 200))).astype(int)
        other = t(IMG, SampleRNG(k + 1000)).astype(int)  # another crop of the same image
        # Same box of the same scene: close (sub-pixel sampling differs), and far
        # closer than a different box.
        err = np.abs(full_out - half_out).mean()
        assert err < 10 and err < 0.5 * np.abs(full_out - other).mean()


def test_decode_hint_keeps_crop_at_least_output_size():
    t = ops.RandomResizedCrop(224)
    for k in range(200):
        need = t.decode_hint(1100, 1500, SampleRNG(k))
        top, left, h, w = t.params(1100, 1500, SampleRNG(k))
        assert need[0] <= 1100 and need[1] <= 1500
        # At a scale s >= need/full the crop is still >= 224 px (or the full size is needed).
        assert h * need[0] / 1100 >= 224 - 1 or need[0] == 1100
        assert w * need[1] / 1500 >= 224 - 1 or need[1] == 1500


def test_resize_shorter_side_and_exact():
    assert ops.Resize(60)(IMG, SampleRNG(0)).shape == (60, 100, 3)
    assert ops.Resize(60)(IMG.transpose(1, 0, 2), SampleRNG(0)).shape == (100, 60, 3)
    assert ops.Resize((30, 50))(IMG, SampleRNG(0)).shape == (30, 50, 3)


def test_center_crop_and_padding():
    c = ops.CenterCrop(50)(IMG, SampleRNG(0))
    np.testing.assert_array_equal(c, IMG[35:85, 75:125])
    padded = ops.CenterCrop(150)(IMG, SampleRNG(0))
    assert padded.shape == (150, 150, 3)
    assert (padded[:15] == 0).all() and (padded[-15:] == 0).all()


def test_flip_probability_and_inplace():
    f = ops.RandomHorizontalFlip(0.5)
    flips = sum(not np.array_equal(f(IMG, SampleRNG(k)), IMG) for k in range(400))
    assert 150 < flips < 250
    always = ops.RandomHorizontalFlip(1.0)
    buf = IMG.copy()
    always.apply(buf, SampleRNG(0), out=buf)
    np.testing.assert_array_equal(buf, IMG[:, ::-1])


@pytest.mark.parametrize("bad", [
    lambda: ops.RandomResizedCrop(0), lambda: ops.RandomResizedCrop(8, scale=(0.5, 0.1)),
    lambda: ops.RandomResizedCrop(8, ratio=(0, 1)), lambda: ops.Resize(-1),
    lambda: ops.CenterCrop((1, 2, 3)), lambda: ops.RandomHorizontalFlip(2.0),
    lambda: ops.Resize(10, interpolation="magic"),
])
def test_invalid_arguments(bad):
    with pytest.raises(ValueError):
        bad()


def test_chain_splits_writer_and_inplace_tail():
    chain = Chain([ops.RandomResizedCrop(16), ops.RandomHorizontalFlip(1.0)], None)
    out = np.zeros((16, 16, 3), np.uint8)
    chain.run(IMG, 5, SampleContext((120, 200)), out)
    expect = ops.RandomResizedCrop(16).apply(IMG, SampleRNG(5, 0), ctx=SampleContext((120, 200)))
    np.testing.assert_array_equal(out, expect[:, ::-1])


def test_chain_only_flips_needs_image_size_and_copies():
    with pytest.raises(ValueError, match="image_size"):
        Chain([ops.RandomHorizontalFlip()], None)
    chain = Chain([ops.RandomHorizontalFlip(0.0)], (120, 200))
    out = np.zeros_like(IMG)
    chain.run(IMG, 1, SampleContext((120, 200)), out)
    np.testing.assert_array_equal(out, IMG)


def test_chain_hint_only_from_leading_builtin():
    assert Chain([ops.RandomHorizontalFlip(), ops.RandomResizedCrop(8)], None).plan is not None
    assert Chain([lambda i, r: i, ops.RandomResizedCrop(8)], None).plan is None
    assert Chain([lambda i, r: i, ops.CenterCrop(8)], None).plan is None
    # CenterCrop needs the full resolution (no hint) but reads only its box, which
    # a region decoder can use: it plans, with no reduced size and the centre box.
    need, ctx = Chain([ops.CenterCrop(8)], None).plan(20, 30, 0)
    assert need is None and ctx.box == (6, 11, 8, 8)
    # A region only for the first step: a flip before the crop must see the whole image.
    need, ctx = Chain([ops.RandomHorizontalFlip(), ops.RandomResizedCrop(8)], None).plan(20, 30, 0)
    assert need is not None and ctx.box is None


def test_sample_rng_is_deterministic_and_in_range():
    a, b = SampleRNG(42, 1), SampleRNG(42, 1)
    assert [a.random() for _ in range(5)] == [b.random() for _ in range(5)]
    assert SampleRNG(42, 1).random() != SampleRNG(42, 2).random()
    r = SampleRNG(7)
    xs = [r.random() for _ in range(2000)]
    assert 0 <= min(xs) and max(xs) < 1 and abs(sum(xs) / 2000 - 0.5) < 0.03
    ints = {r.integers(3, 7) for _ in range(500)}
    assert ints == {3, 4, 5, 6}
    assert 2.0 <= r.uniform(2, 3) < 3
    assert 0.5 <= r.log_uniform(0.5, 2.0) <= 2.0
    assert isinstance(r.numpy().integers(0, 10), (int, np.integer))
    with pytest.raises(ValueError):
        r.integers(5, 5)
    assert math.isfinite(r.random())


# -- every configuration number of every op is checked at construction ---------------

INF, NAN = float("inf"), float("nan")

# What each op needs besides its defaults, to be built at all; a new op with a
# required parameter must be added here (the test says so).
REQUIRED = {
    "RandomResizedCrop": {"size": 8}, "Resize": {"size": 8}, "CenterCrop": {"size": 8},
    "RandomCrop": {"size": 8}, "RandomResize": {"min_size": 8}, "ScaleJitter": {"target_size": (64, 64)},
    "RandomShortestSize": {"min_size": 8}, "MixUp": {"alpha": 0.2, "num_classes": 3},
    "CutMix": {"alpha": 0.2, "num_classes": 3},
    "Albumentations": {"compose": "albumentations"}, "Kornia": {"module": "kornia"},
    "SampleTransform": {"fn": lambda sample, rng: sample},
}
# Not configurable ops: the protocol's classes.
NOT_OPS = {"Geometry", "Transform"}
# Parameters that take a range (min, max) besides the ones whose default is one,
# and parameters without a numeric default that take a number, with a good value.
MORE = {
    ("ColorJitter", "brightness"): (0.5, 1.5), ("ColorJitter", "contrast"): (0.5, 1.5),
    ("ColorJitter", "saturation"): (0.5, 1.5), ("ColorJitter", "hue"): (-0.1, 0.1),
    ("Resize", "max_size"): 16, ("RandomResize", "max_size"): 16, ("RandomResize", "max_long"): 32,
    ("RandomShortestSize", "max_size"): 16, ("RandomCrop", "padding"): 2,
    ("Albumentations", "output_size"): (8, 8), ("SampleTransform", "output_size"): (8, 8),
}
# Parameters where a negative number (or a negative lower bound) is meaningful.
NEGATIVE_OK = {("RandomErasing", "value"), ("ColorJitter", "hue"), ("RandomPhotometricDistort", "hue")}


def _stand_in(value):
    if value == "albumentations":
        A = pytest.importorskip("albumentations")
        return A.Compose([A.HorizontalFlip()])
    if value == "kornia":
        K = pytest.importorskip("kornia.augmentation")
        return K.ColorJiggle(0.1)
    return value


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cases():
    """(op, parameter, bad value) for every numeric parameter of every op in ops.__all__."""
    cases = []
    for name in ops.__all__:
        cls = getattr(ops, name)
        if not isinstance(cls, type) or name in NOT_OPS:
            continue
        for p in list(inspect.signature(cls).parameters.values()):
            good = MORE.get((name, p.name), p.default)
            if good is inspect.Parameter.empty:
                good = REQUIRED.get(name, {}).get(p.name, inspect.Parameter.empty)
            assert good is not inspect.Parameter.empty, f"add ops.{name}'s {p.name} to REQUIRED"
            if isinstance(good, tuple) and len(good) == 2 and all(_is_number(v) for v in good):
                lo, hi = good
                bad = [(lo, INF), (NAN, hi), (lo, NAN), (-INF, hi), (lo, hi, hi), (lo,)]
                if lo != hi:
                    bad.append((hi, lo))
                if (name, p.name) not in NEGATIVE_OK:
                    bad.append((-1, hi))
            elif _is_number(good):
                bad = [INF, NAN, -INF] + ([-1] if (name, p.name) not in NEGATIVE_OK else [])
            else:
                continue
            cases += [pytest.param(name, p.name, b, id=f"{name}-{p.name}-{b!r}") for b in bad]
    return cases


def _build(name, **overrides):
    kwargs = {k: _stand_in(v) for k, v in REQUIRED.get(name, {}).items()}
    kwargs.update(overrides)
    return getattr(ops, name)(**kwargs)


def test_every_op_builds_with_the_table_values():
    for name in ops.__all__:
        if isinstance(getattr(ops, name), type) and name not in NOT_OPS:
            _build(name)


@pytest.mark.parametrize("name, param, bad", _cases())
def test_every_op_refuses_infinite_nan_reversed_and_malformed_ranges(name, param, bad):
    # Accepted, such a value fails every sample at run time: with on_error="skip"
    # a typo in the configuration would silently empty the epoch.
    with pytest.raises(ValueError) as info:
        _build(name, **{param: bad})
    assert repr(bad) in str(info.value), str(info.value)
    assert name in str(info.value)


def _flag_cases():
    """(op, parameter, bad value) for every switch (a parameter whose default is a
    bool) of every op in ops.__all__."""
    cases = []
    for name in ops.__all__:
        cls = getattr(ops, name)
        if not isinstance(cls, type) or name in NOT_OPS:
            continue
        for p in inspect.signature(cls).parameters.values():
            if isinstance(p.default, bool):
                cases += [pytest.param(name, p.name, b, id=f"{name}-{p.name}-{b!r}")
                          for b in ("False", 0, None)]
    return cases


@pytest.mark.parametrize("name, param, bad", _flag_cases())
def test_every_op_refuses_a_switch_that_is_not_a_bool(name, param, bad):
    # "False" is truthy: accepted, it would silently turn the switch on.
    with pytest.raises(ValueError) as info:
        _build(name, **{param: bad})
    assert repr(bad) in str(info.value) and name in str(info.value) and param in str(info.value)


@pytest.mark.parametrize("make, bad", [
    (lambda: ops.RandomIoUCrop(sampler_options=(0.0, NAN, 1.0)), "nan"),  # NaN: any crop passes
    (lambda: ops.RandomIoUCrop(sampler_options=(0.0, 2.0)), "2.0"),
    (lambda: ops.RandomIoUCrop(sampler_options=0.5), "0.5"),
    (lambda: ops.RandomErasing(value=(0.0, INF, 0.0)), "inf"),
    (lambda: ops.Resize(8.5), "8.5"),
    (lambda: ops.RandomResizedCrop((8, 8.7)), "8.7"),
])
def test_lists_and_fractional_sizes_are_refused_naming_the_value(make, bad):
    with pytest.raises(ValueError) as info:
        make()
    assert bad in str(info.value)
