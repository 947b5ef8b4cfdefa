"""feeder.errors: the exceptions' messages, attributes and pickling (the isolated
engine sends them across processes), and ``safe_text`` for names that are not UTF-8."""

from __future__ import annotations

import os
import pickle

import pytest

from feeder.errors import (ConfigError, DecodeError, FeederError, FeederTimeoutError, FieldError,
                           SampleError, SourceError, StageError, TransformError, safe_text, with_field)


def test_safe_text_leaves_valid_text_alone():
    for text in ("plain.jpg", "données/été.png", "日本/画像.jpg", ""):
        assert safe_text(text) is text


def test_safe_text_shows_undecodable_file_name_bytes_as_escapes():
    name = os.fsdecode(b"photos/caf\xe9.jpg")  # Latin-1 bytes: surrogate escapes in Python
    shown = safe_text(name)
    assert shown == "photos/caf\\xe9.jpg"
    shown.encode("utf-8")  # always encodable


def test_safe_text_escapes_a_surrogate_that_stands_for_no_byte():
    shown = safe_text("a\ud800b")
    assert shown == "a\\ud800b"
    shown.encode("utf-8")


def test_sample_error_names_stage_sample_path_and_cause():
    cause = DecodeError("not a JPEG")
    err = SampleError("decode", 17, "/data/x.jpg", cause)
    assert isinstance(err, FeederError)
    assert (err.stage, err.index, err.path, err.field) == ("decode", 17, "/data/x.jpg", None)
    assert err.__cause__ is cause
    assert str(err) == "feeder stage 'decode' failed on sample 17 (/data/x.jpg): DecodeError: not a JPEG"


def test_sample_error_names_the_field_and_the_causes_notes():
    cause = with_field(ValueError("negative width"), "boxes")
    cause.add_note("box 3")
    err = SampleError("read", 2, "mem://2", cause)
    assert err.field == "boxes"
    assert "field 'boxes'" in str(err) and "(box 3)" in str(err)


def test_sample_error_message_encodes_whatever_the_path():
    path = os.fsdecode(b"caf\xe9.jpg")
    err = SampleError("read", 0, path, OSError("gone"))
    assert err.path == path  # the path as the source gave it: it can still be opened
    str(err).encode("utf-8")
    assert "caf\\xe9.jpg" in str(err)


def test_errors_survive_pickling_with_their_attributes():
    cause = with_field(ValueError("bad"), "mask")
    sample = pickle.loads(pickle.dumps(SampleError("augment", 5, "p.png", cause)))
    assert (sample.stage, sample.index, sample.path, sample.field) == ("augment", 5, "p.png", "mask")
    assert type(sample.__cause__) is ValueError and str(sample.__cause__) == "bad"
    assert str(sample) == str(SampleError("augment", 5, "p.png", cause))

    try:
        raise StageError("sampler", "source broke") from KeyError("k")
    except StageError as exc:
        stage = pickle.loads(pickle.dumps(exc))
    assert stage.stage == "sampler" and str(stage) == "feeder stage 'sampler' failed: source broke"
    assert isinstance(stage.__cause__, KeyError)

    field = pickle.loads(pickle.dumps(FieldError("boxes", "is not [N, 4]")))
    assert field.field == "boxes" and str(field) == "field 'boxes' is not [N, 4]"


def test_with_field_keeps_a_field_already_named():
    exc = with_field(FieldError("label", "is missing"), "mask")
    assert exc.field == "label"


def test_with_field_on_an_exception_that_takes_no_attribute_adds_a_note():
    class Frozen(Exception):  # like a type with __slots__: no new attribute
        def __setattr__(self, name, value):
            if name != "__notes__":
                raise AttributeError(name)
            super().__setattr__(name, value)

    exc = with_field(Frozen("x"), "boxes")
    assert exc.__notes__ == ["field 'boxes'"]
    assert SampleError("decode", 1, "p", exc).field is None
    assert "(field 'boxes')" in str(SampleError("decode", 1, "p", exc))


def test_the_hierarchy_lets_callers_catch_by_kind():
    assert issubclass(FeederTimeoutError, TimeoutError) and issubclass(FeederTimeoutError, FeederError)
    assert issubclass(SourceError, ConfigError) and issubclass(SourceError, TypeError)
    assert issubclass(ConfigError, TransformError) and issubclass(TransformError, ValueError)
    assert ConfigError("x").field is None
    with pytest.raises(FeederError):
        raise StageError("transfer", "boom")


def test_errors_pickle_with_their_field():
    err = pickle.loads(pickle.dumps(FieldError("boxes", "is bad")))
    assert err.field == "boxes" and str(err) == "field 'boxes' is bad"
    wrapped = SampleError("read", 3, "p", FieldError("mask", "is bad"))
    again = pickle.loads(pickle.dumps(wrapped))
    assert again.field == "mask" and "field 'mask'" in str(again)
