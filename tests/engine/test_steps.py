"""feeder.engine.steps: the per-sample work (decode, transform, masks and boxes moved
with the image) and the read step's checks, through SampleWork and read_sample."""

from __future__ import annotations

import numpy as np
import pytest

from feeder import ConfigError, DecodeError, FieldError, SourceError, ops
from feeder.ops.chain import Chain
from feeder.sample import Task
from feeder.engine.steps import SampleWork, as_label, read_sample

from tests.support import MemorySource, encode_jpeg, encode_png
from feeder.synthetic import make_image


IMG = make_image(48, 64, seed=2)
PNG = encode_png(IMG)


def out_for(work: SampleWork) -> np.ndarray:
    return np.zeros(work.image_size + (3,), np.uint8)


def test_call_is_decode_then_transform_and_deterministic_by_key():
    work = SampleWork(Chain([ops.RandomResizedCrop(16), ops.RandomHorizontalFlip()], None))
    outs = []
    for key in (1, 1, 2):
        out = out_for(work)
        work(PNG, key, out)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[0], outs[2])
    img, ctx = work.decode(PNG, 1)
    assert np.array_equal(img, IMG) and ctx.source_size == (48, 64)  # PNG: lossless, full size
    again = out_for(work)
    assert work.transform(img, 1, ctx, again) == (16, 16)
    assert np.array_equal(again, outs[0])


def test_decode_refuses_an_image_over_max_pixels_and_bad_bytes():
    work = SampleWork(Chain([ops.CenterCrop(8)], None), max_pixels=48 * 64 - 1)
    with pytest.raises(DecodeError, match="max_pixels"):
        work.decode(PNG, 0)
    with pytest.raises(DecodeError):
        SampleWork(Chain([ops.CenterCrop(8)], None)).decode(b"not an image", 0)


def test_a_mask_must_have_its_images_size():
    work = SampleWork(Chain([ops.CenterCrop(8)], None))
    mask = np.arange(48 * 64, dtype=np.uint16).reshape(48, 64) % 7
    given = work.decode_mask(mask, (48, 64))
    # A read-only view of the source's own array: nothing downstream writes there.
    assert np.shares_memory(given, mask) and np.array_equal(given, mask) and not given.flags.writeable
    decoded = work.decode_mask(encode_png(mask.astype(np.uint8)), (48, 64))
    assert decoded.dtype == np.uint8 and np.array_equal(decoded, mask)
    with pytest.raises(FieldError, match=r"is \(48, 64\) but its image is \(40, 60\) \(height, width\)") as info:
        work.decode_mask(mask, (40, 60))
    assert info.value.field == "mask"
    with pytest.raises(DecodeError) as info:
        work.decode_mask(b"garbage", (48, 64))
    assert info.value.field == "mask"


def test_transform_sample_moves_the_mask_and_boxes_with_the_image():
    work = SampleWork(Chain([ops.RandomHorizontalFlip(1.0)], (48, 64)))
    source = MemorySource([PNG])
    mask = np.zeros((48, 64), np.uint8)
    mask[:, :10] = 1  # the left strip
    sample = {"image": PNG, "mask": mask, "boxes": [[0, 0, 10, 48]], "label": 4}
    task = read_sample(source, work, Task(None, 0, 0), sample)
    assert task.fields is not None and not work.schema.classic
    img, ctx = work.decode(task.data, 1)
    out = out_for(work)
    record = {name: (kind, value) for name, kind, value in
              work.transform_sample(img, 1, ctx, out, task.fields)}
    assert np.array_equal(out, IMG[:, ::-1])
    kind, moved = record["mask"]
    assert kind == "mask" and moved[:, 54:].all() and not moved[:, :54].any()  # now the right strip
    assert record["boxes"][1].tolist() == [[54, 0, 64, 48]]
    assert record["label"] == ("numeric", 4)


def test_read_sample_marks_int_label_pairs_classic():
    work = SampleWork(Chain([ops.CenterCrop(8)], None))
    task = read_sample(MemorySource([PNG]), work, Task(None, 0, 3), (PNG, 7))
    assert (task.data, task.label, task.fields) == (PNG, 7, None)
    assert work.schema.classic


def test_read_sample_keeps_other_labels_as_fields():
    work = SampleWork(Chain([ops.CenterCrop(8)], None))
    task = read_sample(MemorySource([PNG]), work, Task(None, 0, 3), (PNG, [0.5, 0.5]))
    assert task.fields["label"].tolist() == [0.5, 0.5] and not work.schema.classic


def test_read_sample_names_the_source_and_sample():
    work = SampleWork(Chain([ops.CenterCrop(8)], None))
    with pytest.raises(SourceError, match=r"MemorySource\.read\(5\) returned a pair whose image is str"):
        read_sample(MemorySource([PNG]), work, Task(None, 0, 5), ("x.png", 1))


def test_variable_sizes_refuse_a_field_named_like_their_size_record():
    from feeder.engine.batch import SIZE

    work = SampleWork(Chain([ops.Resize(16)], None, max_image_size=(32, 32)))
    with pytest.raises(ConfigError, match=f"sample 2 has a field {SIZE!r}"):
        read_sample(MemorySource([PNG]), work, Task(None, 0, 2), {"image": PNG, SIZE: [1, 2]})


@pytest.mark.parametrize("label, value", [(3, 3), (np.int16(-2), -2), (True, 1), (np.uint32(7), 7)])
def test_as_label_converts_as_the_batch_stores(label, value):
    assert as_label(label) == value


@pytest.mark.parametrize("label", [1 << 63, "cat", None, [1, 2]])
def test_as_label_refuses_what_int64_cannot_hold(label):
    with pytest.raises((TypeError, ValueError, OverflowError)):
        as_label(label)


def test_jpeg_decodes_at_a_reduced_scale_when_the_transforms_allow():
    big = make_image(400, 600, seed=3)
    data = encode_jpeg(big)
    work = SampleWork(Chain([ops.Resize(50), ops.CenterCrop(48)], None))
    img, ctx = work.decode(data, 0)
    assert ctx.source_size == (400, 600)
    assert img.shape[0] < 400 and img.shape[0] >= 50  # smaller, still covering the resize
    out = out_for(work)
    work.transform(img, 0, ctx, out)
    assert out.shape == (48, 48, 3) and out.any()
