"""Decoding: formats, colour conversions, reduced-scale JPEG decode, limits."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import simplejpeg

from conftest import JOIN_TIMEOUT_S, MemorySource, drain, encode_jpeg, encode_png
from jpeg_helpers import LOSSLESS, lossless_shown, other_process
from feeder import DecodeError, Feeder, ops
from feeder.work import decode as _decode
from feeder.work.decode import DecodeBuffers, decode_image
from feeder.synthetic import make_image


def bands() -> np.ndarray:
    """Three flat colour bands: exact colours survive JPEG well enough to check."""
    rgb = np.zeros((32, 48, 3), np.uint8)
    rgb[:, :16] = (200, 30, 30)
    rgb[:, 16:32] = (20, 180, 40)
    rgb[:, 32:] = (10, 20, 220)
    return rgb


def centre_colours(img: np.ndarray) -> np.ndarray:
    return img[16, [8, 24, 40]].astype(int)


def test_jpeg_rgb():
    img, size = decode_image(encode_jpeg(bands(), 95))
    assert img.shape == (32, 48, 3) and img.dtype == np.uint8 and size == (32, 48)
    assert np.abs(centre_colours(img) - centre_colours(bands())).max() <= 6


def test_png_rgb_exact():
    img, _ = decode_image(encode_png(bands()))
    np.testing.assert_array_equal(img, bands())


def test_grayscale_jpeg_and_png_become_three_channels():
    gray = np.tile(np.arange(0, 256, 8, dtype=np.uint8), (16, 1))
    j = simplejpeg.encode_jpeg(gray[..., None], quality=95, colorspace="GRAY")
    for data in (j, encode_png(gray)):
        img, _ = decode_image(data)
        assert img.shape == (16, 32, 3)
        assert (img[..., 0] == img[..., 1]).all() and (img[..., 1] == img[..., 2]).all()
        assert np.abs(img[..., 0].astype(int) - gray).max() <= 3


def test_rgba_png_drops_alpha():
    rgba = np.concatenate([bands(), np.full((32, 48, 1), 77, np.uint8)], axis=2)
    img, _ = decode_image(encode_png(rgba))
    np.testing.assert_array_equal(img, bands())


def test_16bit_png_scaled_to_8bit():
    rgb16 = bands().astype(np.uint16) * 257 + 100  # 200 -> 51500, rounds back to 200
    img, _ = decode_image(encode_png(rgb16))
    assert img.dtype == np.uint8
    assert np.abs(img.astype(int) - bands().astype(int)).max() <= 1


def test_cmyk_jpeg_to_rgb():
    rgb = bands().astype(float)
    k = 255 - rgb.max(-1)
    denom = np.maximum(1e-6, 255 - k)
    cmy = [(255 * ((255 - rgb[..., i]) - k) / denom) for i in range(3)]
    cmyk = np.stack(cmy + [k], -1).round().astype(np.uint8)
    # Adobe applications store CMYK inverted; decoders (and feeder) assume so.
    data = simplejpeg.encode_jpeg(np.ascontiguousarray(255 - cmyk), quality=95, colorspace="CMYK")
    assert simplejpeg.decode_jpeg_header(data)[2] in ("CMYK", "YCCK")
    img, size = decode_image(data)
    assert img.shape == (32, 48, 3) and size == (32, 48)
    assert np.abs(centre_colours(img) - centre_colours(bands())).max() <= 8


@pytest.mark.parametrize("need, expect", [
    ((200, 300), (250, 375)),   # 1/4 scale still covers 200x300
    ((126, 190), (250, 375)),   # ... and so does a slightly larger need
    ((100, 140), (125, 188)),   # 1/8 scale
    ((300, 400), (375, 563)),   # 3/8
    ((500, 751), (1000, 1500)), # would need a scale above 1/2: full decode
])
def test_scaled_jpeg_decode_gives_smallest_covering_size(need, expect):
    data = encode_jpeg(make_image(1000, 1500, 0), 90)
    img, size = decode_image(data, hint=lambda h, w, key: need)
    assert size == (1000, 1500)
    assert img.shape[:2] == expect
    assert img.shape[0] >= need[0] or expect == (1000, 1500)
    assert img.shape[1] >= need[1] or expect == (1000, 1500)


def test_hint_receives_header_size_and_key():
    seen = []
    data = encode_jpeg(make_image(40, 60, 1))
    decode_image(data, hint=lambda h, w, key: seen.append((h, w, key)), key=99)
    assert seen == [(40, 60, 99)]


def test_png_is_recognised_by_content_not_name():
    img, _ = decode_image(encode_png(bands()))  # no name involved at all
    assert img.shape == (32, 48, 3)


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (b"hello, I am a text file\n", "not a decodable image"),
    (b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4, "JPEG"),
])
def test_bad_bytes_raise_decode_error(data, match):
    with pytest.raises(DecodeError, match=match):
        decode_image(data)


def test_truncated_jpeg_is_an_error():
    data = encode_jpeg(make_image(120, 160, 3), 90)
    with pytest.raises(DecodeError):
        decode_image(data[: len(data) // 2])


def test_max_pixels_rejects_from_header():
    data = encode_jpeg(make_image(40, 60, 1))
    with pytest.raises(DecodeError, match="max_pixels"):
        decode_image(data, max_pixels=40 * 60 - 1)
    png = encode_png(bands())
    with pytest.raises(DecodeError, match="max_pixels"):
        decode_image(png, max_pixels=100)
    assert decode_image(data, max_pixels=40 * 60)[0].shape == (40, 60, 3)


# -- lossless JPEGs ------------------------------------------------------------------


@pytest.fixture(params=["extension", "simplejpeg"])
def jpeg_path(request, monkeypatch):
    """Each JPEG decoder path: feeder's extension (where built), and simplejpeg alone."""
    if request.param == "extension" and _decode._jpeg is None:
        pytest.skip(f"the extension is not in use: {_decode._jpeg_missing}")
    if request.param == "simplejpeg":
        monkeypatch.setattr(_decode, "_jpeg", None)
    return request.param


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("need", [None, (10, 12), (1, 1)])
def test_lossless_jpeg_is_decoded_whole_and_exact(jpeg_path, name, need):
    """DCT scaling means nothing to a lossless file: simplejpeg's libjpeg-turbo
    (3.0 to 3.1.3) decoded it at full size into an image sized for the scale the
    hint allowed (garbage, mean error near 80 grey levels); the extension's
    system libjpeg-turbo 2.1 refused it as a corrupt header. Both paths decode
    it whole, to the samples it stores."""
    data = other_process(name)
    want = lossless_shown(name)
    hint = None if need is None else (lambda h, w, key: need)
    img, size = decode_image(data, hint=hint, buffers=DecodeBuffers())
    assert size == want.shape[:2]
    np.testing.assert_array_equal(img, want)


_LOSSLESS_NO_BUFFERS = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from feeder.work import decode as _decode
from jpeg_helpers import LOSSLESS, lossless_shown, other_process
assert _decode._jpeg is None, "the simplejpeg path is forced"
for name in LOSSLESS:
    for need in ((10, 12), (1, 1), (23, 31)):
        img, size = _decode.decode_image(other_process(name), hint=lambda h, w, key: need)
        assert np.array_equal(img, lossless_shown(name)), (name, need, img.shape)
print("exact")
"""


def test_lossless_jpeg_with_a_hint_and_no_buffers_does_not_overrun():
    """Without buffers, simplejpeg allocated the scaled image and its
    libjpeg-turbo wrote the full-size one into it: a heap overrun. In a
    subprocess on the simplejpeg path, so that a crash fails only this test."""
    env = {**os.environ, "FEEDER_NO_JPEG_EXT": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(_decode.__file__))),
                                          os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _LOSSLESS_NO_BUFFERS, os.path.dirname(os.path.abspath(__file__))],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "exact", (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("chain", [
    lambda: [ops.RandomResizedCrop(24)],
    lambda: [ops.Resize(30), ops.CenterCrop(24)],
], ids=["RandomResizedCrop", "Resize+CenterCrop"])
def test_feeder_crops_lossless_jpegs_as_the_same_pixels_in_png(jpeg_path, chain):
    """A Feeder over lossless JPEGs delivers what it delivers for PNGs of the
    pixels they store: decoded whole at full size, then the same crop."""
    names = LOSSLESS * 2
    batches = {}
    for kind in ("jpeg", "png"):
        blobs = [other_process(n) if kind == "jpeg" else encode_png(lossless_shown(n)) for n in names]
        with Feeder(MemorySource(blobs), 4, chain(), seed=11, ordered=True) as f:
            batches[kind], err = drain(f, JOIN_TIMEOUT_S)
        assert err is None, err
    assert len(batches["jpeg"]) == len(batches["png"]) == 2
    for (x, y), (rx, ry) in zip(batches["jpeg"], batches["png"]):
        np.testing.assert_array_equal(y, ry)
        np.testing.assert_array_equal(x, rx)


def test_decode_buffers_take_back_only_their_own():
    pool = DecodeBuffers()
    foreign = np.zeros(1000, np.uint8)
    pool.give(foreign)
    assert pool.take(100) is not foreign
    own = pool.take(100)
    pool.give(own)
    assert pool.take(100) is own
