"""Samples beyond one int label: dict samples with numeric and passed-through
fields, float / multi-hot / vector labels, FileList labels, and what a source's
``read`` may return (the errors that say so)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support import MemorySource, collect, drain, encode_jpeg, encode_png
from feeder import (ConfigError, Feeder, FeederError, FieldError, FileList, SampleError, SourceError,
                    ops)
from feeder.synthetic import make_image
from feeder.testing import work_of
from tests.support.fields import DictSource

SIZE = [ops.CenterCrop(16)]


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return [encode_jpeg(make_image(24 + i % 3 * 4, 30, seed=i)) for i in range(40)]


# -- labels of pairs ---------------------------------------------------------------------

class PairSource(MemorySource):
    def __init__(self, blobs, labels):
        super().__init__(blobs, list(labels))


@pytest.mark.parametrize("labels, dtype, shape", [
    ([0.7, 1.9, 2.5, -0.3] * 5, torch.float64, ()),
    (np.linspace(-1, 1, 20).astype(np.float32), torch.float32, ()),
    ([[0, 1, 1], [1, 0, 0]] * 10, torch.int64, (3,)),                        # multi-hot, ints
    (np.eye(4, dtype=np.float32)[np.arange(20) % 4] * 0.9, torch.float32, (4,)),  # soft targets
    (np.arange(20 * 6, dtype=np.float64).reshape(20, 2, 3), torch.float64, (2, 3)),
    ([True, False] * 10, torch.bool, ()),
])
def test_pair_labels_keep_their_type_and_shape(blobs, labels, dtype, shape):
    expected = np.asarray(labels)
    src = PairSource(blobs[:20], [expected[i] if isinstance(labels, np.ndarray) else labels[i]
                                  for i in range(20)])
    with Feeder(src, 4, SIZE, shuffle=False, decode_threads=2) as f:
        batches, err = collect(f)
    assert err is None
    got = torch.cat([y for _, y in batches])
    assert got.dtype == dtype and tuple(got.shape[1:]) == shape
    np.testing.assert_array_equal(got.numpy(), expected.astype(got.numpy().dtype))
    assert all(isinstance(b, tuple) and len(b) == 2 for b in batches)


def test_filelist_float_labels_are_not_truncated(tmp_path, blobs):
    paths = []
    for i in range(4):
        p = tmp_path / f"{i}.jpg"
        p.write_bytes(blobs[i])
        paths.append(str(p))
    with Feeder(FileList(paths, [0.7, 1.9, 2.5, -0.3]), 4, SIZE, shuffle=False) as f:
        (images, labels), = collect(f)[0]
    assert labels.dtype == torch.float64
    assert labels.tolist() == [0.7, 1.9, 2.5, -0.3]


def test_filelist_labels_of_one_shape_and_int_labels(tmp_path, blobs):
    paths = [str(tmp_path / "a.jpg")] * 3
    (tmp_path / "a.jpg").write_bytes(blobs[0])
    assert FileList(paths, [1, 2, 3]).labels == [1, 2, 3]  # plain ints: the classic path
    multi = FileList(paths, [[0, 1], [1, 1], [0, 0]])
    assert multi.labels.shape == (3, 2) and multi.labels.dtype == np.int64
    with Feeder(multi, 3, SIZE, shuffle=False) as f:
        (_, labels), = collect(f)[0]
    assert labels.tolist() == [[0, 1], [1, 1], [0, 0]] and labels.dtype == torch.int64
    with Feeder(FileList(paths, torch.tensor([0.5, 1.5, 2.5])), 3, SIZE, shuffle=False) as f:
        (_, labels), = collect(f)[0]
    assert labels.dtype == torch.float32 and labels.tolist() == [0.5, 1.5, 2.5]


@pytest.mark.parametrize("labels, words", [
    (["cat", "dog", "emu"], "label 0 is 'cat'"),
    ([[0, 1], [1], [0, 0]], "one shape"),
    ([1, None, 2], "label 1 is None"),
])
def test_filelist_refuses_labels_that_are_not_numbers_of_one_shape(labels, words):
    with pytest.raises(ValueError, match="FileList") as info:
        FileList(["a.jpg", "b.jpg", "c.jpg"], labels)
    assert words in str(info.value)


def test_a_list_label_from_a_custom_source_is_a_multi_hot_target(blobs):
    """A custom source returning a list label: stacked, not an error blamed on a stage."""
    src = PairSource(blobs[:8], [[i % 2, 1 - i % 2, 1] for i in range(8)])
    with Feeder(src, 4, SIZE, shuffle=False) as f:
        batches, err = collect(f)
    assert err is None
    assert torch.cat([y for _, y in batches]).tolist() == [[i % 2, 1 - i % 2, 1] for i in range(8)]


def test_an_int_label_mixed_with_floats_is_that_sample_s_error(blobs):
    labels = [float(i) for i in range(12)]
    labels[7] = 7  # an int among floats: a float64 batch cannot hold it silently
    src = PairSource(blobs[:12], labels)
    with Feeder(src, 4, SIZE, shuffle=False, decode_threads=1) as f:
        batches, err = collect(f)
    assert isinstance(err, SampleError) and err.index == 7 and err.stage == "read"
    assert err.field == "label" and isinstance(err.__cause__, FieldError)
    assert "int64 of shape ()" in str(err) and "float64 of shape ()" in str(err)
    assert len(batches) == 1  # the batch before it


def test_an_int_label_beyond_int64_names_the_label(blobs):
    src = PairSource(blobs[:4], [0, 1, 2**70, 3])
    with Feeder(src, 4, SIZE, shuffle=False) as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and err.index == 2 and err.field == "label"
    assert "int64" in str(err)


# -- dict samples ----------------------------------------------------------------------

def rich(blobs):
    """Every field kind, each value a function of the index."""
    def make(i):
        return {"image": blobs[i], "label": i, "score": i / 10, "vec": np.array([i, -i, 2 * i], np.float32),
                "hot": [i % 2 == 0, i % 3 == 0], "key": f"sample-{i}", "raw": bytes([i]), "meta": {"i": i},
                "none": None, "objs": np.array([{"i": i}], dtype=object), "names": np.array([f"n{i}"]),
                "cplx": np.array([1 + 1j * i], np.complex64)}
    return make


def check_rich(batch) -> list[int]:
    assert list(batch) == ["image", "label", "score", "vec", "hot", "key", "raw", "meta", "none",
                           "objs", "names", "cplx"]
    ids = batch["label"].tolist()
    assert batch["label"].dtype == torch.int64
    assert batch["score"].dtype == torch.float64 and batch["score"].tolist() == [i / 10 for i in ids]
    assert batch["vec"].dtype == torch.float32
    assert batch["vec"].tolist() == [[i, -i, 2 * i] for i in ids]
    assert batch["hot"].dtype == torch.bool and batch["hot"].tolist() == [[i % 2 == 0, i % 3 == 0] for i in ids]
    assert batch["key"] == [f"sample-{i}" for i in ids]
    assert batch["raw"] == [bytes([i]) for i in ids]
    assert batch["meta"] == [{"i": i} for i in ids]
    assert batch["none"] == [None] * len(ids)
    # numpy arrays of objects or strings are other values: passed through as read
    assert [a.dtype.kind for a in batch["objs"]] == ["O"] * len(ids)
    assert [a.tolist() for a in batch["objs"]] == [[{"i": i}] for i in ids]
    assert [a.tolist() for a in batch["names"]] == [[f"n{i}"] for i in ids]
    assert batch["cplx"].dtype == torch.complex64 and batch["cplx"].tolist() == [[1 + 1j * i] for i in ids]
    assert batch["image"].shape == (len(ids), 3, 16, 16)
    return ids


@pytest.mark.parametrize("decode, augment", [(1, 0), (3, 0), (2, 2)])
@pytest.mark.parametrize("ordered", [True, False])
def test_dict_fields_are_stacked_or_passed_through_for_any_threads(blobs, decode, augment, ordered):
    src = DictSource(40, rich(blobs))
    with Feeder(src, 6, SIZE, seed=3, decode_threads=decode, augment_threads=augment,
                ordered=ordered, drop_last=False) as f:
        f.set_epoch(1)
        batches, err = collect(f)
        order = f.last_batch  # noqa: F841 - a pass ran to its end
    assert err is None
    ids = [i for b in batches for i in check_rich(b)]
    assert sorted(ids) == list(range(40))
    if ordered:
        with Feeder(src, 6, SIZE, seed=3, decode_threads=1, ordered=True, drop_last=False) as g:
            g.set_epoch(1)
            reference, _ = collect(g)
        assert ids == [i for b in reference for i in b["label"].tolist()]
        for b, r in zip(batches, reference):
            assert torch.equal(b["image"], r["image"])


def test_skipped_samples_leave_every_field_in_step(blobs):
    """Skips make the collator move samples between buffers: every field moves with them."""
    bad = {3, 10, 11, 25}
    make = rich(blobs)

    def sample(i):
        s = make(i)
        if i in bad:
            s["image"] = b"not an image"
        return s
    src = DictSource(40, sample)
    for ordered in (True, False):
        with Feeder(src, 6, SIZE, shuffle=True, seed=1, on_error="skip", decode_threads=2,
                    ordered=ordered, drop_last=False) as f:
            batches, err = collect(f)
            assert f.stats().skipped == len(bad)
        assert err is None
        ids = [i for b in batches for i in check_rich(b)]
        assert sorted(ids) == sorted(set(range(40)) - bad)
        assert all(len(b["key"]) == 6 for b in batches[:-1])


def test_a_field_whose_shape_changes_names_the_field_the_sample_and_both_shapes(blobs):
    def make(i):
        return {"image": blobs[i], "vec": np.zeros(4 if i == 9 else 3, np.float32)}
    with Feeder(DictSource(12, make), 4, SIZE, shuffle=False, decode_threads=1) as f:
        batches, err = collect(f)
    assert isinstance(err, SampleError) and err.index == 9 and err.field == "vec", repr(err)
    text = str(err)
    assert "(4,)" in text and "(3,)" in text and "sample 9" in text and "sample 0" in text
    assert len(batches) == 2
    with Feeder(DictSource(12, make), 4, SIZE, shuffle=False, on_error="skip") as f:
        batches, err = collect(f)
        assert f.stats().skipped == 1
    assert err is None and sum(len(b["vec"]) for b in batches) == 11


def test_a_missing_field_and_a_changed_kind_are_errors_naming_the_field(blobs):
    def missing(i):
        s = {"image": blobs[i], "label": i, "key": "k"}
        if i == 5:
            del s["key"]
        return s

    def kind(i):
        return {"image": blobs[i], "key": 5 if i == 6 else "k"}
    for make, field, index in ((missing, "key", 5), (kind, "key", 6)):
        with Feeder(DictSource(8, make), 4, SIZE, shuffle=False, decode_threads=1) as f:
            _, err = collect(f)
        assert isinstance(err, SampleError) and err.index == index and err.field == field, repr(err)


def test_pairs_and_dicts_from_one_source_are_a_source_error(blobs):
    def make(i):
        return (blobs[i], 0) if i == 4 else {"image": blobs[i], "label": 0}
    with Feeder(DictSource(8, make), 4, SIZE, shuffle=False, decode_threads=1, on_error="skip") as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and err.index == 4 and isinstance(err.__cause__, SourceError)


def test_dict_samples_with_a_label_work_with_mixup(blobs):
    def make(i):
        return {"image": blobs[i], "label": i % 5, "key": str(i)}
    with Feeder(DictSource(8, make), 4, SIZE, shuffle=False, dtype=torch.float32,
                batch_transforms=[ops.MixUp(1.0, 5)]) as f:
        batches, err = collect(f)
    assert err is None
    assert batches[0]["label"].shape == (4, 5) and batches[0]["image"].dtype == torch.float32
    assert torch.allclose(batches[0]["label"].sum(1), torch.ones(4))

    def floats(i):
        return {"image": blobs[i], "label": i / 3}
    with Feeder(DictSource(8, floats), 4, SIZE, dtype=torch.float32,
                batch_transforms=[ops.MixUp(1.0, 5)]) as f:
        _, err = collect(f)
    assert isinstance(err, FeederError) and "label" in str(err)


# -- what read() may return ----------------------------------------------------------------

class FakePIL:
    """Looks like a PIL image (what a torchvision-style dataset returns)."""
    mode = "RGB"
    size = (8, 8)

    def getpixel(self, xy):
        return (0, 0, 0)


class Returns:
    def __init__(self, blob, value):
        self.blob, self.value = blob, value

    def __len__(self):
        return 6

    def read(self, index):
        return self.value if index == 3 else (self.blob, 0)

    def describe(self, index):
        return f"returns://{index}"


@pytest.mark.parametrize("value, words", [
    ("images/cat.jpg", ["str 'images/cat.jpg'", "a path?"]),
    (FakePIL(), ["FakePIL", "decoded image of another library?"]),
    ((FakePIL(), 1), ["image is", "FakePIL", "decoded image of another library?"]),
    (None, ["returned None"]),
    ((b"x", 1, 2), ["a tuple of 3 items"]),
    (("images/cat.jpg", 1), ["image is str", "a path?"]),
    (np.zeros((4, 4, 3), np.uint8), ["an image alone?", "(image, label)"]),
    ({"label": 1}, ["without an \"image\" key"]),
    ({"image": "cat.jpg"}, ["\"image\" is str"]),
])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_read_that_returns_something_else_says_what_read_must_return(blobs, value, words, on_error):
    with Feeder(Returns(blobs[0], value), 2, SIZE, shuffle=False, decode_threads=1,
                on_error=on_error) as f:
        batches, err = collect(f)
    assert isinstance(err, SampleError), repr(err)
    assert err.stage == "read" and err.index == 3 and isinstance(err.__cause__, SourceError)
    assert isinstance(err.__cause__, TypeError) and isinstance(err.__cause__, ConfigError)
    text = str(err)
    assert "Returns.read(3)" in text and "returns://3" in text and "must return" in text, text
    for w in words:
        assert w in text, text
    assert len(batches) == 1  # the batch before it; never skipped


def test_png_pairs_stay_on_the_classic_path(blobs):
    """Pairs with int labels: tuples of (images, int64 labels), nothing else."""
    src = MemorySource([encode_png(make_image(20, 20, seed=1))] * 4)
    with Feeder(src, 4, SIZE, shuffle=False) as f:
        batches, err = drain(f)
        assert work_of(f).schema.classic
    assert err is None and batches[0][1].tolist() == [0, 1, 2, 3]
