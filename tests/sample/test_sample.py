"""feeder.sample: what a source's ``read`` may return (``check_sample``, the
public contract), how field values are checked and converted, and the schema
that keeps every sample's fields alike."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from feeder import FieldError, SourceError, check_sample
from feeder.sample import (BOX_LIST, INT_SCALAR, MASKS, NUMERIC, OBJECT, PER_BOX, Schema, Spec,
                            numeric, parse_sample, spec_of)

from tests.support import run_in_thread


def test_check_sample_is_the_public_contract():
    check_sample((b"\xff\xd8\xff", 1))
    check_sample({"image": b"\x89PNG", "mask": b"\x89PNG", "boxes": [[0, 0, 1, 1]], "box_labels": [3],
                  "caption": "a cat"})
    check_sample({"image": bytearray(b"x"), "boxes": np.zeros((0, 4))})
    with pytest.raises(SourceError, match="must return"):
        check_sample("a/path.jpg")
    for bad, field in (({"image": b"x", "boxes": [[0, 0, 1]]}, "boxes"),
                       ({"image": b"x", "boxes": [[2, 0, 1, 1]]}, "boxes"),
                       ({"image": b"x", "boxes": [[0, 0, float("nan"), 1]]}, "boxes"),
                       ({"image": b"x", "boxes": [[0, 0, 1, 1]], "box_labels": [1, 2]}, "box_labels"),
                       ({"image": b"x", "box_labels": [1]}, "box_labels"),
                       ({"image": b"x", "mask": np.zeros((2, 2, 3), np.uint8)}, "mask"),
                       ({"image": b"x", "mask": "m.png"}, "mask")):
        with pytest.raises(FieldError) as info:
            check_sample(bad)
        assert info.value.field == field and repr(field) in str(info.value)


@pytest.mark.parametrize("value, dtype, shape", [
    (3, np.int64, ()), (True, np.bool_, ()), (2.5, np.float64, ()),
    (np.uint8(7), np.int64, ()), (np.int16(-2), np.int64, ()), (np.float32(1.5), np.float32, ()),
    ([1, 2, 3], np.int64, (3,)), ((0.5, 1.5), np.float64, (2,)),
    (np.zeros((2, 3), np.uint16), np.int64, (2, 3)), (torch.ones(4, dtype=torch.float16), np.float16, (4,)),
])
def test_numeric_values_and_their_delivered_dtype(value, dtype, shape):
    arr = numeric(value)
    assert arr.dtype == dtype and arr.shape == shape
    assert np.array_equal(arr, np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value))


@pytest.mark.parametrize("value", ["cat", None, [[1, 2], [3]], {"a": 1}, np.array(["x"]), object()])
def test_numeric_is_none_for_what_is_not_a_fixed_shape_number(value):
    assert numeric(value) is None


def test_numeric_refuses_integers_outside_int64():
    with pytest.raises(OverflowError):
        numeric(1 << 63)
    with pytest.raises(OverflowError):
        numeric(np.array([1 << 63], np.uint64))
    assert numeric(np.array([(1 << 63) - 1], np.uint64)).dtype == np.int64


def test_parse_sample_of_a_pair_and_of_a_dict():
    data, fields, is_dict = parse_sample((b"jpeg", 5))
    assert data == b"jpeg" and not is_dict and fields["label"] == 5 and fields["label"].dtype == np.int64
    data, fields, is_dict = parse_sample({"image": b"png", "boxes": [[0, 0, 2, 3]], "box_cls": [1],
                                         "caption": "a cat", "score": 0.5})
    assert data == b"png" and is_dict
    assert fields["boxes"].dtype == np.float32 and fields["boxes"].shape == (1, 4)
    assert fields["box_cls"].tolist() == [1] and fields["caption"] == "a cat"
    assert "image" not in fields
    # No boxes at all: an empty [0, 4] array.
    assert parse_sample({"image": b"x", "boxes": []})[1]["boxes"].shape == (0, 4)


def test_parse_sample_names_the_source_and_sample_and_hints_at_the_fix():
    class Folder:
        pass

    with pytest.raises(SourceError) as info:
        parse_sample(("a/b.jpg", 1), Folder(), 7)
    text = str(info.value)
    assert text.startswith("Folder.read(7) returned a pair whose image is str 'a/b.jpg'")
    assert "open(path, 'rb').read()" in text
    with pytest.raises(SourceError, match=r"Folder\.read\(2\) returned a dict whose \"image\" is "
                                          r"list, not an image"):
        parse_sample({"image": [[1, 2], [3, 4]]}, Folder(), 2)
    with pytest.raises(SourceError, match=r"Folder\.read\(2\) returned numpy\.ndarray \(an image "
                                          r"alone\? return it with its label"):
        parse_sample(np.zeros((2, 2, 3), np.uint8), Folder(), 2)
    with pytest.raises(SourceError, match=r"returned a tuple of 3 items"):
        parse_sample((b"x", 1, 2), Folder(), 0)
    with pytest.raises(SourceError, match=r"without an \"image\" key \(keys: \['img'\]\)"):
        parse_sample({"img": b"x"}, Folder(), 0)
    with pytest.raises(SourceError, match="field names must be str"):
        parse_sample({"image": b"x", 3: "y"}, Folder(), 0)


@pytest.mark.parametrize("label", ["cat", None, [[1], [2, 3]], np.array(["a"])])
def test_a_label_that_is_not_numeric_is_a_field_error(label):
    with pytest.raises(FieldError) as info:
        parse_sample((b"x", label))
    assert info.value.field == "label" and "a label is a number" in str(info.value)


def test_spec_of_each_kind():
    fields = parse_sample({"image": b"x", "mask": b"png", "boxes": [[0, 0, 1, 1]],
                           "box_cls": [[1, 2]], "vec": [1.0, 2.0], "label": 3, "name": "n"})[1]
    specs = {name: spec_of(name, value) for name, value in fields.items()}
    assert specs == {"mask": Spec(MASKS), "boxes": Spec(BOX_LIST),
                     "box_cls": Spec(PER_BOX, np.dtype(np.int64), (2,)),
                     "vec": Spec(NUMERIC, np.dtype(np.float64), (2,)), "label": INT_SCALAR,
                     "name": Spec(OBJECT)}
    assert specs["box_cls"].describe() == "per-box int64 of shape (N, 2)"
    assert specs["vec"].describe() == "float64 of shape (2,)"


def check(schema: Schema, index: int, sample) -> None:
    _, fields, is_dict = parse_sample(sample)
    keys = tuple(sample) if is_dict else None
    schema.check(index, is_dict, keys, fields)


def test_schema_is_fixed_by_the_first_sample_and_names_both_on_a_mismatch():
    schema = Schema()
    check(schema, 4, {"image": b"x", "vec": [1.0, 2.0]})
    check(schema, 5, {"vec": [3.0, 4.0], "image": b"y"})  # same fields in another order
    with pytest.raises(FieldError) as info:
        check(schema, 9, {"image": b"x", "vec": [1.0, 2.0, 3.0]})
    assert info.value.field == "vec"
    assert str(info.value) == ("field 'vec' of sample 9 is float64 of shape (3,), but sample 4 gave "
                               "float64 of shape (2,); every sample's 'vec' must have one shape and dtype")
    with pytest.raises(FieldError, match="'extra' is extra in sample 6") as info:
        check(schema, 6, {"image": b"x", "vec": [1.0, 2.0], "extra": 1})
    assert info.value.field == "extra"
    with pytest.raises(FieldError, match="'vec' is missing from sample 7"):
        check(schema, 7, {"image": b"x"})


def test_schema_refuses_pairs_and_dicts_mixed():
    schema = Schema()
    check(schema, 0, (b"x", 1))
    with pytest.raises(SourceError, match="sample 3 is a dict but sample 0 was not"):
        check(schema, 3, {"image": b"x", "label": 1})
    with pytest.raises(FieldError, match="'label' of sample 4 is float64"):
        check(schema, 4, (b"x", 1.5))


def test_schema_checks_from_many_threads_agree_on_one_spec():
    schema = Schema()
    start = threading.Barrier(4)
    failures = []

    def worker(k):
        start.wait(10)
        for i in range(200):
            try:
                check(schema, k * 1000 + i, {"image": b"x", "v": [float(i), 0.0]})
            except FieldError as exc:  # pragma: no cover - the failure the test looks for
                failures.append(exc)

    threads = [threading.Thread(target=worker, args=(k,), name=f"test-schema-{k}") for k in range(4)]
    for t in threads:
        t.start()
    run_in_thread(lambda: [t.join() for t in threads])
    assert failures == []
    assert schema.specs == {"v": Spec(NUMERIC, np.dtype(np.float64), (2,))}
    assert schema.is_dict is True and set(schema.keys) == {"image", "v"}


def test_a_first_sample_that_later_samples_outvote_is_an_error_never_skipped():
    # The first sample read fixes the fields; when it is the malformed one, every
    # good sample disagrees with it. Skipping them all would deliver the bad one
    # alone: once OUTVOTED samples agree with one another and none with it, the
    # schema refuses with an error (a SourceError, never skipped) naming it.
    schema = Schema()
    check(schema, 100, {"image": b"x", "label": 100})
    later = list(range(Schema.OUTVOTED))
    for index in later[:-1]:
        with pytest.raises(FieldError, match=f"'extra' is extra in sample {index}"):
            check(schema, index, {"image": b"x", "label": index, "extra": 1.5})
    with pytest.raises(SourceError) as info:
        check(schema, later[-1], {"image": b"x", "label": later[-1], "extra": 2.5})
    text = str(info.value)
    assert "sample 100, the first sample read" in text
    assert f"samples {', '.join(map(str, later))} agree" in text
    assert "sample 100 is probably malformed" in text


def test_an_odd_sample_after_the_first_is_only_a_field_error_however_many_follow():
    schema = Schema()
    check(schema, 0, {"image": b"x", "vec": [1.0, 2.0]})
    check(schema, 1, {"image": b"x", "vec": [3.0, 4.0]})  # a second sample agrees: settled
    for index in range(2, 8):  # a run of odd samples: each its own FieldError (skippable)
        with pytest.raises(FieldError, match=f"'vec' of sample {index} is float64 of shape \\(3,\\)"):
            check(schema, index, {"image": b"x", "vec": [1.0, 2.0, 3.0]})


def test_odd_samples_that_disagree_among_themselves_outvote_nothing():
    schema = Schema()
    check(schema, 0, {"image": b"x", "vec": [1.0, 2.0]})
    for index, n in ((1, 1), (2, 3), (3, 4), (4, 5)):  # four others, no two alike
        with pytest.raises(FieldError):
            check(schema, index, {"image": b"x", "vec": [0.5] * n})
