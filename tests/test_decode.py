"""Decoding: formats, colour conversions, reduced-scale JPEG decode, limits."""

from __future__ import annotations

import numpy as np
import pytest
import simplejpeg

from conftest import encode_jpeg, encode_png
from feeder import DecodeError
from feeder.work.decode import decode_image
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
