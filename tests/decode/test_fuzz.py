"""Fuzzing the decode stage: valid JPEG and PNG bytes mutated by bit
flips, truncation, insertion, deletion and overwrites (biased towards the
headers, where the parsers branch), fed to ``feeder.decode.decode_image``
directly and through a small Feeder.

The property: the process never crashes, and every input yields either a
uint8 HxWx3 image or the feeder's documented error (``DecodeError`` from
``decode_image``; ``SampleError`` chaining a ``DecodeError`` from ``next()``).

Examples are derandomized, so CI runs the same inputs every time (no flaky
failures); raise ``FEEDER_FUZZ_EXAMPLES`` for a longer manual run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import MemorySource, drain, encode_png
from tests.support.faults import (SIDE, assert_exactly_once, delivered_hashes, distinct_jpegs, gray_jpeg, cmyk_jpeg,
                            progressive_jpeg,
                            pixel_hash, png16, smooth_rgb, wait_no_feeder_threads)
from feeder import DecodeError, Feeder, SampleError, ops
from feeder.decode import decode_image

EXAMPLES = int(os.environ.get("FEEDER_FUZZ_EXAMPLES", "150"))
MAX_PIXELS = 1 << 22  # keeps what a mutated header may legitimately ask for small


def _seeds() -> list[bytes]:
    rgb = smooth_rgb(3)
    rgba = np.concatenate([rgb, np.full(rgb.shape[:2] + (1,), 200, np.uint8)], axis=2)
    return [
        distinct_jpegs(1, seed=42)[0],                     # baseline JPEG, 4:2:0
        progressive_jpeg(rgb, 90),                          # progressive JPEG
        gray_jpeg(rgb[..., 0].copy()),                      # grayscale JPEG
        cmyk_jpeg(np.concatenate([rgb, rgb[..., :1]], 2)),  # 4-channel (YCCK) JPEG
        encode_png(rgb),                                    # RGB PNG
        encode_png(rgba),                                   # RGBA PNG
        png16(rgb.astype(np.uint16) * 257),                 # 16-bit PNG
    ]


SEEDS = _seeds()

position = st.one_of(st.integers(0, 63), st.integers(0, 1 << 16))  # half of them in the headers
mutation = st.one_of(
    st.tuples(st.just("flip"), position, st.integers(0, 7)),
    st.tuples(st.just("truncate"), position),
    st.tuples(st.just("insert"), position, st.binary(min_size=1, max_size=32)),
    st.tuples(st.just("overwrite"), position, st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), position, st.integers(1, 64)),
)


def mutate(data: bytes, ops_: list) -> bytes:
    buf = bytearray(data)
    for op in ops_:
        kind, pos = op[0], op[1]
        at = pos % (len(buf) + 1)
        if kind == "flip" and buf:
            buf[at % len(buf)] ^= 1 << op[2]
        elif kind == "truncate":
            del buf[at:]
        elif kind == "insert":
            buf[at:at] = op[2]
        elif kind == "overwrite":
            buf[at:at + len(op[2])] = op[2]
        elif kind == "delete":
            del buf[at:at + op[2]]
    return bytes(buf)


mutated = st.builds(mutate, st.sampled_from(SEEDS), st.lists(mutation, min_size=1, max_size=6))
# Pure noise behind each format's magic bytes reaches the parsers past format detection.
noise = st.builds(lambda magic, rest: magic + rest,
                  st.sampled_from([b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"", b"BM", b"GIF89a", b"P6\n"]),
                  st.binary(max_size=300))
inputs = st.one_of(mutated, mutated, mutated, noise)

FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def _check_image(img, size):
    assert isinstance(img, np.ndarray) and img.dtype == np.uint8
    assert img.ndim == 3 and img.shape[2] == 3 and img.flags.c_contiguous
    assert img.shape[:2] == tuple(size)  # no decode hint: the full size
    assert 0 < size[0] * size[1] <= MAX_PIXELS


@FUZZ
@given(data=inputs)
def test_decode_image_yields_an_image_or_decode_error(data):
    try:
        img, size = decode_image(data, max_pixels=MAX_PIXELS)
    except DecodeError:
        return
    _check_image(img, size)


@pytest.mark.parametrize("data", SEEDS, ids=["jpeg", "progressive", "gray-jpeg", "cmyk-jpeg", "png",
                                             "rgba-png", "png16"])
def test_fuzz_seeds_are_valid_images(data):
    """The seeds themselves decode: the mutations start from valid files."""
    img, size = decode_image(data)
    _check_image(img, size)


GOOD = distinct_jpegs(3, seed=4242)


def _crop_hash(blob: bytes) -> str:
    img, _ = decode_image(blob)
    o = (SIDE - 16) // 2
    return pixel_hash(img[o:o + 16, o:o + 16])


GOOD_HASHES = [_crop_hash(b) for b in GOOD]


@FUZZ
@given(data=inputs, on_error=st.sampled_from(["raise", "skip"]), ordered=st.booleans())
def test_mutated_file_through_a_feeder(data, on_error, ordered):
    blobs = [GOOD[0], data, GOOD[1], GOOD[2]]
    src = MemorySource(blobs, names=["good0.jpg", "fuzzed.jpg", "good1.jpg", "good2.jpg"])
    with Feeder(src, 2, [ops.CenterCrop(16)], seed=1, shuffle=False, ordered=ordered,
                decode_threads=2, augment_threads=1, on_error=on_error, max_pixels=MAX_PIXELS) as f:
        batches, err = drain(f, timeout=30)
        skipped = f.stats().skipped
    got = delivered_hashes(batches)
    seen = f"on_error={on_error} ordered={ordered} err={err!r} skipped={skipped} delivered={len(got)}"
    if err is not None:
        assert on_error == "raise", seen
        assert isinstance(err, SampleError), seen
        assert err.stage == "decode" and err.index == 1 and "fuzzed.jpg" in str(err), seen
        assert isinstance(err.__cause__, DecodeError), f"{seen} cause={err.__cause__!r}"
    elif skipped:
        assert on_error == "skip" and skipped == 1 and f.stats().skipped_paths == ("fuzzed.jpg",), seen
        assert_exactly_once(got, GOOD_HASHES)
    else:
        assert len(got) == 4, seen  # the mutated file decoded: it is delivered like any other
        assert_exactly_once([h for h in got if h in GOOD_HASHES], GOOD_HASHES)
    assert wait_no_feeder_threads(2.0) == [], seen


# --- fill bytes, against libjpeg-turbo's own Huffman decoder -----------------

from feeder import decode as _decode_module  # noqa: E402

_ext = _decode_module._jpeg


def _fill_seeds() -> list[bytes]:
    import cv2

    from feeder.synthetic import make_image
    rgb = np.ascontiguousarray(make_image(96, 80, seed=5)[..., ::-1])
    noise = np.random.default_rng(5).integers(-40, 40, rgb.shape)
    rgb = np.clip(rgb.astype(np.int16) + noise, 0, 255).astype(np.uint8)  # many FF 00 pairs
    out = []
    for params in ([], [cv2.IMWRITE_JPEG_RST_INTERVAL, 1],
                   [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444]):
        ok, buf = cv2.imencode(".jpg", rgb, [cv2.IMWRITE_JPEG_QUALITY, 97] + params)
        assert ok
        out.append(buf.tobytes())
    return out


FILL_SEEDS = _fill_seeds() if _ext is not None else []


def _scan_pairs(data: bytes) -> list[int]:
    """Offsets of the FF 00 pairs and markers (RSTn, EOI) in the scan."""
    sos = data.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")
    return [i for i in range(start, len(data) - 1)
            if data[i] == 0xFF and (data[i + 1] == 0 or 0xD0 <= data[i + 1] <= 0xD9)]


@st.composite
def _filled(draw):
    """(bytes, whether fill bytes went before a stuffed zero and nothing else
    was damaged)."""
    data = bytearray(FILL_SEEDS[draw(st.sampled_from(range(len(FILL_SEEDS))))])
    pairs = _scan_pairs(bytes(data))
    before_zero = False
    for at in sorted(draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=3, unique=True)), reverse=True):
        before_zero |= data[at + 1] == 0
        data[at:at] = b"\xff" * draw(st.integers(1, 3))
    if draw(st.booleans()):  # and a flipped bit somewhere in the scan
        data[draw(st.integers(pairs[0], len(data) - 3))] ^= 1 << draw(st.integers(0, 7))
        before_zero = False
    return bytes(data), before_zero


FILL_BOXES = [(0, 0, 96, 80), (40, 16, 56, 48), (88, 0, 8, 80)]


def _ext_decode(data: bytes, box, **kw):
    t, l, h, w = box
    out = np.zeros(h * w * 3, np.uint8)
    try:
        got = _ext.decode(data, t, l, h, w, 1, out, MAX_PIXELS, True, kw.pop("verify", True), **kw)
    except DecodeError:
        return None, None
    return out, got


@pytest.mark.skipif(_ext is None, reason="region decoder not in use")
def test_fill_seeds_decode_with_both_decoders():
    """The fill-byte fuzz starts from files both decoders decode, and that
    have stuffed zeros and markers to put fill bytes before."""
    for data in FILL_SEEDS:
        pairs = _scan_pairs(data)
        assert sum(data[i + 1] == 0 for i in pairs) >= 10 and sum(data[i + 1] != 0 for i in pairs) >= 1
        for box in FILL_BOXES:
            assert _ext_decode(data, box, own=False)[0] is not None and _ext_decode(data, box)[0] is not None


@pytest.mark.skipif(_ext is None, reason="region decoder not in use")
@FUZZ
@given(case=_filled(), box=st.sampled_from(FILL_BOXES))
def test_fill_bytes_the_own_decoder_is_never_laxer_than_libjpeg(case, box):
    """Fill bytes before stuffed zeros (refused) and before markers (valid),
    with or without other damage: feeder's decoder refuses what libjpeg-turbo's
    refuses, gives its pixels where both decode, and a decode from the index
    recorded on the way gives them again."""
    data, before_zero = case
    lib, _ = _ext_decode(data, box, own=False)
    mine, got = _ext_decode(data, box, record=True, max_points=4096)
    assert not (lib is None and mine is not None), "libjpeg refused, the own decoder passed"
    assert not (before_zero and mine is not None), "fill bytes before a stuffed zero passed"
    if mine is None:
        return
    assert np.array_equal(lib, mine)
    if got[2] is not None:
        again, _ = _ext_decode(data, box, verify=False, index=got[2])
        assert again is not None and np.array_equal(again, lib)
