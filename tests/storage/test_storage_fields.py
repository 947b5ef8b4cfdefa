"""feeder.storage.fields: a shard member's field name and format, the bounded
.npy and .json decoding, and the plan of TarShards(fields=)."""

from __future__ import annotations

import gc
import io
import struct
import json
import sys
import threading

import numpy as np
import pytest

from feeder.storage.fields import field_of, json_value, make_plan, npy_array

IMAGES = ("jpg", "png")


def _npy(arr, **kw) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, **kw)
    return buf.getvalue()


def test_field_of_rule():
    assert field_of("jpg") == ("image", "bytes") and field_of("cls") == ("label", "cls")
    assert field_of("mask.png") == field_of("seg.png") == ("mask", "bytes")
    assert field_of("boxes.npy") == ("boxes", "npy") and field_of("npy") == ("npy", "npy")
    assert field_of("meta.json") == ("meta", "json") and field_of("txt") == ("txt", "txt")
    assert field_of("id.cls") == ("id", "cls") and field_of("raw.bin") == ("raw", "bytes")
    assert field_of("seg.jpg") == ("seg.jpg", "bytes") and field_of("depth.exr") == ("depth.exr", "bytes")
    assert field_of("cls", label=None) == ("cls", "cls") and field_of("y", label="y") == ("label", "cls")


@pytest.mark.parametrize("arr", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asfortranarray(np.arange(24, dtype=np.int16).reshape(2, 3, 4)),
    np.array(7, np.uint8),
    np.zeros((0, 4), np.float64),
    np.array([True, False]),
])
def test_npy_round_trip(arr):
    got = npy_array(_npy(arr))
    assert got.dtype == arr.dtype and got.shape == arr.shape and np.array_equal(got, arr)
    assert got.flags.writeable


def test_npy_versions_2_and_3():
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    for version in ((2, 0), (3, 0)):
        buf = io.BytesIO()
        np.lib.format.write_array(buf, arr, version=version)
        assert np.array_equal(npy_array(buf.getvalue()), arr)
    fortran = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    buf = io.BytesIO()
    np.lib.format.write_array(buf, fortran, version=(3, 0))
    got = npy_array(buf.getvalue())
    assert np.array_equal(got, fortran)  # the values in their order, whatever the layout


@pytest.mark.parametrize("header, why", [
    (b"{'descr': '<i4', 'fortran_order': False}", "exactly descr"),
    (b"{'descr': '<i4', 'fortran_order': False, 'shape': (-1,)}", "shape"),
    (b"__import__('os').system('true')", "not a Python literal"),
    (b"{'descr': 'not a dtype', 'fortran_order': False, 'shape': (1,)}", "dtype"),
])
def test_npy_version_3_headers_are_checked_not_evaluated(header, why):
    raw = b"\x93NUMPY\x03\x00" + struct.pack("<I", len(header)) + header + b"\0" * 4
    with pytest.raises(ValueError, match=why):
        npy_array(raw)


def test_npy_version_3_header_length_is_bounded():
    raw = b"\x93NUMPY\x03\x00" + struct.pack("<I", 1 << 30) + b"{}"
    with pytest.raises(ValueError, match="at most"):
        npy_array(raw)


_WRITTEN = [np.zeros((), np.float32), np.zeros(5, np.uint8), np.zeros((3, 4), "<i8"), np.zeros((0, 4), ">f4"),
            np.asfortranarray(np.zeros((2, 3), np.int16)), np.zeros((2, 1, 3), "<U7"), np.zeros(2, "S3"),
            np.zeros((12345, 2), np.bool_), np.zeros(3, np.complex64), np.zeros(1, np.float16)]


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_headers_as_numpy_writes_them_are_read_without_the_parser(version, monkeypatch):
    """Threads decoding .npy fields at once must not share Python's parser (see
    the next test): numpy's own headers are read by pattern."""
    def no_parser(text):
        raise AssertionError(f"parsed {text!r}")
    monkeypatch.setattr("feeder.storage.fields.ast.literal_eval", no_parser)
    for arr in _WRITTEN:
        buf = io.BytesIO()
        np.lib.format.write_array(buf, arr, version=version)
        got = npy_array(buf.getvalue())
        assert got.shape == arr.shape and got.dtype == arr.dtype.newbyteorder("=") and np.array_equal(got, arr)


def _cyclic_garbage_with_finalizers():
    class Finalized:
        def __del__(self):
            sum(range(50))  # Python code run by a collection, where threads switch
    obj = Finalized()
    obj.me = obj


def test_headers_needing_the_parser_are_read_by_one_thread_at_a_time():
    """Python's parser keeps interpreter-wide bookkeeping that threads parsing at
    once break (SystemError: AST constructor recursion depth mismatch) when a
    collection runs Python code mid-parse: a structured dtype's header, which
    only the parser reads, decoded by 8 threads while garbage with finalizers
    piles up."""
    arr = np.zeros((3, 4), dtype=[("a", "<f4"), ("b", "<i8", (2, 3))])
    raw = _npy(arr)
    errors: list[BaseException] = []

    def decode():
        try:
            for _ in range(1500):
                _cyclic_garbage_with_finalizers()
                got = npy_array(raw)
                assert got.dtype == arr.dtype and got.shape == arr.shape
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(50, 1, 1)
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=decode) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]


def test_npy_headers_in_another_spacing_are_read_by_the_parser():
    header = b"{ 'shape':(2,3) ,'fortran_order' : False, 'descr':'<i2' }\n"
    raw = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + np.arange(6, dtype="<i2").tobytes()
    assert np.array_equal(npy_array(raw), np.arange(6, dtype=np.int16).reshape(2, 3))


def test_npy_big_endian_becomes_native():
    arr = np.arange(6, dtype=">f4").reshape(2, 3)
    got = npy_array(_npy(arr))
    assert got.dtype.isnative and got.dtype == np.float32 and np.array_equal(got, arr)


def test_npy_is_a_copy_not_a_view_of_the_bytes():
    raw = bytearray(_npy(np.zeros(4, np.uint8)))
    got = npy_array(bytes(raw))
    got[0] = 9  # writable, and its own memory
    assert npy_array(bytes(raw))[0] == 0


@pytest.mark.parametrize("cut", [1, 8])
def test_npy_header_claiming_more_than_follows(cut):
    raw = _npy(np.zeros((4, 4), np.float64))[:-cut]
    with pytest.raises(ValueError, match=r"claims shape \(4, 4\) of float64 \(128 bytes\)") as err:
        npy_array(raw)
    assert f"{128 - cut} bytes follow" in str(err.value)


def test_npy_trailing_bytes_refused():
    with pytest.raises(ValueError, match="5 bytes follow"):
        npy_array(_npy(np.zeros(4, np.uint8)) + b"x")


def test_npy_object_array_refused():
    with pytest.raises(ValueError, match="object array"):
        npy_array(_npy(np.array([{"a": 1}], dtype=object), allow_pickle=True))


def test_npy_npz_and_garbage_refused():
    buf = io.BytesIO()
    np.savez(buf, a=np.zeros(2))
    with pytest.raises(ValueError, match=r"\.npz archive"):
        npy_array(buf.getvalue())
    with pytest.raises(ValueError):
        npy_array(b"\x93NUMPY garbage")
    with pytest.raises(ValueError):
        npy_array(b"")
    raw = bytearray(_npy(np.zeros(2)))
    raw[6] = 9  # major version 9
    with pytest.raises(ValueError, match="9"):
        npy_array(bytes(raw))


def test_json_value():
    assert json_value(b'{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
    assert json_value("é".encode().join([b'"', b'"'])) == "é"
    with pytest.raises(ValueError):
        json_value(b"{not json")
    with pytest.raises(RecursionError):
        json_value(b"[" * 100_000 + b"]" * 100_000)


def _plan(fields, seen, label="cls"):
    return make_plan(fields, set(seen), ", ".join(sorted(seen)), IMAGES, label, "shards/x")


def test_plan_none_and_auto():
    assert _plan(None, {"jpg", "cls", "json"}) is None
    assert _plan("auto", {"jpg", "cls"}) is None  # images and labels: pairs
    assert _plan("auto", {"jpg", "cls", "boxes.npy", "meta.json"}) == {
        "boxes.npy": ("boxes", "npy"), "meta.json": ("meta", "json"), "cls": ("label", "cls")}
    # With label=None, "cls" is not a field of "auto" either.
    assert _plan("auto", {"jpg", "cls", "txt"}, label=None) == {"txt": ("txt", "txt")}


def test_plan_list_and_mapping():
    seen = {"jpg", "cls", "boxes.npy", "meta.json"}
    assert _plan([".BOXES.NPY", "cls"], seen) == {"boxes.npy": ("boxes", "npy"), "cls": ("label", "cls")}
    assert _plan({"meta.json": "m", "boxes.npy": None}, seen) == {
        "meta.json": ("m", "json"), "boxes.npy": ("boxes", "npy")}
    assert _plan({"meta.json": "*", "boxes.npy": "b"}, seen)["meta.json"] == ("*", "json")


@pytest.mark.parametrize("fields, error, what", [
    ("everything", ValueError, "fields='everything': give 'auto'"),
    (5, TypeError, "fields=5: give 'auto'"),
    (["jpg"], ValueError, "names .jpg, an image field"),
    (["depth.npy"], ValueError, "names .depth.npy but no sample in shards/x has it; fields found: "
                                "boxes.npy, cls, jpg, meta.json, txt"),
    ({"meta.json": ""}, TypeError, "fields['meta.json'] = '': a field name is a non-empty str"),
    ({"meta.json": 3}, TypeError, "fields['meta.json'] = 3"),
    ({"boxes.npy": "*"}, ValueError, ".boxes.npy is not JSON"),
    ({"meta.json": "image"}, ValueError, "the field .meta.json would be named \"image\""),
    ({"meta.json": "x", "boxes.npy": "x"}, ValueError, "the fields .meta.json and .boxes.npy would "
                                                        "both be named 'x'"),
    ({"meta.json": "label", "cls": None}, ValueError, "would both be named 'label'"),
])
def test_plan_errors_say_what_is_wrong(fields, error, what):
    with pytest.raises(error) as err:
        _plan(fields, {"jpg", "cls", "boxes.npy", "meta.json", "txt"})
    assert what in str(err.value)


def test_plan_auto_name_clash_is_an_error():
    # "a.txt" and "a.json" both become field "a": auto cannot choose.
    with pytest.raises(ValueError, match="would both be named 'a'"):
        _plan("auto", {"jpg", "a.txt", "a.json"})
    json.dumps(_plan("auto", {"jpg", "a.txt", "b.json"}))  # plain data: pickles to workers
