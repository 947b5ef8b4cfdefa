"""The fused crop: a chain that starts with a bilinear RandomResizedCrop (and a
flip) has the region decoder decode, crop, resize and flip each JPEG sample into
its batch slot in one call without the GIL (``SampleWork.decode_into``, with
``JpegDecoder.fused``, which also consults the verified-JPEG memory, in one
extension call).

* The extension's bilinear resize (``_jpeg.resize``) and its area shrink
  (``area=True``, RandomResizedCrop's antialiased shrink) are the documented
  formulas, bit for bit (numpy references here), within one level of
  cv2.resize, mirrored exactly by ``flip``, and refuse arrays they cannot take.
* The fused paths (the one extension call, and the region decode that resizes
  into the slot) write the bytes the chain writes, sample for sample, on files
  of every chroma sampling, gray and progressive files, small files and files
  the verified memory keeps, at every DCT scale, for several output sizes,
  scales, flip probabilities and antialias settings.
* Through a Feeder: the same batches with the augment step inline (fused) as
  with an augment stage of its own (never fused), and the same errors, naming
  the sample, for a corrupt file.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from tests.support import MemorySource, drain
from tests.support.jpeg import KINDS, jpeg
from feeder import Feeder, SampleError, ops
from feeder.decode import extension
from feeder.decode.verified import VerifiedJpegs
from feeder.engine.steps import SampleWork
from feeder.ops.chain import Chain
from feeder.sample.rng import epoch_key, index_key

ext = extension.jpeg
pytestmark = pytest.mark.skipif(ext is None, reason="the region decoder is not built")


def _reference(src: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """The resize's formula in numpy: half-pixel centres clamped to the edges,
    weights of 8 fractional bits, the vertical blend exact, one rounding."""
    def axis(n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
        f = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
        i = np.floor(f)
        frac = f - i
        i = i.astype(np.int64)
        low, high = i < 0, i >= n_in - 1
        i[low], frac[low] = 0, 0.0
        i[high], frac[high] = n_in - 1, 0.0
        return i, np.floor(frac * 256 + 0.5).astype(np.int64)

    yi, yw = axis(oh, src.shape[0])
    xi, xw = axis(ow, src.shape[1])
    s = src.astype(np.int64)
    below = np.minimum(yi + 1, src.shape[0] - 1)
    v = s[yi] * (256 - yw)[:, None, None] + s[below] * yw[:, None, None]
    right = np.minimum(xi + 1, src.shape[1] - 1)
    out = v[:, xi] * (256 - xw)[None, :, None] + v[:, right] * xw[None, :, None]
    return ((out + 32768) >> 16).astype(np.uint8)


def _smooth(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return cv2.GaussianBlur(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), (5, 5), 1.5)


@pytest.mark.parametrize("shape", [(50, 45, 64, 64), (80, 70, 64, 48), (300, 280, 224, 224),
                                   (1, 1, 5, 3), (3, 7, 2, 2), (7, 1, 3, 9), (64, 64, 64, 64),
                                   (9, 200, 31, 17), (301, 333, 223, 225), (40, 3, 7, 1),
                                   (33, 517, 20, 256)])
def test_resize_is_the_formula_and_near_cv2(shape):
    sh, sw, oh, ow = shape
    src = _smooth(sh, sw, sh * 1000 + sw)
    out = np.empty((oh, ow, 3), np.uint8)
    ext.resize(src, out)
    np.testing.assert_array_equal(out, _reference(src, oh, ow))
    near = cv2.resize(src, (ow, oh), interpolation=cv2.INTER_LINEAR)
    assert np.abs(near.astype(int) - out).max() <= 1
    flipped = np.empty_like(out)
    ext.resize(src, flipped, flip=True)
    np.testing.assert_array_equal(flipped, out[:, ::-1])


@pytest.mark.parametrize("kind", ["zeros", "full", "checker", "noise"])
def test_resize_of_extreme_values_is_the_formula(kind):
    # The vector blend makes the values signed around 32768 and adds that back:
    # exact at both ends of the range, and for neighbours that differ most.
    sh, sw, oh, ow = 97, 131, 61, 83
    rng = np.random.default_rng(7)
    src = {"zeros": np.zeros((sh, sw, 3), np.uint8),
           "full": np.full((sh, sw, 3), 255, np.uint8),
           "checker": ((np.indices((sh, sw)).sum(0) % 2) * 255).astype(np.uint8)[..., None].repeat(3, 2),
           "noise": rng.integers(0, 256, (sh, sw, 3), dtype=np.uint8)}[kind]
    for flip in (False, True):
        out = np.empty((oh, ow, 3), np.uint8)
        ext.resize(np.ascontiguousarray(src), out, flip=flip)
        want = _reference(src, oh, ow)
        np.testing.assert_array_equal(out, want[:, ::-1] if flip else want)


def _area_axis(n_out: int, n_in: int) -> np.ndarray:
    """The area shrink's weights along one axis, [n_out, n_in]: output pixel j
    covers [j * s, (j + 1) * s) (s = n_in / n_out, the last ending at n_in);
    input pixel i weighs the span covered up to its end, as a fraction of the
    span in 12 fractional bits, rounded, less the same for the pixel before (the
    last one's: all of the span), so that each row sums to 4096."""
    s = n_in / n_out
    weights = np.zeros((n_out, n_in), np.int64)
    for j in range(n_out):
        lo, hi = j * s, min((j + 1) * s, float(n_in))
        first = int(np.floor(lo))
        last = max(min(int(np.ceil(hi)), n_in), first + 1)
        before = 0
        for i in range(first, last):
            upto = 4096
            if i + 1 < last:
                upto = int(np.floor((min(i + 1.0, hi) - lo) / (hi - lo) * 4096 + 0.5))
                upto = min(max(upto, before), 4096)
            weights[j, i] = upto - before
            before = upto
    return weights


def _area_reference(src: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """The area shrink's formula in numpy: the rows' weighted sums exact, then
    the columns', one rounding (24 fractional bits in all)."""
    v = np.einsum("ys,sxc->yxc", _area_axis(oh, src.shape[0]), src.astype(np.int64))
    out = np.einsum("xs,ysc->yxc", _area_axis(ow, src.shape[1]), v)
    return ((out + (1 << 23)) >> 24).astype(np.uint8)


@pytest.mark.parametrize("shape", [(500, 460, 224, 224), (460, 350, 224, 224), (9, 9, 4, 4),
                                   (7, 1, 3, 1), (1, 40, 1, 13), (64, 64, 64, 64), (97, 333, 31, 100),
                                   (672, 672, 224, 224), (45, 1000, 44, 7)])
def test_area_shrink_is_the_formula_and_near_cv2(shape):
    sh, sw, oh, ow = shape
    for src in (_smooth(sh, sw, sh + sw),
                np.random.default_rng(sh).integers(0, 256, (sh, sw, 3), dtype=np.uint8)):
        out = np.empty((oh, ow, 3), np.uint8)
        ext.resize(src, out, area=True)
        np.testing.assert_array_equal(out, _area_reference(src, oh, ow))
        if sh <= 6 * oh and sw <= 6 * ow:  # the shrinks feeder gives it (MAX_AREA_SHRINK)
            near = cv2.resize(src, (ow, oh), interpolation=cv2.INTER_AREA)
            assert np.abs(near.astype(int) - out).max() <= 1
        flipped = np.empty_like(out)
        ext.resize(src, flipped, flip=True, area=True)
        np.testing.assert_array_equal(flipped, out[:, ::-1])
    flat = np.full((sh, sw, 3), 201, np.uint8)  # an average of equal values is that value
    ext.resize(flat, out, area=True)
    assert (out == 201).all()


@pytest.mark.parametrize("shape", [(4, 1600, 4, 267), (1600, 4, 267, 4), (1200, 1200, 201, 201)])
def test_area_shrink_is_near_cv2_on_stripes_up_to_6x(shape):
    """Stripes one pixel wide, the pattern that adds up its weights' rounding
    errors most, at the largest shrink feeder gives it (about 6x a side)."""
    sh, sw, oh, ow = shape
    stripes = ((np.arange(sh)[:, None] + np.arange(sw)[None, :]) % 2 * 255).astype(np.uint8)
    src = np.repeat(stripes[:, :, None], 3, axis=2)
    out = np.empty((oh, ow, 3), np.uint8)
    ext.resize(src, out, area=True)
    near = cv2.resize(src, (ow, oh), interpolation=cv2.INTER_AREA)
    assert np.abs(near.astype(int) - out).max() <= 1


def test_random_resized_crop_takes_the_extension_shrink_only_where_it_is_near_cv2():
    """The antialiased shrink of a bilinear RandomResizedCrop up to 6x a side is
    the extension's; past it, and for interpolation="area" at any ratio, cv2's
    INTER_AREA, exactly."""
    from feeder.sample import SampleRNG

    img = np.random.default_rng(5).integers(0, 256, (900, 900, 3), dtype=np.uint8)
    for transform, ours in [(ops.RandomResizedCrop(120, scale=(0.3, 0.4)), True),   # 3.5-5.5x a side
                            (ops.RandomResizedCrop(40, scale=(0.9, 1.0)), False),   # over 20x
                            (ops.RandomResizedCrop(100, scale=(0.5, 0.6), interpolation="area"), False)]:
        oh, ow = transform.output_size
        for key in range(5):
            top, left, h, w = transform._box(900, 900, SampleRNG(key, 0), None)
            got = transform.apply(img, SampleRNG(key, 0))
            crop = img[top:top + h, left:left + w]
            if ours:
                assert h <= 6 * oh and w <= 6 * ow
                want = np.empty((oh, ow, 3), np.uint8)
                ext.resize(crop, want, area=True)
            else:
                want = cv2.resize(crop, (ow, oh), interpolation=cv2.INTER_AREA)
            np.testing.assert_array_equal(got, want, err_msg=repr(transform))


def test_area_shrink_reads_rows_at_any_stride_and_refuses_to_grow():
    big = _smooth(200, 240, 4)
    view = big[10:160, 20:190]
    a, b = np.empty((40, 30, 3), np.uint8), np.empty((40, 30, 3), np.uint8)
    ext.resize(view, a, area=True)
    ext.resize(np.ascontiguousarray(view), b, area=True)
    np.testing.assert_array_equal(a, b)
    before = a.copy()
    for dst in (np.empty((151, 30, 3), np.uint8), np.empty((40, 171, 3), np.uint8)):
        with pytest.raises(ValueError, match="no larger than src"):
            ext.resize(view, dst, area=True)
    np.testing.assert_array_equal(a, before)


def test_resize_reads_rows_at_any_stride_and_refuses_what_it_cannot_take():
    big = _smooth(100, 120, 3)
    view = big[10:60, 20:90]  # rows 360 bytes apart, 210 used
    a, b = np.empty((40, 30, 3), np.uint8), np.empty((40, 30, 3), np.uint8)
    ext.resize(view, a)
    ext.resize(np.ascontiguousarray(view), b)
    np.testing.assert_array_equal(a, b)
    for src, dst in [(big[:, :, :2], a), (big.astype(np.uint16), a), (big[:, ::2], a),
                     (big, np.empty((40, 30, 4), np.uint8)), (big, np.empty((40, 60, 3), np.uint8)[:, ::2]),
                     (big[:0], a)]:
        with pytest.raises((ValueError, BufferError)):
            ext.resize(src, dst)
    read_only = np.empty((40, 30, 3), np.uint8)
    read_only.flags.writeable = False
    with pytest.raises((ValueError, BufferError), match="read-only|not writable"):
        ext.resize(big, read_only)


def _files() -> list[bytes]:
    """JPEGs of every kind: small ones (under ``JpegDecoder.SMALL_BYTES``), larger
    ones (kept in the verified memory), sizes that decode at every DCT scale."""
    out = []
    for n, kind in enumerate(KINDS):
        for h, w, q in [(37, 53, 90), (90, 70, 60), (230, 190, 20), (400, 333, 85)]:
            out.append(jpeg(_smooth(h, w, n * 10 + h), kind, quality=q))
    return out


CHAINS = {
    "crop+flip": lambda s: [ops.RandomResizedCrop(s), ops.RandomHorizontalFlip()],
    "crop": lambda s: [ops.RandomResizedCrop(s, scale=(0.01, 1.0))],
    "wide ratio, flip 0.3": lambda s: [ops.RandomResizedCrop((s, s // 2 + 1), ratio=(0.2, 5.0)),
                                       ops.RandomHorizontalFlip(0.3)],
    "no antialias, always flip": lambda s: [ops.RandomResizedCrop(s, antialias=False),
                                            ops.RandomHorizontalFlip(1.0)],
    "two flips": lambda s: [ops.RandomResizedCrop(s), ops.RandomHorizontalFlip(),
                            ops.RandomHorizontalFlip(0.7)],
}


class _InPython(VerifiedJpegs):
    """A memory the extension's fused call does not read: files at or above
    ``small_bytes`` then take the region decode's fused path, in Python."""

    native = None


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("size", [16, 48, 96])
@pytest.mark.parametrize("native", [True, False], ids=["memory in C", "memory in Python"])
def test_fused_paths_write_the_bytes_the_chain_writes(chain, size, native):
    files = _files()
    verified = None if native else _InPython(files=len(files))
    fused = SampleWork(Chain(CHAINS[chain](size), None), verified=verified)
    plain = SampleWork(Chain(CHAINS[chain](size), None))
    assert fused.fused is not None
    shape = (*fused.chain.image_size, 3)
    taken = {"one call": 0, "large in one call": 0, "region": 0, "chain": 0}
    for epoch in range(3):
        pass_key = epoch_key(11, epoch)
        for i, data in enumerate(files):
            key = index_key(pass_key, i)
            got, want = np.full(shape, 7, np.uint8), np.full(shape, 9, np.uint8)
            small = fused.jpeg.fused(data, key, fused.fused, got)
            if small:
                taken["one call"] += 1
                taken["large in one call"] += len(data) >= fused.jpeg.small_bytes
            else:
                img, ctx = fused.decode_into(data, key, got)
                if img is None:
                    taken["region"] += 1
                else:
                    taken["chain"] += 1
                    fused.transform(img, key, ctx, got)
            if small or img is None:
                fused.finish_into(key, got)
            img, ctx = plain.decode(data, key)
            plain.transform(img, key, ctx, want)
            np.testing.assert_array_equal(got, want, err_msg=f"file {i}, epoch {epoch}")
    # The one call took large files too where the extension reads the memory;
    # otherwise the region decode's fused path took them (and the chain, in
    # both, the crops the fused paths leave to it).
    if chain != "wide ratio, flip 0.3":
        # With a square output and the default ratios, no crop shrinks one side
        # and grows the other: the fused paths take every crop, the antialiased
        # shrinks (of more than 2x) included.
        assert taken["chain"] == 0, taken
    if native and ext.CRC32C_HARDWARE:
        assert taken["large in one call"] > 0, taken
    else:
        assert taken["one call"] > 0 and taken["large in one call"] == 0 and taken["region"] > 0, taken


def test_no_fusion_for_chains_it_does_not_cover():
    for transforms in ([ops.RandomResizedCrop(32, interpolation="bicubic")],
                       [ops.Resize(32), ops.CenterCrop(32)],
                       [ops.RandomHorizontalFlip(), ops.RandomResizedCrop(32)],
                       [ops.RandomResizedCrop(32), ops.ColorJitter(0.4)]):
        assert Chain(transforms, None).fused is None, transforms
    # A variable-size output is never fused (each image's size is recorded).
    work = SampleWork(Chain([ops.RandomResizedCrop(32)], None, max_image_size=(32, 32)))
    assert work.variable and work.fused is None


def _batches(blobs: list[bytes], **kwargs) -> tuple[list, BaseException | None]:
    f = Feeder(MemorySource(blobs), batch_size=4, transforms=[ops.RandomResizedCrop(24),
                                                             ops.RandomHorizontalFlip()],
               shuffle=True, seed=5, decode_threads=2, **kwargs)
    return drain(f)


def test_a_feeder_gives_the_same_batches_fused_or_not():
    blobs = _files() * 2
    fused, error = _batches(blobs, augment_threads=0)
    assert error is None
    plain, error = _batches(blobs, augment_threads=1)
    assert error is None
    assert len(fused) == len(plain) == -(-len(blobs) // 4)
    for (x, y), (x2, y2) in zip(fused, plain):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)


def test_a_corrupt_file_fails_fused_as_it_does_unfused():
    good = _files()[:6]
    bad = bytearray(good[1])
    bad[len(bad) // 2:len(bad) // 2 + 40] = b"\x00" * 40  # entropy data wiped
    blobs = [good[0], bytes(bad), *good[2:]]
    errors = []
    for augment in (0, 1):
        _, error = _batches(blobs, augment_threads=augment)
        assert isinstance(error, SampleError) and "DecodeError: corrupt JPEG" in str(error), error
        errors.append(str(error))
    assert errors[0] == errors[1]
    assert "sample 1" in errors[0]
    for augment in (0, 1):
        f = Feeder(MemorySource(blobs), batch_size=2, on_error="skip",
                   transforms=[ops.RandomResizedCrop(24), ops.RandomHorizontalFlip()],
                   augment_threads=augment)
        batches, error = drain(f)
        assert error is None
        assert sum(len(y) for _, y in batches) == len(blobs) - 1
        assert f.stats().skipped == 1


def test_decode_into_refuses_a_crop_outside_the_region_whatever_its_numbers():
    data = jpeg(_smooth(64, 64, 1), "4:2:0")
    buf = np.empty(64 * (64 + 2 * ext.PAD + 32) * 3, np.uint8)
    into = np.empty((8, 8, 3), np.uint8)
    huge = 2**63 - 1
    for crop in [(0, huge, 1, 1), (huge, 0, 1, 1), (1, 0, huge, 1), (0, 1, 1, huge),
                 (60, 0, 5, 1), (0, 0, 0, 4), (-1, 0, 4, 4), (0, 0, 65, 64)]:
        into[:] = 7
        with pytest.raises(ValueError, match="crop a box inside the region"):
            ext.decode(data, 0, 0, 64, 64, 1, buf, 10**9, into=into, crop=crop)
        assert (into == 7).all(), crop  # nothing written
    for crop in [None, [0, 0, 4, 4], "0044"]:
        with pytest.raises(TypeError, match="crop must be a tuple"):
            ext.decode(data, 0, 0, 64, 64, 1, buf, 10**9, into=into, crop=crop)
    ext.decode(data, 0, 0, 64, 64, 1, buf, 10**9, into=into, crop=(0, 0, 64, 64))
    want = np.empty_like(into)
    img = np.empty((64, 64, 3), np.uint8)
    stride, offset = ext.decode(data, 0, 0, 64, 64, 1, buf, 10**9)
    img[:] = buf[:64 * stride * 3].reshape(64, stride, 3)[:, offset:offset + 64]
    ext.resize(img, want)
    np.testing.assert_array_equal(into, want)
