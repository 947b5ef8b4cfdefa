"""Decoding: formats, colour conversions, reduced-scale JPEG decode, limits."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import simplejpeg

from tests.support import JOIN_TIMEOUT_S, REPO_DIR, MemorySource, drain, encode_jpeg, encode_png
from tests.support.jpeg import LOSSLESS, lossless_shown, other_process
import feeder
from feeder import DecodeError, Feeder, ops
from feeder import decode as _decode
from feeder.decode import DecodeBuffers, decode_image
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
        monkeypatch.setattr(_decode.extension, "jpeg", None)
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
from feeder import decode as _decode
from tests.support.jpeg import LOSSLESS, lossless_shown, other_process
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
    r = subprocess.run([sys.executable, "-c", _LOSSLESS_NO_BUFFERS, REPO_DIR],
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


# -- images given decoded (arrays, tensors, PIL images) -----------------------------

def _pil():
    return pytest.importorskip("PIL.Image")


def _pil_png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _rgb(i: int) -> np.ndarray:
    """Image ``i`` of a set of different sizes, random pixels (every interpolation shows)."""
    return np.random.default_rng(i).integers(0, 256, (40 + 3 * i, 50 + 2 * i, 3), dtype=np.uint8)


def _gray(i: int) -> np.ndarray:
    return _rgb(i)[..., 1].copy()


def _given(kind: str, i: int) -> tuple[object, bytes]:
    """Image ``i`` given decoded as ``kind``, and the same pixels as a PNG file."""
    import torch

    rgb, gray = _rgb(i), _gray(i)
    if kind == "numpy rgb":
        return rgb, encode_png(rgb)
    if kind == "numpy gray":
        return gray, encode_png(gray)
    if kind == "numpy gray hw1":
        return gray[:, :, None], encode_png(gray)
    if kind == "numpy rgba":
        rgba = np.dstack([rgb, gray])
        return rgba, encode_png(rgba)
    if kind == "numpy slice":
        big = np.random.default_rng(100 + i).integers(0, 256, (90, 100, 3), dtype=np.uint8)
        view = big[7:7 + rgb.shape[0], 3:3 + rgb.shape[1]]
        return view, encode_png(np.ascontiguousarray(view))
    if kind == "numpy reversed":
        view = rgb[::-1, ::-1]
        return view, encode_png(np.ascontiguousarray(view))
    if kind == "numpy of a flat buffer":
        flat = rgb.reshape(-1).copy()
        return flat.reshape(rgb.shape), encode_png(rgb)
    if kind == "torch chw":
        return torch.from_numpy(rgb).permute(2, 0, 1), encode_png(rgb)
    if kind == "torch chw contiguous":
        return torch.from_numpy(rgb).permute(2, 0, 1).contiguous(), encode_png(rgb)
    if kind == "torch hwc":
        return torch.from_numpy(rgb), encode_png(rgb)
    if kind == "torch gray":
        return torch.from_numpy(gray), encode_png(gray)
    if kind == "torch 1hw":
        return torch.from_numpy(gray)[None], encode_png(gray)
    image = _pil()
    if kind == "PIL RGB":
        return image.fromarray(rgb), encode_png(rgb)
    if kind == "PIL L":
        return image.fromarray(gray), encode_png(gray)
    if kind == "PIL RGBA":
        rgba = np.dstack([rgb, gray])
        return image.fromarray(rgba), encode_png(rgba)
    if kind == "PIL P":
        p = image.fromarray(rgb).quantize(37)
        return p, _pil_png(p)
    if kind == "PIL 1":
        one = image.fromarray(gray > 128)
        return one, _pil_png(one)
    if kind == "PIL LA":
        la = image.fromarray(np.dstack([gray, rgb[..., 0]]), "LA")
        return la, _pil_png(la)
    if kind == "PIL I;16":
        wide = (rgb[..., 0].astype(np.uint16) << 8) | rgb[..., 2]
        return image.fromarray(wide), encode_png(wide)
    raise AssertionError(kind)


GIVEN_KINDS = ["numpy rgb", "numpy gray", "numpy gray hw1", "numpy rgba", "numpy slice",
               "numpy reversed", "numpy of a flat buffer", "torch chw", "torch chw contiguous",
               "torch hwc", "torch gray", "torch 1hw", "PIL RGB", "PIL L", "PIL RGBA", "PIL P",
               "PIL 1", "PIL LA", "PIL I;16"]

GIVEN_CHAINS = {
    "crop+flip": dict(transforms=[ops.RandomResizedCrop(24), ops.RandomHorizontalFlip()]),
    "resize+centre": dict(transforms=[ops.Resize(30), ops.CenterCrop(24)]),
    "none, variable": dict(transforms=[], max_image_size=(64, 80)),
    "resize+flip, variable": dict(transforms=[ops.Resize(30), ops.RandomHorizontalFlip()],
                                  max_image_size=(64, 80)),
}


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a.keys())
    return a == b


def _batches(source, **kwargs) -> list:
    with Feeder(source, batch_size=3, seed=11, timeout=60, **kwargs) as f:
        return [b for b in f]


@pytest.mark.parametrize("chain", list(GIVEN_CHAINS))
@pytest.mark.parametrize("kind", GIVEN_KINDS)
def test_decoded_images_give_the_batches_of_the_same_png(kind, chain):
    given = [_given(kind, i) for i in range(7)]
    kwargs = GIVEN_CHAINS[chain]
    got = _batches(MemorySource([g for g, _ in given]), **kwargs)
    want = _batches(MemorySource([png for _, png in given]), **kwargs)
    assert len(got) == 3 and _same(got, want)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_decoded_images_in_the_isolated_engine(start_method):
    kinds = ["numpy rgb", "torch chw", "numpy gray"] if start_method == "fork" else ["numpy slice"]
    for kind in kinds:
        given = [_given(kind, i) for i in range(7)]
        kwargs = dict(GIVEN_CHAINS["crop+flip"], isolation="process", start_method=start_method)
        got = _batches(MemorySource([g for g, _ in given]), **kwargs)
        want = _batches(MemorySource([png for _, png in given]), **GIVEN_CHAINS["crop+flip"])
        assert len(got) == 3 and _same(got, want), kind


class _DictSource:
    def __init__(self, samples: list[dict]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int) -> dict:
        return self.samples[index]


def _mask(i: int) -> np.ndarray:
    return np.random.default_rng(50 + i).integers(0, 21, _rgb(i).shape[:2], dtype=np.uint8)


def _given_mask(kind: str, i: int) -> tuple[object, bytes]:
    import torch

    mask = _mask(i)
    if kind == "numpy uint16":
        wide = mask.astype(np.uint16) * 3000
        return wide, encode_png(wide)
    if kind == "torch uint8":
        return torch.from_numpy(mask), encode_png(mask)
    image = _pil()
    if kind == "PIL L":
        return image.fromarray(mask), encode_png(mask)
    if kind == "PIL P":
        p = image.fromarray(mask, "L").convert("P")
        p.putpalette(list(np.random.default_rng(0).integers(0, 256, 768, dtype=np.uint8)))
        return p, _pil_png(p)
    if kind == "PIL I;16":
        wide = mask.astype(np.uint16) * 3000
        return image.fromarray(wide), encode_png(wide)
    raise AssertionError(kind)


@pytest.mark.parametrize("mask_kind", ["numpy uint16", "torch uint8", "PIL L", "PIL P", "PIL I;16"])
def test_decoded_masks_give_the_batches_of_the_same_png(mask_kind):
    images = [_given("numpy rgb", i) for i in range(7)]
    masks = [_given_mask(mask_kind, i) for i in range(7)]
    kwargs = GIVEN_CHAINS["crop+flip"]
    got = _batches(_DictSource([{"image": g, "mask": m} for (g, _), (m, _) in zip(images, masks)]),
                   **kwargs)
    want = _batches(_DictSource([{"image": p, "mask": q} for (_, p), (_, q) in zip(images, masks)]),
                    **kwargs)
    assert len(got) == 3 and _same(got, want)


def _bad_images():
    import torch

    image = _pil()
    ok = _rgb(0)
    return [
        ("float32", ok.astype(np.float32) / 255, "float32"),
        ("uint16", ok.astype(np.uint16), "uint16"),
        ("two channels", ok[..., :2], "(40, 50, 2)"),
        ("numpy CHW", ok.transpose(2, 0, 1), "(3, 40, 50)"),
        ("4-D", ok[None], "(1, 40, 50, 3)"),
        ("torch float", torch.from_numpy(ok).permute(2, 0, 1).float(), "torch.float32"),
        ("torch bfloat16", torch.from_numpy(ok).permute(2, 0, 1).to(torch.bfloat16), "torch.bfloat16"),
        ("PIL F", image.fromarray(ok[..., 0].astype(np.float32)), "'F'"),
        ("PIL CMYK", image.fromarray(ok).convert("CMYK"), "'CMYK'"),
    ]


@pytest.mark.parametrize("pair", [True, False], ids=["pair", "dict"])
def test_a_decoded_image_of_another_dtype_or_shape_names_the_sample_and_field(pair):
    for what, bad, said in _bad_images():
        images = [_rgb(i) for i in range(5)]
        images[3] = bad
        samples = [(im, i) for i, im in enumerate(images)] if pair else [{"image": im} for im in images]
        with pytest.raises(feeder.SampleError) as info:
            _batches(_DictSource(samples), **GIVEN_CHAINS["crop+flip"])
        err = info.value
        assert err.index == 3 and err.field == "image", what
        assert said in str(err) and "sample 3" in str(err), (what, str(err))
        with pytest.raises(feeder.FieldError, match=re.escape(said)):
            feeder.check_sample(samples[3])


def test_a_decoded_image_above_max_pixels_is_refused_naming_it():
    images = [_rgb(0)[:20, :20], _rgb(1)]  # 400 and 43 * 52 pixels
    with pytest.raises(feeder.SampleError, match="max_pixels=1000") as info:
        _batches(MemorySource(images), transforms=[ops.RandomResizedCrop(16)], max_pixels=1000)
    assert info.value.index == 1 and info.value.field == "image"


def test_check_sample_takes_decoded_images():
    import torch

    feeder.check_sample((_rgb(0), 1))
    feeder.check_sample({"image": torch.from_numpy(_rgb(0)).permute(2, 0, 1), "mask": _mask(0)})
    feeder.check_sample({"image": _pil().fromarray(_rgb(0)), "mask": _pil().fromarray(_mask(0))})
    with pytest.raises(feeder.SourceError, match=r"\(image, label\)"):
        feeder.check_sample(_rgb(0))


UNTOUCHED_CHAINS = [
    dict(transforms=[ops.RandomResizedCrop(24), ops.RandomHorizontalFlip(1.0)]),
    dict(transforms=[ops.Resize(30), ops.CenterCrop(24)]),
    dict(transforms=[ops.RandomHorizontalFlip(1.0), ops.RandomCrop(24)]),
    dict(transforms=[ops.ColorJitter(0.4, 0.4, 0.4, 0.1), ops.CenterCrop(24)]),
    dict(transforms=[ops.TrivialAugmentWide(), ops.RandomResizedCrop(24)]),
    dict(transforms=[ops.RandAugment(), ops.CenterCrop(24)]),
    dict(transforms=[ops.RandomPhotometricDistort(p=1.0), ops.RandomZoomOut(p=1.0),
                     ops.RandomIoUCrop(), ops.Resize((24, 24))]),
    dict(transforms=[ops.RandomHorizontalFlip(1.0)], max_image_size=(64, 80)),
    dict(transforms=[], max_image_size=(64, 80)),
]


@pytest.mark.parametrize("chain", range(len(UNTOUCHED_CHAINS)))
def test_a_source_s_arrays_are_never_written(chain):
    kwargs = UNTOUCHED_CHAINS[chain]
    boxes = np.array([[2, 3, 30, 35]], np.float32)
    # Read-only arrays: a write fails loudly; writable ones: compared after the pass.
    for writable in (False, True):
        images = [_rgb(i) for i in range(6)]
        masks = [_mask(i) for i in range(6)]
        for a in images + masks:
            a.flags.writeable = writable
        before = [a.copy() for a in images + masks]
        samples = [{"image": im, "mask": m, "boxes": boxes} for im, m in zip(images, masks)]
        assert len(_batches(_DictSource(samples), **kwargs)) == 2
        assert all(np.array_equal(a, b) for a, b in zip(images + masks, before))


def test_an_array_behind_a_decoded_image_never_becomes_decode_memory():
    # A view of a flat array has that array as its .base, as a pool buffer's
    # decoded image has the buffer: JPEGs decoded after it must not write there.
    flats = [_rgb(i).reshape(-1).copy() for i in range(4)]
    blobs = [encode_jpeg(_rgb(i)) for i in range(4, 12)]
    samples = [f.reshape(_rgb(i).shape) for i, f in enumerate(flats)] + blobs
    before = [f.copy() for f in flats]
    _batches(MemorySource(samples), transforms=[ops.RandomResizedCrop(24)], decode_threads=1)
    assert all(np.array_equal(f, b) for f, b in zip(flats, before))


def test_decode_buffers_take_back_only_their_own():
    pool = DecodeBuffers()
    foreign = np.zeros(1000, np.uint8)
    pool.give(foreign)
    assert pool.take(100) is not foreign
    own = pool.take(100)
    pool.give(own)
    assert pool.take(100) is own


def test_a_pass_over_decoded_images_resumes_as_over_their_files():
    given = [_given("torch chw", i) for i in range(10)]
    kwargs = dict(GIVEN_CHAINS["crop+flip"], batch_size=2, seed=5)
    with Feeder(MemorySource([png for _, png in given]), **kwargs) as f:
        want = [b for b in f]
    with Feeder(MemorySource([g for g, _ in given]), **kwargs) as f:
        it = iter(f)
        first = [next(it) for _ in range(2)]
        state = f.state_dict()
    with Feeder(MemorySource([g for g, _ in given]), **kwargs) as f:
        f.load_state_dict(state)
        rest = [b for b in f]
    assert _same(first + rest, want)


def test_a_jpeg_decoder_is_one_settings_object_whichever_decoder_it_uses():
    """JpegDecoder holds one feeder's settings: given no region decoder it decodes
    as simplejpeg does; by default it uses the extension as loaded now, also after
    a pickle (the worker process's copy)."""
    import pickle

    from feeder.decode import extension
    from feeder.decode.jpeg import JpegDecoder

    data = encode_jpeg(bands())
    img, size, planned = JpegDecoder(ext=None).decode(data, None, 0)
    want = simplejpeg.decode_jpeg(data, colorspace="RGB")
    assert np.array_equal(img, want) and size == want.shape[:2] and planned is None
    with pytest.raises(DecodeError, match="exceeds max_pixels"):
        JpegDecoder(max_pixels=want.shape[0] * want.shape[1] - 1, ext=None).decode(data, None, 0)
    assert pickle.loads(pickle.dumps(JpegDecoder())).ext is extension.jpeg
