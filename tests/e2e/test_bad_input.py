"""Bad input: every kind of broken, unusual or missing file, under
``on_error="raise"`` and ``on_error="skip"``.

Each dataset is 14 distinct good 32x32 JPEGs with one special file at index
6. The feeders run ``CenterCrop(32)`` (the identity on these images), so every
delivered sample is identified by a hash of its pixels against a reference
decoded without the engine.

* raise: ``next()`` raises :class:`feeder.SampleError` naming the stage, the
  sample index and the path, with the original error chained; the batch before
  the bad one is delivered intact first.
* skip: the file is skipped and counted (``stats().skipped``, ``skipped_paths``),
  batches keep their size, every other sample is delivered exactly once.
"""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest
import simplejpeg

import feeder.decode as decode_mod
from tests.support import collect, collected, drain, encode_png
from tests.support.faults import (SIDE, assert_exactly_once, batch_sizes, delivered_hashes, distinct_jpegs,
                            expected_sizes, feeder_factory, gray_jpeg, jpeg_with_size, pil_jpeg, cmyk_jpeg, cmyk_to_rgb_reference,
                            progressive_jpeg, raw_png,
                            png16, png_with_size, ppm_header, random_bytes, reference_hash,
                            smooth_rgb, tiff_header)
from feeder import DecodeError, Feeder, FeederError, FileList, ImageFolder, SampleError, SourceError, ops
from feeder.decode import DEFAULT_MAX_PIXELS, decode_image

N_GOOD = 14
BAD_AT = 6
B = 4
CROP = [ops.CenterCrop(SIDE)]


@pytest.fixture(scope="module")
def good_blobs() -> list[bytes]:
    return distinct_jpegs(N_GOOD, seed=500)


@pytest.fixture(scope="module")
def good_hashes(good_blobs) -> list[str]:
    return [reference_hash(b) for b in good_blobs]


def write_dataset(root, good_blobs, special_name: str, write_special):
    """root/NN.jpg for the good files and the special file at index BAD_AT.

    ``write_special(path)`` creates (or deliberately does not create) the special file.
    Returns (FileList, special_path); labels are the sample indices."""
    os.makedirs(root, exist_ok=True)
    paths = []
    good = iter(good_blobs)
    for i in range(N_GOOD + 1):
        if i == BAD_AT:
            path = os.path.join(root, special_name)
            write_special(path)
        else:
            path = os.path.join(root, f"{i:02d}.jpg")
            with open(path, "wb") as f:
                f.write(next(good))
        paths.append(path)
    return FileList(paths, list(range(N_GOOD + 1))), paths[BAD_AT]


def writer(data: bytes):
    def write(path):
        with open(path, "wb") as f:
            f.write(data)
    return write


make = feeder_factory(batch_size=B, transforms=CROP, shuffle=False, seed=3)


# -- files that must fail -------------------------------------------------------------------

def _jpeg():
    return distinct_jpegs(1, seed=900)[0]


def _png_for_bomb():
    return encode_png(smooth_rgb(1))


def _failing_rows():
    j = _jpeg()
    n = len(j)
    sos = next(i for i in range(2, n) if j[i:i + 2] == b"\xff\xda")
    return {
        # name: (bytes or None, failing stage, cause type, text in the message)
        "truncated-after-soi": (j[:2], "decode", DecodeError, "decodable"),
        "truncated-in-headers": (j[:40], "decode", DecodeError, "JPEG"),
        "truncated-at-scan-start": (j[:sos + 4], "decode", DecodeError, "JPEG"),
        "truncated-mid-scan": (j[:n // 2], "decode", DecodeError, "JPEG"),
        "truncated-before-eoi": (j[:n - 2], "decode", DecodeError, "JPEG"),
        "random-bytes": (random_bytes(3000, seed=1), "decode", DecodeError, "decod"),
        "random-bytes-jpeg-magic": (random_bytes(3000, seed=2, prefix=b"\xff\xd8\xff"), "decode",
                                    DecodeError, "JPEG"),
        "zero-bytes": (b"", "decode", DecodeError, "empty"),
        "text-file": (b"This is not an image.\nIt is a text file saved as .jpg\n" * 20, "decode",
                      DecodeError, "decod"),
        "jpeg-bomb-60000x60000": (jpeg_with_size(j, 60000, 60000), "decode", DecodeError, "max_pixels"),
        "png-bomb-100000x100000": (png_with_size(_png_for_bomb(), 100000, 100000), "decode",
                                   DecodeError, "max_pixels"),
    }


FAILING = _failing_rows()


def _expect_raise(err, path, stage, cause, text):
    assert isinstance(err, SampleError), f"expected SampleError, got {type(err).__name__}: {err}"
    assert isinstance(err, FeederError)
    msg = str(err)
    assert err.stage == stage and repr(stage) in msg
    assert err.index == BAD_AT and f"sample {BAD_AT}" in msg
    assert err.path == path and path in msg
    assert isinstance(err.__cause__, cause), f"cause is {type(err.__cause__).__name__}"
    assert text in msg


def _expect_skip(f, batches, err, path, good_hashes, *, passes=1):
    assert err is None, f"skip mode raised: {err!r}"
    s = f.stats()
    assert s.skipped == passes and set(s.skipped_paths) == {path}
    assert batch_sizes(batches) == expected_sizes(N_GOOD, B, False)
    assert_exactly_once(delivered_hashes(batches), good_hashes)


def _run_and_expect(src, on_error, path, good_hashes, stage, cause, text=None, before=None):
    """One epoch over ``src`` with its bad file in place: the raise or skip outcome of its row.

    ``text`` must appear in the error message (default: the cause's type name);
    ``before`` runs once the feeder is built, before iterating."""
    with make(src, on_error=on_error) as f:
        if before is not None:
            before()
        batches, err = drain(f, timeout=20)
        if on_error == "raise":
            _expect_raise(err, path, stage, cause, text or type(getattr(err, "__cause__", None)).__name__)
        else:
            _expect_skip(f, batches, err, path, good_hashes)


@pytest.mark.parametrize("row", sorted(FAILING))
def test_bad_file_raises_naming_stage_index_path(tmp_path, good_blobs, good_hashes, row):
    data, stage, cause, text = FAILING[row]
    src, path = write_dataset(tmp_path, good_blobs, f"{BAD_AT:02d}_{row}.jpg", writer(data))
    with make(src) as f:
        batches, err = drain(f, timeout=20)
    _expect_raise(err, path, stage, cause, text)
    # Ordered, unshuffled: the batch before the bad sample arrives intact, nothing after it.
    assert delivered_hashes(batches) == good_hashes[:B]


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("row", sorted(FAILING))
def test_bad_file_skipped_rest_exactly_once(tmp_path, good_blobs, good_hashes, row, ordered):
    data, *_ = FAILING[row]
    src, path = write_dataset(tmp_path, good_blobs, f"{BAD_AT:02d}_{row}.jpg", writer(data))
    with make(src, on_error="skip", ordered=ordered, shuffle=True, decode_threads=3,
              augment_threads=2) as f:
        batches, err = drain(f, timeout=20)
        _expect_skip(f, batches, err, path, good_hashes)
        batches, err = drain(f, timeout=20)  # a second epoch: same accounting
        _expect_skip(f, batches, err, path, good_hashes, passes=2)


# -- files that are missing or unreadable ------------------------------------------------------

def _missing(path):
    pass  # never created


def _dangling_symlink(path):
    os.symlink(path + ".target-that-does-not-exist", path)


def _directory(path):
    os.mkdir(path)


FILE_ROWS = {
    "missing": (_missing, FileNotFoundError),
    "dangling-symlink": (_dangling_symlink, FileNotFoundError),
    "directory-named-jpg": (_directory, IsADirectoryError),
}


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("row", sorted(FILE_ROWS))
def test_unopenable_file(tmp_path, good_blobs, good_hashes, row, on_error):
    make_file, cause = FILE_ROWS[row]
    src, path = write_dataset(tmp_path, good_blobs, f"{BAD_AT:02d}_{row}.jpg", make_file)
    _run_and_expect(src, on_error, path, good_hashes, "read", cause)


def _unreadable(path):
    with open(path, "wb") as f:
        f.write(distinct_jpegs(1, seed=901)[0])
    os.chmod(path, 0)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_unreadable_file_permission_denied(tmp_path, good_blobs, good_hashes, on_error):
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        pytest.skip("running as root: chmod 000 does not block reads")
    src, path = write_dataset(tmp_path, good_blobs, f"{BAD_AT:02d}_unreadable.jpg", _unreadable)
    try:
        try:
            with open(path, "rb"):
                pytest.skip("chmod 000 does not block reads on this file system")
        except PermissionError:
            pass
        _run_and_expect(src, on_error, path, good_hashes, "read", PermissionError)
    finally:
        os.chmod(path, 0o644)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_permission_error_from_read_simulated(tmp_path, good_blobs, good_hashes, on_error, monkeypatch):
    """The same row where chmod cannot deny reads (root): the open() of one path fails with
    the PermissionError the OS would raise."""
    import feeder.sources as sources_mod
    src, path = write_dataset(tmp_path, good_blobs, f"{BAD_AT:02d}_denied.jpg", writer(good_blobs[0]))
    real = sources_mod._read_file

    def read_file(p):
        if p == path:
            raise PermissionError(13, "Permission denied", p)
        return real(p)

    monkeypatch.setattr(sources_mod, "_read_file", read_file)
    _run_and_expect(src, on_error, path, good_hashes, "read", PermissionError, "Permission denied")


@pytest.mark.parametrize("kind", ["ImageFolder", "FileList"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_file_deleted_after_feeder_built(tmp_path, good_blobs, good_hashes, kind, on_error):
    root = tmp_path / "data"
    (root / "cls").mkdir(parents=True)
    src, path = write_dataset(str(root / "cls"), good_blobs, f"{BAD_AT:02d}_deleted.jpg",
                              writer(good_blobs[0]))
    if kind == "ImageFolder":
        src = ImageFolder(str(root))
        assert src.paths[BAD_AT] == path and len(src) == N_GOOD + 1
    _run_and_expect(src, on_error, path, good_hashes, "read", FileNotFoundError,
                    before=lambda: os.remove(path))


# -- files that must decode, and decode correctly ------------------------------------------------

def _decodes_fine_rows():
    rgb = smooth_rgb(7)
    gray = rgb[..., 1].copy()
    gray3 = np.repeat(gray[..., None], 3, axis=2)
    rng = np.random.default_rng(0)
    v16 = rgb.astype(np.uint16) * 257 + rng.integers(0, 120, rgb.shape).astype(np.uint16)
    g16 = gray.astype(np.uint16) * 257 + 100
    alpha = rng.integers(0, 256, rgb.shape[:2], dtype=np.uint8)
    alpha[:4] = 0  # fully transparent rows: their colour must still come through (alpha dropped)
    rgba = np.concatenate([rgb, alpha[..., None]], axis=2)
    # CMYK with real black ink: K varies across the image, so R = C*K/255 is exercised.
    k = np.linspace(120, 255, SIDE, dtype=np.float64)[None, :, None].repeat(SIDE, 0).astype(np.uint8)
    cmyk = cmyk_jpeg(np.concatenate([rgb, k], axis=2))
    cmyk_from_rgb = np.clip(np.rint(rgb * (k / 255.0)), 0, 255).astype(np.uint8)
    # Hand-written PNG colour types cv2 cannot write.
    gray_alpha = raw_png(np.stack([gray, alpha], axis=2).reshape(SIDE, -1), color_type=4)
    palette = rng.integers(0, 256, (16, 3), dtype=np.uint8)
    idx = (np.arange(SIDE)[:, None] + np.arange(SIDE)[None, :]) % 16
    pal_png = raw_png(idx.astype(np.uint8), color_type=3, palette=palette.tobytes())
    bits = (gray > 128)
    one_bit = raw_png(np.packbits(bits, axis=1), color_type=0, bit_depth=1)
    rows = {
        # name: (bytes, expected RGB, max abs error, mean abs error)
        "png-named-jpg": (encode_png(rgb), rgb, 0, 0.0),
        "cmyk-jpeg-vs-raw-cmyk": (cmyk, cmyk_to_rgb_reference(cmyk), 3, 1.5),
        "cmyk-jpeg-vs-original": (cmyk, cmyk_from_rgb, 40, 4.0),
        "grayscale-jpeg": (gray_jpeg(gray), gray3, 25, 3.0),
        "progressive-jpeg": (progressive_jpeg(rgb), rgb, 40, 3.0),
        "png-16bit-rgb": (png16(v16), rgb, 0, 0.0),
        "png-16bit-gray": (png16(g16), gray3, 0, 0.0),
        "png-rgba": (encode_png(rgba), rgb, 0, 0.0),
        "png-gray": (encode_png(gray), gray3, 0, 0.0),
        "png-gray-alpha": (gray_alpha, gray3, 0, 0.0),
        "png-palette": (pal_png, palette[idx], 0, 0.0),
        "png-1bit": (one_bit, np.repeat((bits * 255).astype(np.uint8)[..., None], 3, 2), 0, 0.0),
    }
    try:  # Pillow (optional) writes the plain, non-YCCK Adobe CMYK that Photoshop does
        adobe = pil_jpeg(rgb, "CMYK")
        rows["cmyk-jpeg-pillow"] = (adobe, cmyk_to_rgb_reference(adobe), 3, 1.5)
        rows["cmyk-jpeg-pillow-vs-original"] = (adobe, rgb, 40, 4.0)
    except ImportError:
        pass
    return rows


FINE = _decodes_fine_rows()


def _close_to(img, expected, max_abs, mean_abs, what):
    assert img.shape == (SIDE, SIDE, 3) and img.dtype == np.uint8, (what, img.shape, img.dtype)
    diff = np.abs(img.astype(np.int32) - expected.astype(np.int32))
    assert diff.max() <= max_abs and diff.mean() <= mean_abs, (
        f"{what}: max |diff| {diff.max()} (allowed {max_abs}), mean {diff.mean():.2f} "
        f"(allowed {mean_abs})")


def test_expected_images_are_not_channel_symmetric():
    """Guard of the rows below: a swapped channel order must not pass their tolerances."""
    rgb = smooth_rgb(7).astype(np.int32)
    assert np.abs(rgb - rgb[..., ::-1]).mean() > 10


@pytest.mark.parametrize("row", sorted(FINE))
def test_unusual_image_decodes_correctly(row):
    data, expected, max_abs, mean_abs = FINE[row]
    img, size = decode_image(data)
    assert size == (SIDE, SIDE)
    assert img.flags.c_contiguous
    _close_to(img, expected, max_abs, mean_abs, row)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("row", sorted(FINE))
def test_unusual_image_through_feeder(tmp_path, good_blobs, good_hashes, row, on_error):
    data, expected, max_abs, mean_abs = FINE[row]
    src, path = write_dataset(tmp_path, good_blobs, f"{BAD_AT:02d}_{row}.jpg", writer(data))
    with make(src, on_error=on_error, shuffle=True, decode_threads=2) as f:
        batches, err = drain(f, timeout=20)
        assert err is None, f"{row} failed to decode: {err!r}"
        assert f.stats().skipped == 0
    assert batch_sizes(batches) == expected_sizes(N_GOOD + 1, B, False)
    special = [x[i].transpose(1, 2, 0) for x, y in batches for i in range(len(y)) if y[i] == BAD_AT]
    assert len(special) == 1
    _close_to(special[0], expected, max_abs, mean_abs, row)
    others = [h for h, l in zip(delivered_hashes(batches), (int(v) for _, y in batches for v in y))
              if l != BAD_AT]
    assert_exactly_once(others, good_hashes)


# -- decompression bombs ---------------------------------------------------------------------

def _bombs():
    j = _jpeg()
    p = _png_for_bomb()
    return {
        "jpeg-60000x60000": jpeg_with_size(j, 60000, 60000),
        "jpeg-20000x20000": jpeg_with_size(j, 20000, 20000),  # over max_pixels, under OpenCV's own cap
        "png-100000x100000": png_with_size(p, 100000, 100000),
        "png-17000x17000": png_with_size(p, 17000, 17000),
    }


BOMBS = _bombs()


@pytest.fixture
def forbid_pixel_decode(monkeypatch):
    """Make any pixel decode of a registered blob fail the test: proves rejection happened
    from the header, before the decoder allocated the image."""
    forbidden: set[bytes] = set()
    calls: list[int] = []
    real_jpeg, real_cv = simplejpeg.decode_jpeg, cv2.imdecode

    def jpeg(data, *a, **kw):
        if bytes(data) in forbidden:
            calls.append(len(data))
            raise AssertionError("pixel decode attempted on a decompression bomb")
        return real_jpeg(data, *a, **kw)

    def imdecode(buf, flags):
        if bytes(buf) in forbidden:
            calls.append(len(buf))
            raise AssertionError("pixel decode attempted on a decompression bomb")
        return real_cv(buf, flags)

    monkeypatch.setattr(decode_mod.simplejpeg, "decode_jpeg", jpeg)
    monkeypatch.setattr(decode_mod.cv2, "imdecode", imdecode)
    return forbidden, calls


@pytest.mark.parametrize("row", sorted(BOMBS))
def test_bomb_rejected_from_header_before_decoding(row, forbid_pixel_decode):
    forbidden, calls = forbid_pixel_decode
    data = BOMBS[row]
    forbidden.add(data)
    h, w = (int(v) for v in row.split("-")[1].split("x"))
    assert h * w > DEFAULT_MAX_PIXELS
    with pytest.raises(DecodeError, match="max_pixels") as info:
        decode_image(data)
    assert f"({h}, {w}) (height, width)" in str(info.value)
    assert calls == []


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("row", sorted(BOMBS))
def test_bomb_in_dataset(tmp_path, good_blobs, good_hashes, row, on_error, forbid_pixel_decode):
    forbidden, calls = forbid_pixel_decode
    forbidden.add(BOMBS[row])
    src, path = write_dataset(tmp_path, good_blobs, f"{BAD_AT:02d}_{row}.jpg", writer(BOMBS[row]))
    _run_and_expect(src, on_error, path, good_hashes, "decode", DecodeError, "max_pixels")
    assert calls == []


def test_max_pixels_is_configurable(good_blobs, good_hashes):
    from tests.support import MemorySource
    src = MemorySource(good_blobs, names=[f"img{i}.jpg" for i in range(N_GOOD)])
    # One pixel below a normal 32x32 image: it is rejected like a bomb.
    with pytest.raises(DecodeError, match=f"max_pixels={SIDE * SIDE - 1}"):
        decode_image(good_blobs[0], max_pixels=SIDE * SIDE - 1)
    assert decode_image(good_blobs[0], max_pixels=SIDE * SIDE)[0].shape == (SIDE, SIDE, 3)
    # A smaller output: an output above max_pixels is itself refused at construction.
    small = [ops.CenterCrop(SIDE // 2)]
    with Feeder(src, B, small, shuffle=False, seed=3, max_pixels=SIDE * SIDE - 1) as f:
        batches, err = drain(f, timeout=20)
    assert isinstance(err, SampleError) and err.stage == "decode" and err.index == 0
    assert "img0.jpg" in str(err) and f"max_pixels={SIDE * SIDE - 1}" in str(err)
    assert isinstance(err.__cause__, DecodeError) and batches == []
    with Feeder(src, B, small, shuffle=False, seed=3, max_pixels=SIDE * SIDE - 1, on_error="skip") as f:
        batches, err = drain(f, timeout=20)
        assert err is None and batches == [] and f.stats().skipped == N_GOOD
    with make(src, max_pixels=SIDE * SIDE) as f:
        batches, err = drain(f, timeout=20)
    assert err is None
    assert_exactly_once(delivered_hashes(batches), good_hashes)


@pytest.mark.parametrize("data", [ppm_header(60000, 60000), tiff_header(60000, 60000)],
                         ids=["ppm-60000x60000", "tiff-60000x60000"])
def test_decode_image_only_raises_decode_error_for_oversized_other_formats(data):
    with pytest.raises(DecodeError):
        decode_image(data)


@pytest.mark.parametrize("data", [ppm_header(20000, 20000), ppm_header(60000, 60000),
                                  tiff_header(60000, 60000)],
                         ids=["ppm-20000x20000", "ppm-60000x60000", "tiff-60000x60000"])
def test_pnm_and_tiff_bombs_rejected_from_header(data, forbid_pixel_decode):
    forbidden, calls = forbid_pixel_decode
    forbidden.add(data)
    with pytest.raises(DecodeError, match="max_pixels"):
        decode_image(data)
    assert calls == []


def _png_chunk_claiming(length: int) -> bytes:
    """A valid PNG cut inside its first IDAT, whose length field now claims ``length`` bytes."""
    p = encode_png(np.zeros((SIDE, SIDE, 3), np.uint8))
    i = p.index(b"IDAT") - 4
    return p[:i] + length.to_bytes(4, "big") + p[i + 4:i + 40]


@pytest.mark.parametrize("length", [0xE71D0E42, 1 << 20, 40], ids=["3.9GB", "1MB", "just-past-the-end"])
def test_png_chunk_longer_than_the_file_rejected_before_decoding(length, forbid_pixel_decode):
    """OpenCV would allocate what the length field claims before finding the data missing."""
    forbidden, calls = forbid_pixel_decode
    data = _png_chunk_claiming(length)
    forbidden.add(data)
    with pytest.raises(DecodeError, match=f"chunk 'IDAT' at byte 33 claims {length} bytes"):
        decode_image(data)
    assert calls == []


# -- empty datasets and odd batch sizes ------------------------------------------------------------

def test_image_folder_without_class_folders(tmp_path):
    (tmp_path / "stray.jpg").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="no class folders") as info:
        ImageFolder(str(tmp_path))
    assert str(tmp_path) in str(info.value)
    with pytest.raises(FileNotFoundError):
        ImageFolder(str(tmp_path / "does-not-exist"))


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("drop_last", [True, False])
def test_empty_file_list_is_refused_at_construction(on_error, drop_last):
    src = FileList([])  # an empty list is a valid source; a feeder over it is not
    assert len(src) == 0
    with pytest.raises(ValueError, match=r"source is empty \(len\(source\) == 0\).*0 batches"):
        make(src, on_error=on_error, drop_last=drop_last)


@pytest.mark.parametrize("ordered", [True, False])
def test_every_sample_bad(tmp_path, ordered):
    paths = []
    for i in range(9):
        p = tmp_path / f"{i}.jpg"
        p.write_bytes(b"junk %d" % i)
        paths.append(str(p))
    with make(FileList(paths), on_error="skip", ordered=ordered, decode_threads=3) as f:
        batches, err = drain(f, timeout=20)
        assert err is None and batches == []
        assert f.stats().skipped == 9 and set(f.stats().skipped_paths) == set(paths)
    with make(FileList(paths), ordered=ordered) as f:
        batches, err = drain(f, timeout=20)
    assert isinstance(err, SampleError) and err.path in paths and batches == []
    if ordered:
        assert err.index == 0  # ordered: the first failure in epoch order, for any timing


def _class_tree(root, good_blobs, empty_classes=("empty",)):
    for cls in ("alpha", "beta"):
        (root / cls / "nested").mkdir(parents=True)
    for i, blob in enumerate(good_blobs[:6]):
        cls = "alpha" if i < 3 else "beta"
        sub = "nested" if i % 3 == 2 else ""
        (root / cls / sub / f"{i}.jpg").write_bytes(blob)
    for cls in empty_classes:
        (root / cls / "deeper").mkdir(parents=True)
        (root / cls / "README.txt").write_text("no images here")


def test_class_folder_without_images_is_named(tmp_path, good_blobs):
    _class_tree(tmp_path, good_blobs, empty_classes=("empty", "zeta"))
    with pytest.raises(FileNotFoundError) as info:
        ImageFolder(str(tmp_path))
    msg = str(info.value)
    assert "empty" in msg and "zeta" in msg and "allow_empty" in msg
    assert "alpha" not in msg.split("under")[0]


def test_class_folder_without_images_allowed(tmp_path, good_blobs):
    _class_tree(tmp_path, good_blobs)
    src = ImageFolder(str(tmp_path), allow_empty=True)
    assert src.classes == ["alpha", "beta", "empty"] and len(src) == 6
    assert sorted(set(src.labels)) == [0, 1]
    with Feeder(src, 4, CROP, seed=0) as f:
        batches, err = drain(f, timeout=20)
    assert err is None
    assert_exactly_once(delivered_hashes(batches), [reference_hash(b) for b in good_blobs[:6]])


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [N_GOOD, N_GOOD + 1, 40])
@pytest.mark.parametrize("with_bad", [False, True])
def test_batch_larger_than_dataset(tmp_path, good_blobs, good_hashes, batch_size, drop_last,
                                   ordered, with_bad):
    if with_bad:
        src, path = write_dataset(tmp_path, good_blobs, "bad.jpg", writer(b"broken"))
        n, on_error = N_GOOD + 1, "skip"
    else:
        from tests.support import MemorySource
        src, n, on_error = MemorySource(good_blobs), N_GOOD, "raise"
    if drop_last and batch_size > n:
        # Every epoch would be empty: a configuration mistake, refused with the numbers.
        with pytest.raises(ValueError, match=rf"len\(source\)={n}.*batch_size={batch_size}.*"
                                             rf"drop_last=True.*batch_size <= {n}"):
            make(src, batch_size=batch_size, drop_last=drop_last, ordered=ordered, on_error=on_error)
        return
    with make(src, batch_size=batch_size, drop_last=drop_last, ordered=ordered, shuffle=True,
              on_error=on_error) as f:
        # len() counts the source's samples (a skip is only known while iterating).
        assert len(f) == (n // batch_size if drop_last else -(-n // batch_size))
        batches, err = drain(f, timeout=20)
        assert err is None
        assert f.stats().skipped == int(with_bad)
    good = N_GOOD  # samples that survive
    assert batch_sizes(batches) == expected_sizes(good, batch_size, drop_last)
    if batches:
        assert_exactly_once(delivered_hashes(batches), good_hashes)


class _ExtraField:
    """Dict samples with a float field 'extra', but for sample ``odd``."""

    def __init__(self, odd: int, n: int = 12) -> None:
        self.odd, self.n = odd, n

    def __len__(self) -> int:
        return self.n

    def read(self, i: int) -> dict:
        sample = {"image": np.full((4, 4, 3), i, np.uint8), "label": i}
        if i != self.odd:
            sample["extra"] = np.float32(i)
        return sample


def _labels(batch: dict) -> list[int]:
    return batch["label"].tolist()


def _first_read(n: int = 12) -> list[int]:
    with Feeder(_ExtraField(-1, n), 4, image_size=(4, 4), shuffle=True, seed=0, decode_threads=1) as f:
        return [label for labels in collected(f, timeout=60, keep=_labels) for label in labels]


def test_skip_does_not_drop_every_good_sample_when_the_first_read_is_the_odd_one():
    """Under skip, an odd sample read first would fix the fields, and every good
    sample after it would be skipped: an error naming it comes instead."""
    order = _first_read()
    with Feeder(_ExtraField(order[0]), 4, image_size=(4, 4), shuffle=True, seed=0, decode_threads=1,
                on_error="skip") as f:
        got, err = collect(f, timeout=60, keep=_labels)
    assert isinstance(err, SampleError) and isinstance(err.__cause__, SourceError), err
    assert f"sample {order[0]} is probably malformed" in str(err)


def test_skip_skips_an_odd_sample_read_after_the_first():
    order = _first_read()
    odd = order[1]
    with Feeder(_ExtraField(odd), 4, image_size=(4, 4), shuffle=True, seed=0, decode_threads=1,
                on_error="skip") as f:
        got = [label for labels in collected(f, timeout=60, keep=_labels) for label in labels]
        assert f.stats().skipped == 1
    assert sorted(got) == sorted(set(range(12)) - {odd})


class _PairsWithOddLabels:
    """(bytes, int) pairs, but for a few samples whose label is a float."""

    def __init__(self, odd: set[int], n: int = 24) -> None:
        rng = np.random.default_rng(0)
        self.blobs = [simplejpeg.encode_jpeg(rng.integers(0, 256, (8, 8, 3), np.uint8), colorspace="RGB")
                      for _ in range(n)]
        self.odd = odd

    def __len__(self) -> int:
        return len(self.blobs)

    def read(self, i: int):
        return self.blobs[i], (0.5 if i in self.odd else i)


def test_skip_skips_many_odd_labels_among_classic_pairs():
    """Pairs with an int label skip the schema's check once it has seen one: they
    agree with the first sample all the same, and odd samples among them, however
    many, are only skipped."""
    odd = {3, 5, 7, 9, 11, 13, 15, 17, 19, 21}
    with Feeder(_PairsWithOddLabels(odd), 2, [ops.CenterCrop(8)], shuffle=False, decode_threads=1,
                on_error="skip") as f:
        got = [label for labels in collected(f, timeout=60, keep=lambda b: b[1].tolist()) for label in labels]
        assert f.stats().skipped == len(odd)
    assert sorted(got) == sorted(set(range(24)) - odd)
