"""The JPEG region decoder (``feeder.decode._jpeg``, built against the system's
libjpeg-turbo) and the fallback to simplejpeg without it.

* The region it decodes is bit-identical to a full decode (at the same DCT
  scale) cropped, for every subsampling, gray, progressive and restart-marker
  files, at 1/1, 1/2, 1/4 and 1/8; a decode that its libjpeg-turbo did not
  scale as asked (a lossless file on 3.x) is an error.
* Through the transforms: RandomResizedCrop, Resize + CenterCrop, CenterCrop
  and Resize give the same pixels as the simplejpeg path wherever both decode at
  the same scale (always at 1/1: the crop before the resize is a full decode's),
  with EXIF orientation, masks and boxes; at 1/2..1/8 against a full-size
  decode within the stated tolerance (:data:`SCALED_TOLERANCE`).
* Errors and libjpeg warnings are ``DecodeError``; ``max_pixels`` is checked
  before decoding.
* ``FEEDER_NO_JPEG_EXT=1`` forces the fallback (checked in a subprocess), and
  the in-process tests compare against the fallback by switching the module's
  decoder off.
* Fuzzing: mutated JPEGs of every kind give an image or ``DecodeError``.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

import cv2
import numpy as np
import pytest
import simplejpeg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import JOIN_TIMEOUT_S, MemorySource, drain
from tests.support.jpeg import KINDS, SUBSAMPLING, jpeg, run_on_other_libjpeg, other_process
from feeder import DecodeError, Feeder, info, ops
from feeder import decode as _decode
from feeder.ops.chain import Chain
from feeder.engine.steps import SampleWork
from feeder.synthetic import make_image

ext = _decode._jpeg
needs_ext = pytest.mark.skipif(ext is None, reason=f"region decoder not in use: {_decode._jpeg_missing}")

#: At DCT scales 1/2..1/8, the delivered image against "full decode, crop,
#: resize" differs by at most this mean absolute difference per image, in grey
#: levels (the reduced IDCT averages blocks where the resize would interpolate:
#: the same difference as the simplejpeg path's reduced-scale decode, which it
#: equals at the same scale). Measured on make-data's photograph-like images:
#: 2.3-4.1 on average, 5.6 for the worst image; on this file's synthetic images
#: (hard edges, fine texture) up to 11 at 1/4 (bench/README.md).
SCALED_TOLERANCE = 12.0


def full_at_scale(data: bytes, denom: int) -> np.ndarray:
    """simplejpeg's whole-image decode at 1/denom: the reference."""
    h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    if denom == 1:
        return simplejpeg.decode_jpeg(data, colorspace="RGB")
    img = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-h // denom), min_width=-(-w // denom))
    assert img.shape[:2] == (-(-h // denom), -(-w // denom))
    return img


def region(data: bytes, top: int, left: int, h: int, w: int, denom: int, compact: bool,
           verify: bool = True) -> np.ndarray:
    buf = np.empty(h * (w + 2 * ext.PAD + 32) * 3, np.uint8)
    stride, offset = ext.decode(data, top, left, h, w, denom, buf, 1 << 30, compact, verify)
    return buf[:h * stride * 3].reshape(h, stride, 3)[:, offset:offset + w]


@needs_ext
@pytest.mark.parametrize("kind", KINDS)
def test_region_is_bit_identical_to_a_full_decode_cropped(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    data = jpeg(make_image(203, 317, seed=3), kind)
    for denom in (1, 2, 4, 8):
        ref = full_at_scale(data, denom)
        H, W = ref.shape[:2]
        boxes = [(0, 0, H, W), (H - 1, W - 1, 1, 1)]
        for _ in range(25):
            t, l = int(rng.integers(0, H)), int(rng.integers(0, W))
            boxes.append((t, l, int(rng.integers(1, H - t + 1)), int(rng.integers(1, W - l + 1))))
        for t, l, h, w in boxes:
            for compact in (False, True):
                got = region(data, t, l, h, w, denom, compact)
                np.testing.assert_array_equal(got, ref[t:t + h, l:l + w],
                                              err_msg=f"{kind} 1/{denom} box {(t, l, h, w)}")


_LOSSLESS_ON_3X = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from tests.support.jpeg import other_process, stored_scene
from feeder.errors import DecodeError
from feeder.decode import _jpeg as ext
from feeder.decode import decode_image
loaded = [l.split()[-1] for l in open("/proc/self/maps") if "libjpeg" in l]
assert any(sys.argv[2] in l for l in loaded), loaded
data = other_process("lossless_rgb_8x6.jpg")
want = stored_scene(6, 8, 3)
out = np.zeros(1 << 12, np.uint8)
ext.decode(data, 0, 0, 6, 8, 1, out, 1 << 20, True)  # at full size, libjpeg-turbo 3.x reads it
assert np.array_equal(out[:6 * 8 * 3].reshape(6, 8, 3), want)
for denom in (2, 4, 8):
    for verify in (True, False):
        h, w = -(-6 // denom), -(-8 // denom)
        try:
            ext.decode(data, 0, 0, h, w, denom, out, 1 << 20, True, verify)
            print("decoded", denom, verify)
        except DecodeError as exc:
            assert f"not at scale 1/{denom}" in str(exc), str(exc)
img, _ = decode_image(data, hint=lambda h, w, key: (2, 2))
assert np.array_equal(img, want)
print("done")
"""


@needs_ext
def test_extension_refuses_a_scale_its_libjpeg_did_not_apply():
    """libjpeg-turbo 3.x reads lossless files and decodes them at full size
    whatever the scale: the extension's region, in pixels of the scaled image,
    then named other rows (with verify=False and no column crop, no error at
    all). It checks the scale it got; feeder itself decodes lossless files
    whole. Here the extension runs on Pillow's bundled libjpeg-turbo (3.x)."""
    out = run_on_other_libjpeg(_LOSSLESS_ON_3X)
    assert out.strip() == "done", out


@needs_ext
def test_header_reports_size_colour_space_subsampling_and_progressive():
    img = make_image(40, 60, seed=1)
    assert ext.header(jpeg(img, "4:2:2")) == (60, 40, 3, "YCbCr", "4:2:2", False)
    assert ext.header(jpeg(img, "gray")) == (60, 40, 1, "Gray", "gray", False)
    assert ext.header(jpeg(img, "progressive"))[5] is True


@needs_ext
def test_errors_and_warnings_are_decode_errors():
    data = jpeg(make_image(120, 160, seed=2), "4:2:0")
    with pytest.raises(DecodeError, match="corrupt JPEG header"):
        ext.header(b"\xff\xd8\xff" + bytes(range(200)))
    # Cut in the scan: libjpeg only warns ("Premature end of JPEG file") and
    # would fill the rest with grey; here it is an error.
    with pytest.raises(DecodeError, match="corrupt JPEG: Premature end"):
        region(data[:len(data) // 2], 0, 0, 120, 160, 1, False)
    with pytest.raises(DecodeError, match="outside"):
        region(data, 100, 0, 21, 160, 1, False)
    with pytest.raises(DecodeError, match="max_pixels"):
        ext.decode(data, 0, 0, 1, 1, 1, np.empty(1 << 16, np.uint8), 120 * 160 - 1)
    with pytest.raises(DecodeError, match="smaller"):
        ext.decode(data, 0, 0, 120, 160, 1, np.empty(100, np.uint8), 1 << 30)
    with pytest.raises(ValueError, match="denom"):
        ext.decode(data, 0, 0, 1, 1, 3, np.empty(1 << 16, np.uint8), 1 << 30)
    with pytest.raises((TypeError, BufferError)):
        ext.decode(data, 0, 0, 1, 1, 1, bytes(1 << 16), 1 << 30)  # read-only output


@needs_ext
def test_max_pixels_is_checked_from_the_header_before_any_allocation():
    """A small file whose header claims 40000 x 40000 pixels is refused before the
    transforms draw a box or any output memory is taken."""
    data = jpeg(make_image(64, 80, seed=3), "4:2:0")
    sof = data.index(b"\xff\xc0")  # baseline SOF: length, precision, height, width
    big = data[:sof + 5] + struct.pack(">HH", 40000, 40000) + data[sof + 9:]
    assert ext.header(big)[:2] == (40000, 40000)

    taken, planned = [], []

    class Pool(_decode.DecodeBuffers):
        def take(self, nbytes):
            taken.append(nbytes)
            return super().take(nbytes)

    work = SampleWork(Chain([ops.RandomResizedCrop(32)], None), max_pixels=1 << 24)
    work.buffers = Pool()
    plan = work.plan
    work.plan = lambda *a: planned.append(a) or plan(*a)
    with pytest.raises(DecodeError, match="max_pixels"):
        work.decode(big, 1)
    assert taken == [] and planned == []
    img, ctx = work.decode(data, 1)  # the real size passes, through the region decoder
    assert ctx.origin is not None and taken


def _cmyk_blobs() -> list[bytes]:
    from tests.support.faults import cmyk_jpeg

    h, w = 120, 170
    y, x = np.mgrid[0:h, 0:w]
    cmyk = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) * 255 // (h + w)),
                     128 + 100 * np.sin(x / 9.0) * np.cos(y / 7.0)], axis=2).astype(np.uint8)
    blobs = [cmyk_jpeg(cmyk)]  # libjpeg-turbo writes YCCK
    try:
        from tests.support.faults import pil_jpeg

        blobs.append(pil_jpeg(make_image(h, w, seed=6), "CMYK"))  # Pillow writes Adobe CMYK
    except ImportError:
        pass
    return blobs


@needs_ext
@pytest.mark.parametrize("chain", [
    lambda: [ops.RandomResizedCrop(64), ops.RandomHorizontalFlip()],
    lambda: [ops.Resize(100), ops.CenterCrop(90)],
    lambda: [ops.CenterCrop(80)],
], ids=["rrc", "eval", "centercrop"])
def test_cmyk_and_ycck_take_the_fallback_with_the_same_result(chain, monkeypatch):
    """libjpeg-turbo cannot convert CMYK/YCCK to RGB: with the extension built such
    a file is decoded whole by OpenCV, as without it, and gets the same crop."""
    blobs = _cmyk_blobs()
    assert {ext.header(b)[3] for b in blobs} <= {"CMYK", "YCCK"} and ext.header(blobs[0])[3] == "YCCK"
    got, ctxs = _outputs(chain(), blobs)
    assert all(c.origin is None for c in ctxs), "no CMYK/YCCK file goes through the region decoder"
    _no_ext(monkeypatch)
    want, _ = _outputs(chain(), blobs)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@needs_ext
def test_rows_below_the_crop_are_read_unless_verify_is_off():
    """By default a region decode entropy-decodes the file to its end, so a file
    cut below the crop fails as a full decode does; with verify=False reading
    stops after the crop's last row and the crop above the cut decodes."""
    data = jpeg(make_image(256, 64, seed=4), "4:2:0")
    cut = data[:int(len(data) * 0.7)]
    with pytest.raises(DecodeError):
        region(cut, 8, 8, 32, 40, 1, False)
    np.testing.assert_array_equal(region(cut, 8, 8, 32, 40, 1, False, verify=False),
                                  full_at_scale(data, 1)[8:40, 8:48])
    for verify in (True, False):
        with pytest.raises(DecodeError):
            region(cut, 200, 0, 56, 64, 1, False, verify=verify)


@needs_ext
@pytest.mark.parametrize("denom", [1, 8])
def test_damage_in_the_scan_fails_a_region_that_reaches_the_last_row(denom):
    """Bytes damaged mid-scan that the entropy decoder passes over are found at
    the end of the data ("extraneous bytes before marker"): every region reads
    on to the end, as a full decode does, instead of delivering damaged pixels;
    with verify=False only a region ending at the last row does."""
    data = jpeg(np.random.default_rng(0).integers(0, 255, (256, 256, 3), dtype=np.uint8))
    at = int(len(data) * 0.3)
    damaged = data[:at] + bytes(b ^ 0x5A for b in data[at:at + 64]) + data[at + 64:]
    with pytest.raises(ValueError, match="extraneous bytes"):
        simplejpeg.decode_jpeg(damaged)  # the full decode's verdict
    side = 256 // denom
    with pytest.raises(DecodeError, match="extraneous bytes"):
        region(damaged, 0, 0, side, side, denom, False)
    with pytest.raises(DecodeError, match="extraneous bytes"):
        region(damaged, side // 2, 8, side // 2, side // 4, denom, True)
    # A crop above the damaged bytes: an error by default (the file is read to its
    # end, as a full decode reads it), exact pixels with verify=False.
    with pytest.raises(DecodeError, match="extraneous bytes"):
        region(damaged, 0, 0, side // 8, side, denom, False)
    np.testing.assert_array_equal(region(damaged, 0, 0, side // 8, side, denom, False, verify=False),
                                  full_at_scale(data, denom)[:side // 8])


def _no_ext(monkeypatch):
    monkeypatch.setattr(_decode.extension, "jpeg", None)


def _outputs(chain: list, blobs: list[bytes], exif: bool = False) -> tuple[list[np.ndarray], list]:
    work = SampleWork(Chain(chain, None), exif_orientation=exif)
    h, w = work.image_size
    outs, ctxs = [], []
    for i, data in enumerate(blobs):
        out = np.empty((h, w, 3), np.uint8)
        img, ctx = work.decode(data, 1000 + i)
        if ctx.origin is None:  # the simplejpeg path: note its scale, as the region path does
            ctx.scale = _decode.decode_scale(ctx.source_size, img.shape[:2])[0]
        work.transform(img, 1000 + i, ctx, out)
        outs.append(out)
        ctxs.append(ctx)
    return outs, ctxs


def _denom(ctx) -> int:
    return round(1 / ctx.scale) if ctx.origin is not None else 0


BLOBS = [jpeg(make_image(*size, seed=i), kind) for i, (size, kind) in enumerate(
    [((300, 400), "4:2:0"), ((480, 360), "4:2:2"), ((333, 517), "4:4:4"), ((250, 250), "gray"),
     ((400, 600), "progressive"), ((360, 480), "restart"), ((700, 1000), "4:2:0"), ((1100, 1500), "4:2:0")])]


@needs_ext
@pytest.mark.parametrize("chain", [
    lambda: [ops.RandomResizedCrop(224), ops.RandomHorizontalFlip()],
    lambda: [ops.RandomResizedCrop(64, scale=(0.3, 1.0))],
    lambda: [ops.Resize(256), ops.CenterCrop(224)],
    lambda: [ops.Resize(100, interpolation="nearest"), ops.CenterCrop(90)],
    lambda: [ops.Resize(120, interpolation="area"), ops.CenterCrop(100)],
    lambda: [ops.Resize(100, interpolation="bicubic"), ops.CenterCrop(96)],
    lambda: [ops.CenterCrop(200)],
    lambda: [ops.Resize((150, 170))],
], ids=["rrc224", "rrc64", "eval", "eval-nearest", "eval-area", "eval-bicubic", "centercrop", "resize"])
def test_transforms_match_the_fallback_at_the_same_scale(chain, monkeypatch):
    got, ctxs = _outputs(chain(), BLOBS)
    assert all(c.origin is not None for c in ctxs), "every JPEG went through the region decoder"
    _no_ext(monkeypatch)
    want, fctxs = _outputs(chain(), BLOBS)
    same = 0
    for g, w, c, f, data in zip(got, want, ctxs, fctxs, BLOBS):
        assert c.source_size == f.source_size
        if c.scale == f.scale:
            np.testing.assert_array_equal(g, w)
            same += 1
    assert same >= len(BLOBS) // 2


@needs_ext
def test_reduced_scales_are_within_the_stated_tolerance_of_a_full_decode(monkeypatch):
    """At 1/2..1/8 the result differs from full decode + crop + resize by at most
    SCALED_TOLERANCE grey levels on average; at 1/1 it is identical."""
    class FullCrop(ops.RandomResizedCrop):  # same boxes, no hint and no box: a full decode
        decode_hint = ops.Transform.decode_hint
        decode_box = ops.Transform.decode_box

    seen = set()
    for size in (64, 224):
        got, ctxs = _outputs([ops.RandomResizedCrop(size, scale=(0.2, 1.0))], BLOBS)
        want, _ = _outputs([FullCrop(size, scale=(0.2, 1.0))], BLOBS)
        for g, w, c in zip(got, want, ctxs):
            d = _denom(c)
            seen.add(d)
            diff = np.abs(g.astype(np.int16) - w.astype(np.int16))
            if d == 1:
                np.testing.assert_array_equal(g, w)
            else:
                assert diff.mean() <= SCALED_TOLERANCE, (d, diff.mean())
    assert {1, 2, 4} <= seen, seen  # the set reaches full and reduced scales


def exif_jpeg(data: bytes, orientation: int) -> bytes:
    tiff = (b"II" + struct.pack("<HIH", 42, 8, 1) + struct.pack("<HHIHH", 0x0112, 3, 1, orientation, 0)
            + struct.pack("<I", 0))
    payload = b"Exif\x00\x00" + tiff
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + data[2:]


@needs_ext
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_draws_the_box_in_the_shown_frame(orientation, monkeypatch):
    blobs = [exif_jpeg(jpeg(make_image(150, 230, seed=s), "4:2:0"), orientation) for s in range(4)]
    chains = ([ops.RandomResizedCrop(48, scale=(0.3, 1.0))], [ops.Resize(64), ops.CenterCrop(56)],
              [ops.CenterCrop((100, 90))])
    got = [_outputs(c, blobs, exif=True) for c in chains]
    _no_ext(monkeypatch)
    for (g, ctxs), c in zip(got, chains):
        want, fctxs = _outputs(c, blobs, exif=True)
        same = 0
        for a, b, ctx, fctx in zip(g, want, ctxs, fctxs):
            assert ctx.source_size == fctx.source_size
            if ctx.scale == fctx.scale:
                np.testing.assert_array_equal(a, b)
                same += 1
        assert same >= 2, [(x.scale, y.scale) for x, y in zip(ctxs, fctxs)]


def _seg_source(n: int):
    from tests.support.fields import DictSource, coordinate_image
    rng = np.random.default_rng(0)

    def make(i):
        h, w = (180, 240) if i % 2 else (260, 200)
        img = coordinate_image(h, w)
        mask = ((np.arange(h)[:, None] // 16 + np.arange(w)[None, :] // 16) % 5).astype(np.uint8)
        boxes = np.array([[10, 20, 90, 120], [100, 5, 190, 60]], np.float32)
        return {"image": jpeg(img, "4:4:4", 95), "mask": mask, "boxes": boxes,
                "label": int(rng.integers(0, 5))}
    return DictSource(n, make)


@needs_ext
@pytest.mark.parametrize("chain", [
    # Sizes at which both paths decode at the same scale (1/1, and 1/2 for the
    # eval chain's 260x200 images), so that the same pixels are expected.
    lambda: [ops.RandomResizedCrop(120, scale=(0.3, 1.0)), ops.RandomHorizontalFlip()],
    lambda: [ops.Resize(100), ops.CenterCrop(90)],
    lambda: [ops.CenterCrop(120)],
], ids=["rrc", "eval", "centercrop"])
def test_masks_and_boxes_follow_as_with_the_fallback(chain, monkeypatch):
    def run():
        with Feeder(_seg_source(8), 4, chain(), seed=3, decode_threads=2, ordered=True) as f:
            batches, err = drain_dicts(f)
        assert err is None
        return batches

    got = run()
    _no_ext(monkeypatch)
    want = run()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a["mask"], b["mask"])
        assert len(a["boxes"]) == len(b["boxes"])
        for x, y in zip(a["boxes"], b["boxes"]):
            np.testing.assert_allclose(x, y, atol=1e-4)
        np.testing.assert_array_equal(a["image"], b["image"])


def _seg_sample(i: int) -> dict:
    from tests.support.fields import coordinate_image

    h, w = (180, 240) if i % 2 else (260, 200)
    mask = ((np.arange(h)[:, None] // 16 + np.arange(w)[None, :] // 16 + i) % 5).astype(np.uint8)
    boxes = np.array([[10, 20, 90, 120], [100, 5, 190, 60 + i]], np.float32)
    return {"image": jpeg(coordinate_image(h, w), "4:2:0", 95), "mask": mask, "boxes": boxes,
            "label": i % 5}


class SegSource:
    """JPEG images with masks and boxes, at module level: the worker process gets it pickled."""

    def __len__(self) -> int:
        return 8

    def read(self, index: int) -> dict:
        return _seg_sample(index)


@needs_ext
@pytest.mark.parametrize("chain", [
    lambda: [ops.RandomResizedCrop(120, scale=(0.1, 1.0)), ops.RandomHorizontalFlip()],
    lambda: [ops.Resize(100), ops.CenterCrop(90)],
], ids=["rrc", "eval"])
def test_masks_and_boxes_in_the_worker_process_as_in_threads(chain):
    """isolation="process" region-decodes in its worker and delivers the thread
    engine's batches: images, masks and boxes."""
    def run(**options):
        with Feeder(SegSource(), 4, chain(), seed=5, decode_threads=2, ordered=True, **options) as f:
            batches, err = drain_dicts(f)
        assert err is None
        return batches

    want, got = run(), run(isolation="process")
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        for name in ("image", "mask", "label"):
            np.testing.assert_array_equal(a[name], b[name])
        assert len(a["boxes"]) == len(b["boxes"])
        for x, y in zip(a["boxes"], b["boxes"]):
            np.testing.assert_array_equal(x, y)


def drain_dicts(feeder):
    import threading
    out, err = [], []

    def go():
        try:
            for b in feeder:
                out.append({k: (v.numpy().copy() if hasattr(v, "numpy") else
                                [t.numpy().copy() for t in v] if isinstance(v, list) else v)
                            for k, v in b.items()})
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            err.append(exc)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(JOIN_TIMEOUT_S)
    assert not t.is_alive(), "the pass did not finish (hang)"
    return out, (err[0] if err else None)


@needs_ext
@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_ordered_batches_identical_across_thread_counts_and_engines(isolation):
    blobs = BLOBS[:6] * 3
    chain = [ops.RandomResizedCrop(64), ops.RandomHorizontalFlip()]
    runs = []
    for threads in (1, 3):
        with Feeder(MemorySource(blobs), 4, chain, seed=7, decode_threads=threads, ordered=True,
                    isolation=isolation) as f:
            batches, err = drain(f)
        assert err is None
        runs.append(batches)
    with Feeder(MemorySource(blobs), 4, chain, seed=7, decode_threads=2, ordered=True) as f:
        reference, err = drain(f)
    assert err is None
    for run in runs:
        assert len(run) == len(reference)
        for (x, y), (rx, ry) in zip(run, reference):
            np.testing.assert_array_equal(x, rx)
            np.testing.assert_array_equal(y, ry)


def test_info_says_which_decoder_runs():
    jpeg_info = info()["jpeg"]
    assert jpeg_info["decoder"] == ("feeder.decode._jpeg" if ext is not None else "simplejpeg")
    assert jpeg_info["region_decode"] is (ext is not None)
    assert (jpeg_info["reason"] is None) is (ext is not None)
    if ext is None:
        assert jpeg_info["huffman"] is None
    else:  # the own Huffman decoder runs exactly where the library's layout is known
        assert jpeg_info["huffman"] == ("libjpeg-turbo" if ext.ENTROPY_LAYOUT is None else "feeder")


def _has_jpeg_headers() -> bool:
    cc = os.environ.get("CC", "cc")
    try:
        r = subprocess.run([cc, "-E", "-"], input=b"#include <stdio.h>\n#include <jpeglib.h>\n",
                           capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def test_extension_is_built_where_its_headers_are():
    """scripts/env.sh installs the headers where it can and pip builds the
    extension: CI must test the region decoder, not silently the fallback."""
    if os.environ.get(_decode.NO_EXTENSION_ENV, "") not in ("", "0"):
        pytest.skip("the fallback is forced for this run")
    if not _has_jpeg_headers():
        pytest.skip("no C compiler with libjpeg headers here")
    assert ext is not None, _decode._jpeg_missing


def test_the_variable_forces_the_fallback_in_a_fresh_interpreter():
    code = textwrap.dedent("""
        import logging, numpy as np, feeder
        from feeder import Feeder, ops
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        assert feeder.info()["jpeg"]["decoder"] == "simplejpeg", feeder.info()
        from feeder import decode as _decode
        assert _decode._jpeg is None
        import simplejpeg
        real, calls = simplejpeg.decode_jpeg, []
        def counted(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)
        simplejpeg.decode_jpeg = counted  # every JPEG must go through it
        import cv2
        ok, buf = cv2.imencode(".jpg", np.full((80, 90, 3), 120, np.uint8))

        class Src:
            def __len__(self): return 6
            def read(self, i): return buf.tobytes(), i
        with Feeder(Src(), 3, [ops.RandomResizedCrop(32)], seed=1) as f:
            n = sum(len(y) for _, y in f)
        print("samples", n, "simplejpeg decodes", len(calls))
    """)
    env = {**os.environ, "FEEDER_NO_JPEG_EXT": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(_decode.__file__))),
                                          os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "samples 6 simplejpeg decodes 6" in r.stdout
    assert "JPEG decoding: simplejpeg" in r.stderr and "FEEDER_NO_JPEG_EXT=1" in r.stderr


def test_the_missing_extension_says_how_to_get_it(monkeypatch, caplog):
    from feeder.decode import extension, status

    monkeypatch.setattr(extension, "jpeg", None)
    monkeypatch.setattr(extension, "missing", "the extension feeder.decode._jpeg is not built")
    monkeypatch.setattr(status, "_noted", False)
    with caplog.at_level("WARNING", logger="feeder.decode.status"):
        status.note_jpeg_decoder()
        status.note_jpeg_decoder()  # once per process
    lines = [r.getMessage() for r in caplog.records if r.name == "feeder.decode.status"]
    assert len(lines) == 1 and "libjpeg-dev" in lines[0] and "libjpeg-turbo-devel" in lines[0]


# -- fuzzing ------------------------------------------------------------------------

FUZZ_EXAMPLES = int(os.environ.get("FEEDER_FUZZ_EXAMPLES", "150"))
FUZZ_SEEDS = [jpeg(make_image(48, 72, seed=9), kind, 85) for kind in KINDS]
_position = st.one_of(st.integers(0, 700), st.integers(0, 1 << 14))
_mutation = st.one_of(
    st.tuples(st.just("flip"), _position, st.integers(0, 7)),
    st.tuples(st.just("truncate"), _position),
    st.tuples(st.just("insert"), _position, st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("overwrite"), _position, st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), _position, st.integers(1, 32)),
)


def mutate(data: bytes, edits: list) -> bytes:
    buf = bytearray(data)
    for op in edits:
        at = op[1] % (len(buf) + 1)
        if op[0] == "flip" and buf:
            buf[at % len(buf)] ^= 1 << op[2]
        elif op[0] == "truncate":
            del buf[at:]
        elif op[0] == "insert":
            buf[at:at] = op[2]
        elif op[0] == "overwrite":
            buf[at:at + len(op[2])] = op[2]
        elif op[0] == "delete":
            del buf[at:at + op[2]]
    return bytes(buf)


@needs_ext
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.sampled_from(range(len(FUZZ_SEEDS))), edits=st.lists(_mutation, min_size=1, max_size=5),
       box=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)),
       denom=st.sampled_from([1, 2, 4, 8]), key=st.integers(0, 1 << 20))
def test_mutated_jpegs_decode_or_raise_decode_error(seed, edits, box, denom, key):
    data = mutate(FUZZ_SEEDS[seed], edits)
    try:
        width, height, *_ = ext.header(data)
    except DecodeError:
        return
    if not 0 < width * height <= 1 << 20:
        with pytest.raises(DecodeError):
            ext.decode(data, 0, 0, 1, 1, denom, np.empty(64, np.uint8), 1 << 20)
        return
    H, W = -(-height // denom), -(-width // denom)
    t, l = int(box[0] * (H - 1)), int(box[1] * (W - 1))
    h, w = 1 + int(box[2] * (H - t - 1)), 1 + int(box[3] * (W - l - 1))
    try:
        img = region(data, t, l, h, w, denom, bool(key & 1))
        assert img.shape == (h, w, 3)
    except DecodeError:
        img = None
    # feeder's Huffman decoder (the default) against libjpeg-turbo's: never
    # laxer, the same pixels where both decode; and again from the index that
    # a read to the end records (every few rows, or every row and every 4 MCUs).
    out = np.zeros(h * w * 3, np.uint8)
    try:
        ext.decode(data, t, l, h, w, denom, out, 1 << 20, True, own=False)
        reference = out.reshape(h, w, 3).copy()
    except DecodeError:
        reference = None
    assert not (reference is None and img is not None), "libjpeg's decoder refused what feeder's passed"
    if img is not None and reference is not None:
        assert np.array_equal(img, reference)
        _, _, index, _ = ext.decode(data, t, l, h, w, denom, out, 1 << 20, True, record=True,
                                    max_points=4096 if key & 2 else 16)
        if index is not None:
            out[:] = 0
            ext.decode(data, t, l, h, w, denom, out, 1 << 20, True, False, index=index)
            assert np.array_equal(out.reshape(h, w, 3), reference)
    # And through the decode stage, with a random crop's plan.
    work = SampleWork(Chain([ops.RandomResizedCrop(16)], None), max_pixels=1 << 20)
    try:
        img, ctx = work.decode(data, key)
    except DecodeError:
        return
    out = np.empty((16, 16, 3), np.uint8)
    work.transform(img, key, ctx, out)


@needs_ext
def test_feeder_jpeg_verify_decides_what_a_crop_of_a_damaged_file_gets():
    """jpeg_verify=True (the default): a file damaged below the crop fails its
    sample, as without the extension; False: the crop above the damage is
    delivered, exact. A value that is not a bool is a configuration error."""
    from feeder import Feeder, ops

    good = jpeg(make_image(256, 64, seed=5), "4:2:0")
    bad = good[:int(len(good) * 0.7)]  # cut at about row 180 of 256: below the 16-pixel centre

    class Source:
        def __len__(self):
            return 2

        def read(self, i):
            return (good, bad)[i], i

    chain = [ops.RandomResizedCrop(16, scale=(0.01, 0.01))]
    with Feeder(Source(), 2, chain, on_error="skip", shuffle=False) as f:
        labels = [int(x) for _, batch in f for x in batch]
    with Feeder(Source(), 2, [ops.CenterCrop(16)], on_error="skip", shuffle=False) as f:
        labels_centre = [int(x) for _, batch in f for x in batch]
    with Feeder(Source(), 2, [ops.CenterCrop(16)], on_error="skip", shuffle=False,
                jpeg_verify=False) as f:
        labels_unverified = [int(x) for _, batch in f for x in batch]
    assert labels == [0] and labels_centre == [0]  # the damaged file is skipped, whatever the crop
    assert labels_unverified == [0, 1]  # its centre lies above the cut: delivered
    with pytest.raises(ValueError, match="jpeg_verify"):
        Feeder(Source(), 2, chain, jpeg_verify="no")


@needs_ext
@pytest.mark.parametrize("kind, mcu, widened", [("4:4:4", 8, False), ("gray", 8, False),
                                                ("4:2:0", 16, True), ("4:2:2", 16, True)])
def test_a_region_is_widened_only_where_chroma_is_upsampled(kind, mcu, widened):
    # The region is decoded from the iMCU column holding its first column. With
    # chroma upsampled, the upsampler reads past a crop's edge, so the decode
    # starts PAD pixels further left (bit-identical columns); with every
    # component at the same sampling nothing is read past it, and the column
    # left of the crop's would be decoded for nothing.
    data = jpeg(make_image(64, 96, seed=5), kind, 90)
    left = mcu + 1  # one pixel past an iMCU column's start
    out = np.zeros(64 * 96 * 3, np.uint8)
    stride, offset = ext.decode(data, 8, left, 40, 50, 1, out, 1 << 30, False, True)
    assert offset == (left if widened else 1)  # where the wanted columns start in the decoded row
    full = simplejpeg.decode_jpeg(data, colorspace="GRAY" if kind == "gray" else "RGB")
    got = out[:40 * stride * 3].reshape(40, stride, 3)[:, offset:offset + 50]
    want = full[8:48, left:left + 50]
    if kind == "gray":
        np.testing.assert_array_equal(got[..., 0], want[..., 0])
    else:
        np.testing.assert_array_equal(got, want)
