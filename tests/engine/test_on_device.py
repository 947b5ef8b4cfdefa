"""feeder.engine.on_device: what the transfer stage does to a batch after the
copy, on the CPU here: the conversion to dtype and layout (Converter) and the
batch transforms (BatchTransforms), whose draws depend on (seed, epoch, batch
number) only."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from feeder.engine.on_device import BatchTransforms, Converter
from feeder.errors import StageError
from feeder.sample import INT_SCALAR, NUMERIC, Schema, Spec

CPU = torch.device("cpu")


def batch(b=2, h=4, w=5) -> torch.Tensor:
    """A uint8 [B,3,H,W] batch laid out as the batch buffers are: NHWC memory."""
    nhwc = torch.arange(b * h * w * 3, dtype=torch.int64).remainder(256).to(torch.uint8).view(b, h, w, 3)
    return nhwc.permute(0, 3, 1, 2)


# -- low-precision normalization is rounded once --------------------------------------------

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("normalize", [(MEAN, STD), None])
def test_conversion_equals_the_exact_value_rounded_once(dtype, normalize):
    x = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(2, 3, 16, 16)
    x = x.contiguous(memory_format=torch.channels_last)
    mean, std = normalize or ((0.0,) * 3, (1.0,) * 3)
    exact = ((x.double() / 255 - torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1))
             / torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1))
    got = Converter(dtype, normalize, torch.device("cpu"))(x)
    assert got.dtype == dtype and got.is_contiguous(memory_format=torch.channels_last)
    rounded = exact.to(dtype)
    # Rounding the float32 result once can differ from rounding the exact value
    # only next to a tie: at most one unit in the last place.
    ulp = torch.finfo(dtype).eps * rounded.double().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got.double() - rounded.double()).abs() <= ulp).all()
    assert (got == rounded).float().mean() > 0.99


def test_uint8_output_is_the_buffer_itself():
    x = batch()
    conv = Converter(None, None, CPU)
    assert conv(x) is x and conv.keeps_buffer_layout and not conv.normalized
    contiguous = Converter(None, None, CPU, memory_format="contiguous")
    y = contiguous(x)
    assert not contiguous.keeps_buffer_layout
    assert y.is_contiguous() and y.dtype == torch.uint8 and torch.equal(y, x)


@pytest.mark.parametrize("dtype, memory_format", [(None, "contiguous"), (torch.float32, "channels_last"),
                                                  (torch.float16, "contiguous")])
@pytest.mark.parametrize("h, w", [(1, 1), (4, 5)])
def test_output_not_kept_in_the_buffer_layout_is_memory_of_its_own(dtype, memory_format, h, w):
    # The transfer stage returns the buffer to the pool as soon as it has such an
    # output: even a batch already laid out as asked (1x1 images) must be a copy.
    x = batch(h=h, w=w)
    conv = Converter(dtype, None, CPU, memory_format=memory_format)
    assert not conv.keeps_buffer_layout
    got = conv(x)
    assert got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    expected = got.clone()
    x.zero_()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("memory_format", ["channels_last", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_scaled_to_unit_range_in_the_layout_asked(dtype, memory_format):
    x = batch()
    conv = Converter(dtype, None, CPU, memory_format=memory_format)
    got = conv(x)
    assert got.dtype == dtype and got.shape == x.shape and not conv.normalized
    if memory_format == "contiguous":
        assert got.is_contiguous()
    else:
        assert got.is_contiguous(memory_format=torch.channels_last) and not got.is_contiguous()
    assert torch.allclose(got.double(), x.double() / 255, atol=torch.finfo(dtype).eps, rtol=0)
    assert got.min() == 0 and got.double().max() <= 1.0
    assert x.dtype == torch.uint8  # the input is left as it was


def test_float64_is_computed_in_float64():
    x = batch()
    got = Converter(torch.float64, (MEAN, STD), CPU)(x)
    mean = torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)
    assert torch.allclose(got, (x.double() / 255 - mean) / std, atol=1e-12, rtol=0)


def test_normalize_per_channel():
    x = torch.zeros(1, 3, 2, 2, dtype=torch.uint8)
    x[:, 1] = 255
    conv = Converter(torch.float32, ((0.5, 0.5, 0.0), (0.5, 0.25, 2.0)), CPU)
    got = conv(x)
    assert conv.normalized
    assert torch.allclose(got[0, :, 0, 0], torch.tensor([-1.0, 2.0, 0.0]))


class Record:
    """A batch transform recording its first draw; adds 1 to the images."""

    def __init__(self):
        self.draws = []

    def __call__(self, images, labels, gen):
        self.draws.append(int(torch.randint(0, 2**31, (), generator=gen)))
        return images + 1, labels

    def __repr__(self):
        return "Record()"


def _run(seed=1, epoch=0, number=0, transforms=None):
    transforms = transforms or (Record(), Record())
    images, labels = BatchTransforms(transforms, seed, epoch, CPU)(
        torch.zeros(2, 3, 1, 1), torch.tensor([0, 1]), number)
    return transforms, images, labels


def test_transforms_run_in_order_with_draws_from_seed_epoch_batch_and_position():
    (a, b), images, labels = _run()
    assert torch.equal(images, torch.full((2, 3, 1, 1), 2.0)) and labels.tolist() == [0, 1]
    (a2, b2), _, _ = _run()
    assert (a.draws, b.draws) == (a2.draws, b2.draws)  # repeatable
    assert a.draws != b.draws  # each position has its own stream
    for changed in ({"seed": 2}, {"epoch": 1}, {"number": 1}):
        (c, _), _, _ = _run(**changed)
        assert c.draws != a.draws, changed


def test_a_failing_transform_names_itself_batch_and_epoch():
    def boom(images, labels, gen):
        raise RuntimeError("no luck")

    with pytest.raises(StageError) as err:
        BatchTransforms((boom,), 0, 3, CPU)(torch.zeros(1, 3, 1, 1), torch.tensor([0]), 7)
    msg = str(err.value)
    assert "'transfer'" in msg and "boom" in msg and "batch 7 of epoch 3" in msg and "RuntimeError: no luck" in msg
    assert isinstance(err.value.__cause__, RuntimeError)


@pytest.mark.parametrize("out", [(np.zeros(1), torch.tensor([0])), (torch.zeros(1), [0]),
                                 (torch.zeros(1), None)])
def test_a_transform_must_return_tensors(out):
    with pytest.raises(StageError, match=r"must return \(images, labels\) tensors"):
        BatchTransforms((lambda i, l, g: out,), 0, 0, CPU)(torch.zeros(1, 3, 1, 1), torch.tensor([0]), 0)


def test_label_free_transforms_may_drop_labels():
    class Erase:
        uses_labels = False

        def __call__(self, images, labels, gen):
            return images * 0, None

    bt = BatchTransforms((Erase(),), 0, 0, CPU)
    assert bt.label_free
    images, labels = bt(torch.ones(1, 3, 1, 1), None, 0)
    assert labels is None and images.sum() == 0
    assert not BatchTransforms((Erase(), Record()), 0, 0, CPU).label_free


class Classes(Record):
    num_classes = 3


def test_check_labels_names_batch_sample_and_label():
    bt = BatchTransforms((Classes(),), 0, 2, CPU)
    bt.check_labels(np.array([0, 2, 1]), np.array([10, 11, 12]), 4)
    for bad, value in ((np.array([0, 3, -1]), 3), (np.array([-1, 0, 0]), -1)):
        with pytest.raises(StageError) as err:
            bt.check_labels(bad, np.array([10, 11, 12]), 4)
        msg = str(err.value)
        assert f"label {value} of sample" in msg and "batch 4 of epoch 2" in msg and "[0, 3)" in msg
    with pytest.raises(StageError, match="sample 11"):
        bt.check_labels(np.array([0, 3, 0]), np.array([10, 11, 12]), 4)
    BatchTransforms((Record(),), 0, 0, CPU).check_labels(np.array([99]), np.array([0]), 0)  # no bound


def _schema(**specs):
    schema = Schema()
    schema.specs.update(specs)
    return schema


def test_check_label_field():
    bt = BatchTransforms((Classes(),), 0, 0, CPU)
    buf = types.SimpleNamespace(labels=np.array([0, 5, 1]))
    idx = np.array([7, 8])
    bt.check_label_field(buf, 2, _schema(label=Spec(NUMERIC, np.dtype(np.float32), (3,))), idx, 0)
    with pytest.raises(StageError, match="label 5 of sample 8"):
        bt.check_label_field(buf, 2, _schema(label=INT_SCALAR), idx, 0)
    bt.check_label_field(buf, 1, _schema(label=INT_SCALAR), idx, 0)  # only the batch's n samples
    with pytest.raises(StageError, match='the samples have no "label" field'):
        bt.check_label_field(buf, 2, _schema(), idx, 0)
    with pytest.raises(StageError, match=r'a "label" field of int32 of shape \(3,\)'):
        bt.check_label_field(buf, 2, _schema(label=Spec(NUMERIC, np.dtype(np.int32), (3,))), idx, 0)

    class Free(Record):
        uses_labels = False

    BatchTransforms((Free(),), 0, 0, CPU).check_label_field(buf, 2, _schema(), idx, 0)


def test_check_fields_asks_each_transform_once():
    seen = []

    class Mix(Record):
        def check_fields(self, kinds):
            seen.append(kinds)
            if "depth" in kinds:
                raise ValueError("cannot move 'depth'")

    schema = _schema(label=INT_SCALAR, mask=Spec("mask"))
    bt = BatchTransforms((Mix(), Record()), 0, 1, CPU)
    bt.check_fields(schema, 0)
    bt.check_fields(schema, 1)
    assert seen == [{"mask": "mask"}]
    bad = BatchTransforms((Mix(),), 0, 1, CPU)
    with pytest.raises(StageError, match="refused batch 5 of epoch 1: cannot move 'depth'"):
        bad.check_fields(_schema(depth=Spec(NUMERIC, np.dtype(np.float32), (2,))), 5)


class Keyed:
    """Per-sample draws: the first value of each sample's SampleRNG."""

    def __init__(self):
        self.draws, self.sizes = [], []

    def apply_keyed(self, images, labels, rngs, sizes=None):
        self.draws.append([r.random() for r in rngs])
        self.sizes.append(sizes)
        return images, labels


def test_keyed_transforms_draw_per_sample_whatever_the_batch():
    t = Keyed()
    bt = BatchTransforms((t,), 5, 1, CPU)
    x, y = torch.zeros(2, 3, 1, 1), torch.tensor([0, 0])
    bt(x, y, 0, indices=np.array([4, 9]))
    bt(x, y, 3, indices=np.array([9, 2]), sizes=np.array([[1, 1], [1, 1]]))
    assert t.draws[0][1] == t.draws[1][0]  # sample 9, in another batch and slot: the same draw
    assert t.draws[0][0] != t.draws[0][1]
    assert t.sizes[0] is None and t.sizes[1].tolist() == [[1, 1], [1, 1]]
    other = Keyed()
    BatchTransforms((other,), 5, 2, CPU)(x, y, 0, indices=np.array([4, 9]))
    assert other.draws[0] != t.draws[0]  # another epoch


def test_masks_move_with_the_images():
    class Flip:
        def __call__(self, images, labels, gen):
            raise AssertionError("with masks, apply_with_masks is used")

        def apply_with_masks(self, images, labels, gen, masks):
            return images.flip(-1), labels, {k: v.flip(-1) for k, v in masks.items()}

    masks = {"mask": torch.tensor([[[1, 2]]])}
    images, _ = BatchTransforms((Flip(),), 0, 0, CPU)(torch.tensor([[[[1.0, 2.0]]] * 3]).view(1, 3, 1, 2),
                                                      torch.tensor([0]), 0, masks=masks)
    assert masks["mask"].tolist() == [[[2, 1]]] and images[0, 0, 0].tolist() == [2.0, 1.0]


def test_normalize_constants_are_made_once_per_device_and_dtype():
    """A pass's converter reuses the constants of earlier passes: making them copies
    from pageable memory, which waits for the device, at every pass start."""
    norm = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    a = Converter(torch.float16, norm, torch.device("cpu"))
    b = Converter(torch.float16, [list(norm[0]), list(norm[1])], torch.device("cpu"))
    assert a.scale is b.scale and a.shift is b.shift
    c = Converter(torch.float64, norm, torch.device("cpu"))
    assert c.scale.dtype == torch.float64 and c.scale is not a.scale
