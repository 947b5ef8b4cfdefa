"""Batch transforms (``Feeder(batch_transforms=...)``): MixUp and CutMix against
their formulas, per-batch seeding, determinism across thread counts, and the
errors for a uint8 feeder and out-of-range labels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.support import MemorySource, collect, drain
from tests.support.faults import feeder_factory
from feeder import ConfigError, Feeder, FeederError, ops
from feeder.sample.rng import batch_generator

AUG = [ops.RandomResizedCrop(16), ops.RandomHorizontalFlip()]
NUM_CLASSES = 5


@pytest.fixture
def small(jpeg_blobs):
    return MemorySource(list(jpeg_blobs[:24]), labels=[i % NUM_CLASSES for i in range(24)])


make = feeder_factory(8, AUG, seed=3, dtype=torch.float32, decode_threads=2, augment_threads=0)


def reference_lam(alpha: float, gen: torch.Generator) -> float:
    """Beta(alpha, alpha) as G1 / (G1 + G2), the documented draw."""
    g = torch._standard_gamma(torch.full((2,), alpha, dtype=torch.float64), generator=gen)
    return float(g[0] / g.sum())


def reference_targets(labels, lam: float, smoothing: float, num_classes: int) -> np.ndarray:
    off = smoothing / num_classes
    on = 1.0 - smoothing + off
    one_hot = np.full((len(labels), num_classes), off)
    one_hot[np.arange(len(labels)), np.asarray(labels)] = on
    return lam * one_hot + (1.0 - lam) * one_hot[::-1]


def batch_of(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(6, 3, 8, 10, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.tensor([0, 3, 9, 3, 1, 7])
    return x, y


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_mixup_matches_formula(smoothing):
    x, y = batch_of()
    op = ops.MixUp(0.4, 10, label_smoothing=smoothing)
    out_x, out_y = op(x, y, torch.Generator().manual_seed(5))
    lam = reference_lam(0.4, torch.Generator().manual_seed(5))
    assert 0.0 < lam < 1.0
    np.testing.assert_allclose(out_x.numpy(), lam * x.numpy() + (1 - lam) * x.numpy()[::-1],
                               rtol=1e-6, atol=1e-6)
    assert out_y.dtype == torch.float32 and out_y.shape == (6, 10)
    np.testing.assert_allclose(out_y.numpy(), reference_targets(y, lam, smoothing, 10), atol=1e-6)
    np.testing.assert_allclose(out_y.sum(1).numpy(), 1.0, atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_cutmix_matches_formula(seed):
    x, y = batch_of(seed)
    h, w = x.shape[-2:]
    op = ops.CutMix(1.0, 10, label_smoothing=0.1)
    out_x, out_y = op(x, y, torch.Generator().manual_seed(seed))

    gen = torch.Generator().manual_seed(seed)
    ratio = math.sqrt(1.0 - reference_lam(1.0, gen))
    cut_h, cut_w = int(h * ratio), int(w * ratio)
    cy = int(torch.randint(0, h, (), generator=gen))
    cx = int(torch.randint(0, w, (), generator=gen))
    y0, y1 = np.clip([cy - cut_h // 2, cy + cut_h // 2], 0, h)
    x0, x1 = np.clip([cx - cut_w // 2, cx + cut_w // 2], 0, w)
    expected = x.numpy().copy()
    expected[:, :, y0:y1, x0:x1] = x.numpy()[::-1][:, :, y0:y1, x0:x1]
    lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)

    np.testing.assert_array_equal(out_x.numpy(), expected)
    np.testing.assert_allclose(out_y.numpy(), reference_targets(y, lam, 0.1, 10), atol=1e-6)
    np.testing.assert_allclose(out_y.sum(1).numpy(), 1.0, atol=1e-6)
    p = op.params(x.shape, torch.Generator().manual_seed(seed))
    assert [int(p[k]) for k in ("y0", "y1", "x0", "x1")] == [y0, y1, x0, x1]


def test_feeder_mixup_uses_the_batch_generator(small):
    """Each delivered batch is MixUp of the plain batch with the generator of
    (seed, epoch, batch number)."""
    op = ops.MixUp(0.4, NUM_CLASSES)
    with make(small) as f:
        plain, err = drain(f)
    assert err is None
    with make(small, batch_transforms=[op]) as f:
        mixed, err = drain(f)
    assert err is None and len(mixed) == len(plain) == 3
    lams = set()
    for number, ((px, py), (mx, my)) in enumerate(zip(plain, mixed)):
        gen = batch_generator(3, 0, number, 0, torch.device("cpu"))
        ex, ey = op(torch.from_numpy(px), torch.from_numpy(py), gen)
        np.testing.assert_allclose(mx, ex.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(my, ey.numpy(), atol=1e-6)
        np.testing.assert_allclose(my.sum(1), 1.0, atol=1e-6)
        lams.add(round(float(my[0, int(py[0])]), 6))
    assert len(lams) == 3  # one lam per batch


def test_same_output_for_any_thread_count(small):
    chain = [ops.CutMix(1.0, NUM_CLASSES), ops.MixUp(0.2, NUM_CLASSES, label_smoothing=0.1)]
    runs = []
    for threads in (1, 3):
        with make(small, batch_transforms=chain, decode_threads=threads, augment_threads=1,
                  ordered=True) as f:
            batches, err = drain(f)
        assert err is None
        runs.append(batches)
    assert len(runs[0]) == len(runs[1]) == 3
    for (ax, ay), (bx, by) in zip(*runs):
        np.testing.assert_array_equal(ax, bx)
        np.testing.assert_array_equal(ay, by)


def test_generator_differs_per_epoch_and_batch_and_output_is_delivered(small):
    seen = []

    def tag(images, labels, generator):
        assert isinstance(generator, torch.Generator) and generator.device.type == "cpu"
        draw = float(torch.rand((), generator=generator))
        seen.append(draw)
        return images * 0 + draw, labels + 100

    with make(small, batch_transforms=[tag]) as f:
        epochs = []
        for _ in range(2):
            batches, err = drain(f)
            assert err is None
            epochs.append(batches)
    assert len(seen) == 6 and len(set(seen)) == 6  # distinct per (epoch, batch)
    delivered = [float(x.flat[0]) for batches in epochs for x, _ in batches]
    assert delivered == pytest.approx(seen)
    assert all((y >= 100).all() for batches in epochs for _, y in batches)


def test_plain_callable_is_accepted_on_uint8(small):
    def double_labels(images, labels, generator):
        return images, labels * 2

    with make(small, dtype=None, batch_transforms=[double_labels]) as f:
        batches, err = drain(f)
    assert err is None
    assert batches[0][0].dtype == np.uint8
    assert sorted(int(v) for _, y in batches for v in y) == sorted(2 * (i % NUM_CLASSES)
                                                                  for i in range(24))


@pytest.mark.parametrize("op", [ops.MixUp(1.0, NUM_CLASSES), ops.CutMix(1.0, NUM_CLASSES)])
def test_uint8_feeder_refuses_float_transform(small, op):
    with pytest.raises(ValueError, match=rf"{type(op).__name__}\(.*needs floating images"):
        make(small, dtype=None, batch_transforms=[op])


@pytest.mark.parametrize("bad", ["mixup", [1], 3])
def test_batch_transforms_option_checked(small, bad):
    with pytest.raises(ValueError, match="batch_transforms"):
        make(small, batch_transforms=bad)


@pytest.mark.parametrize("kw", [dict(alpha=0), dict(num_classes=0), dict(label_smoothing=1.0)])
def test_mixing_arguments_checked(kw):
    args = dict(alpha=1.0, num_classes=3, label_smoothing=0.0) | kw
    with pytest.raises(ValueError, match=next(iter(kw))):
        ops.MixUp(**args)


def test_label_out_of_range_names_batch_and_label(jpeg_blobs):
    labels = [i % NUM_CLASSES for i in range(24)]
    labels[11] = 12
    src = MemorySource(list(jpeg_blobs[:24]), labels=labels)
    with make(src, shuffle=False, batch_size=4, batch_transforms=[ops.MixUp(1.0, NUM_CLASSES)]) as f:
        batches, err = drain(f)
    assert isinstance(err, FeederError)
    msg = str(err)
    assert "batch 2 of epoch 0" in msg and "label 12 of sample 11" in msg and "[0, 5)" in msg
    assert "MixUp" in msg
    assert len(batches) == 2


def test_failing_transform_names_batch(small):
    def broken(images, labels, generator):
        raise RuntimeError("boom")

    with make(small, batch_transforms=[broken]) as f:
        batches, err = drain(f)
    assert isinstance(err, FeederError)
    assert "failed on batch 0 of epoch 0" in str(err) and "boom" in str(err)


# -- dict batches with masks and boxes ---------------------------------------------


def colour_of(i: int) -> tuple[int, int, int]:
    return (20 * i + 10, 255 - 20 * i, (60 * i) % 256)


@pytest.fixture(scope="module")
def solid_pngs():
    from tests.support import encode_png
    return [encode_png(np.full((16, 16, 3), colour_of(i), np.uint8)) for i in range(8)]


def masked_source(blobs, boxes: bool = False):
    from tests.support.fields import DictSource

    def make_sample(i):
        # Sample i is one colour and its mask is class i + 1 everywhere: after
        # mixing, a pixel's mask value says which sample its colour must be.
        sample = {"image": blobs[i], "mask": np.full((16, 16), i + 1, np.uint8), "label": i % 5}
        if boxes:
            sample["boxes"] = np.array([[1, 1, 8, 8]], np.float32)
            sample["box_class"] = np.array([i], np.int64)
        return sample
    return DictSource(len(blobs), make_sample)


def test_cutmix_pastes_the_mask_region_with_the_image_region(solid_pngs):
    mixed = 0
    with Feeder(masked_source(solid_pngs), 4, [], image_size=(16, 16), shuffle=False, seed=1, dtype=torch.float32,
                decode_threads=1, batch_transforms=[ops.CutMix(1.0, 5)]) as f:
        batches, err = collect(f)
    assert err is None and len(batches) == 2
    colours = torch.tensor([colour_of(i) for i in range(8)], dtype=torch.float32) / 255
    for b in batches:
        mask = b["mask"]
        assert mask.shape == (4, 16, 16) and mask.dtype == torch.uint8
        for img, m, own in zip(b["image"], mask, b["label"].argmax(1)):
            # Every pixel's colour is the colour of the sample its mask names.
            want = colours[m.long() - 1].permute(2, 0, 1)
            assert torch.allclose(img, want, atol=1e-6)
            mixed += int((m != m.flatten().mode().values).sum() > 0)
    # The transform did paste something (a batch of unmixed masks would pass above too).
    assert mixed > 0


@pytest.mark.parametrize("boxes", [False, True])
def test_mixup_refuses_masks_naming_the_field(solid_pngs, boxes):
    with Feeder(masked_source(solid_pngs, boxes), 4, [], image_size=(16, 16), seed=1, dtype=torch.float32,
                decode_threads=1, batch_transforms=[ops.MixUp(1.0, 5)]) as f:
        batches, err = collect(f)
    assert batches == [] and isinstance(err, FeederError)
    msg = str(err)
    assert "MixUp" in msg and "mask" in msg and "['mask']" in msg and "CutMix" in msg


def test_mixing_refuses_boxes_naming_the_fields(solid_pngs):
    with Feeder(masked_source(solid_pngs, boxes=True), 4, [], image_size=(16, 16), seed=1, dtype=torch.float32,
                decode_threads=1, batch_transforms=[ops.CutMix(1.0, 5)]) as f:
        batches, err = collect(f)
    assert batches == [] and isinstance(err, FeederError)
    msg = str(err)
    assert "CutMix" in msg and "['box_class', 'boxes']" in msg and "batch 0" in msg


def test_cutmix_moves_masks_directly():
    x, y = batch_of(2)
    masks = {"mask": torch.arange(6, dtype=torch.uint8).view(6, 1, 1).expand(6, 8, 10).clone()}
    op = ops.CutMix(1.0, 10)
    out_x, out_y, out_m = op.apply_with_masks(x, y, torch.Generator().manual_seed(2), masks)
    ref_x, ref_y = op(x, y, torch.Generator().manual_seed(2))
    assert torch.equal(out_x, ref_x) and torch.equal(out_y, ref_y)
    pasted = out_m["mask"] != masks["mask"]
    assert pasted.any()
    # Where the mask was pasted the image was too, from the same partner.
    assert torch.equal(pasted[:, None].expand_as(x), out_x != x)
    assert torch.equal(out_m["mask"][pasted], masks["mask"].flip(0)[pasted])
    with pytest.raises(ValueError, match="MixUp cannot mix the mask field"):
        ops.MixUp(1.0, 10).apply_with_masks(x, y, torch.Generator(), masks)


# -- what a batch transform returns is checked ----------------------------------------

def _drop_one(images, labels, generator):
    return images[1:], labels


def _flatten(images, labels, generator):
    return images.flatten(0, 1), labels


def _to_double(images, labels, generator):
    return images.double(), labels


def _to_meta(images, labels, generator):
    # Another device than the batch's, testable without a GPU: as CPU tensors
    # returned on a CUDA feeder would be.
    return torch.empty_like(images, device="meta"), labels


def _labels_to_meta(images, labels, generator):
    return images, torch.empty_like(labels, device="meta")


def _drop_a_label(images, labels, generator):
    return images, labels[1:]


@pytest.mark.parametrize("fn, words", [
    (_drop_one, "images of shape (3, 3, 16, 16) for a batch of shape (4, 3, 16, 16)"),
    (_flatten, "images of shape (12, 16, 16) for a batch of shape (4, 3, 16, 16)"),
    (_to_double, "torch.float64 images, not torch.float32 (the feeder's dtype)"),
    (_to_meta, "images on meta, not on the batch's device cpu"),
    (_labels_to_meta, "labels on meta, not on the batch's device cpu"),
    (_drop_a_label, "3 labels for 4 images"),
])
def test_a_batch_transform_output_that_is_not_the_batch_is_refused_naming_it(small, fn, words):
    with make(small, batch_size=4, batch_transforms=[fn]) as f:
        batches, err = drain(f)
    assert batches == [] and isinstance(err, FeederError)
    assert f"batch transform {fn!r} returned" in str(err) and words in str(err), str(err)
    assert "on batch 0 of epoch 0" in str(err)


def test_a_uint8_feeder_checks_its_own_dtype(small):
    with make(small, dtype=None, batch_size=4, batch_transforms=[_to_double]) as f:
        _, err = drain(f)
    assert isinstance(err, FeederError) and "torch.float64 images, not torch.uint8" in str(err)


def test_a_moved_mask_of_another_shape_is_refused():
    from feeder.engine.on_device import BatchTransforms

    class Crops:
        def apply_with_masks(self, images, labels, generator, masks):
            return images, labels, {k: m[:, 1:] for k, m in masks.items()}

        def __call__(self, images, labels, generator):
            return images, labels

    images, masks = torch.zeros(2, 3, 4, 4), {"mask": torch.zeros(2, 4, 4, dtype=torch.uint8)}
    with pytest.raises(FeederError, match=r"mask field 'mask' of shape \(2, 3, 4\), not \(2, 4, 4\)"):
        BatchTransforms((Crops(),), 0, 0, torch.device("cpu"), torch.float32)(
            images, torch.zeros(2, dtype=torch.int64), 0, masks)


@pytest.mark.parametrize("op", [ops.MixUp(1.0, NUM_CLASSES), ops.CutMix(1.0, NUM_CLASSES)])
def test_mixing_is_refused_on_variable_size_batches(small, op):
    # A partner of another size: its pixels would land in the image's padding
    # and the image's padding over its pixels, outside what "size" names.
    with pytest.raises(ConfigError, match=rf"batch_transforms\[0\]: {type(op).__name__} mixes images "
                                          rf"of different sizes.*max_image_size"):
        Feeder(small, 4, [], dtype=torch.float32, max_image_size=(96, 96), batch_transforms=[op])
