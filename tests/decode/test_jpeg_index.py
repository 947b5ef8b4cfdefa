"""feeder's own Huffman decoder (feeder/decode/_huffman.c) and the row index it
records (feeder/decode/verified.py).

What is promised, checked against libjpeg-turbo's own Huffman decoder
(``own=False``) as the reference:

* Every valid sequential file decodes to the same pixels as with libjpeg's
  decoder, at every layout, restart interval and scale, with or without an
  index; an index makes the decode start below the first row (it is used).
* An index is used only for the bytes it was recorded from: feeder finds it by
  the file's length and CRC-32C and checks its own CRC; the decoder itself
  refuses one of another length or layout, and stops using one at the first
  checkpoint whose bytes (16 bits of them) are not these. Given directly, a
  garbled one, or one of other bytes that passes those checks, gives a decode
  error or wrong pixels, never a crash.
* On damaged data the own decoder is never laxer than libjpeg's: where libjpeg
  reports damage it does too, and where both decode, the pixels are the same.
* The memory of indexes is bounded, survives no overwrite, and never hands out
  another file's index, under threads.
"""

from __future__ import annotations

import pickle
import random
import threading

import cv2
import numpy as np
import pytest

from tests.support import JOIN_TIMEOUT_S, MemorySource, drain
from tests.support.jpeg import SUBSAMPLING, jpeg, run_on_other_libjpeg
from feeder import ConfigError, DecodeError, Feeder, ops
from feeder.synthetic import make_image
from feeder import decode as D
from feeder.decode.jpeg import JpegDecoder
from feeder.decode.verified import VerifiedJpegs
from feeder.testing import work_of

ext = D._jpeg
needs_ext = pytest.mark.skipif(ext is None, reason=f"region decoder not in use: {D._jpeg_missing}")


@pytest.fixture(autouse=True)
def _every_file_through_the_memory(monkeypatch):
    """The files here are small: below JpegDecoder.SMALL_BYTES they would skip the
    memory these tests are about (tests/decode/test_jpeg_small.py tests that threshold)."""
    monkeypatch.setattr(JpegDecoder, "SMALL_BYTES", 0)


def _noisy(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth image plus noise: many coefficients, many 0xFF bytes at quality 100."""
    rng = np.random.default_rng(seed)
    base = make_image(h, w, seed=seed).astype(np.int16)
    return np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)


def _decode(data: bytes, box: tuple[int, int, int, int], denom: int, **kw) -> tuple[np.ndarray, tuple]:
    t, l, h, w = box
    out = np.zeros(h * w * 3, np.uint8)
    got = ext.decode(data, t, l, h, w, denom, out, 1 << 30, True, kw.pop("verify", True), **kw)
    return out.reshape(h, w, 3), got


def _scaled(data: bytes, denom: int) -> tuple[int, int]:
    w, h = ext.header(data)[:2]
    return -(-h // denom), -(-w // denom)


def _boxes(H: int, W: int, rng: random.Random, n: int) -> list[tuple[int, int, int, int]]:
    boxes = [(0, 0, H, W), (H - 1, W - 1, 1, 1), (H // 2, 0, H - H // 2, W)]
    for _ in range(n):
        t, l = rng.randrange(H), rng.randrange(W)
        boxes.append((t, l, rng.randrange(1, H - t + 1), rng.randrange(1, W - l + 1)))
    return boxes


FILES = [(kind, rst) for kind in [*SUBSAMPLING, "gray"] for rst in (0,)] + \
        [("restart", rst) for rst in (1, 2, 7, 1000)]


@needs_ext
@pytest.mark.parametrize("points", [16, 4096])  # rows only; every row, columns too
@pytest.mark.parametrize("kind,rst", FILES)
def test_own_decoder_and_its_index_give_libjpegs_pixels(kind, rst, points):
    rng = random.Random(hash((kind, rst, points)) & 0xFFFF)
    for seed, (h, w), quality in [(1, (203, 157), 100), (2, (64, 300), 75), (3, (9, 17), 90)]:
        data = jpeg(_noisy(h, w, seed), kind, quality, rst=max(rst, 1))
        for denom in (1, 2, 4, 8):
            H, W = _scaled(data, denom)
            _, (_, _, index, _) = _decode(data, (0, 0, H, W), denom, record=True, max_points=points)
            mcu_h = 16 if kind in ("4:2:0", "4:4:0", "restart") else 8
            assert (index is not None) == (h > mcu_h), (kind, rst, h)  # one MCU row: nothing to skip
            for box in _boxes(H, W, rng, 6):
                ref, _ = _decode(data, box, denom, own=False)
                own, _ = _decode(data, box, denom)
                fast, _ = _decode(data, box, denom, verify=False, index=index)
                assert np.array_equal(own, ref), (kind, rst, seed, denom, box)
                assert np.array_equal(fast, ref), (kind, rst, seed, denom, box)


@needs_ext
def test_an_index_makes_a_crop_low_in_the_image_skip_the_rows_above():
    data = jpeg(_noisy(480, 320, 7), "4:2:0", 90)
    _, (_, _, index, jumped) = _decode(data, (0, 0, 480, 320), 1, record=True)
    assert index is not None and jumped == 0
    assert len(index) < 320  # at most 16 checkpoints of 13 bytes, and a header
    ref, _ = _decode(data, (400, 16, 64, 100), 1, own=False)
    fast, (_, _, made, jumped) = _decode(data, (400, 16, 64, 100), 1, verify=False, index=index)
    assert np.array_equal(fast, ref) and made is None
    # 480 / 16 = 30 MCU rows of 20 MCUs, at most 16 points: every other row;
    # the crop starts in row 25 (MCUs 500 on), and the rows with a point are
    # entered at it, passing over the MCUs right of the crop (8 on) above them
    assert 20 * 20 + 2 * 12 <= jumped <= 25 * 20 + 2 * 12
    # A decode that must read every byte (verify) does not jump.
    _, (_, _, _, jumped) = _decode(data, (400, 16, 64, 100), 1, index=index)
    assert jumped == 0
    # Neither does libjpeg's decoder, nor a crop starting in the first row.
    _, (_, _, _, jumped) = _decode(data, (400, 16, 64, 100), 1, verify=False, index=index, own=False)
    assert jumped == 0
    # A crop starting in the first row has no rows to jump over: only the MCUs
    # right of it (8 on) in the rows above the two with a point (2 and 4).
    _, (_, _, _, jumped) = _decode(data, (3, 16, 64, 100), 1, verify=False, index=index)
    assert jumped == 2 * 12


@needs_ext
@pytest.mark.parametrize("kind", ["4:2:0", "4:4:4", "gray", "restart"])
def test_a_grid_index_jumps_over_the_columns_beside_the_crop(kind):
    """With checkpoints along the rows, a crop's rows start at the point before
    its first column and end after its last one: the MCUs to either side are
    jumped over, not decoded, and the pixels stay libjpeg's."""
    data = jpeg(_noisy(256, 512, 11), kind, 90, rst=3)
    _, (_, _, rows, _) = _decode(data, (0, 0, 256, 512), 1, record=True, max_points=4)
    _, (_, _, grid, _) = _decode(data, (0, 0, 256, 512), 1, record=True, max_points=4096)
    assert len(grid) > len(rows)
    rng = random.Random(5)
    for box in [(100, 200, 60, 100), (0, 300, 256, 200), (200, 0, 56, 40), (255, 511, 1, 1),
                *_boxes(256, 512, rng, 20)]:
        ref, _ = _decode(data, box, 1, own=False)
        by_rows, (_, _, _, rows_jumped) = _decode(data, box, 1, verify=False, index=rows)
        by_grid, (_, _, _, grid_jumped) = _decode(data, box, 1, verify=False, index=grid)
        assert np.array_equal(by_rows, ref) and np.array_equal(by_grid, ref), (kind, box)
        t, l, h, w = box
        if l >= 80 or l + w <= 400:  # several MCUs beside the crop on a side
            assert grid_jumped > rows_jumped, (kind, box, grid_jumped, rows_jumped)
        else:
            assert grid_jumped >= rows_jumped, (kind, box)
    # The same grid index recorded by crops that stopped early, then extended.
    _, (_, _, upper, _) = _decode(data, (0, 0, 100, 512), 1, record=True, verify=False, max_points=4096)
    ref, _ = _decode(data, (150, 100, 100, 300), 1, own=False)
    got, (_, _, longer, _) = _decode(data, (150, 100, 100, 300), 1, verify=False, index=upper,
                                     record=True)
    assert np.array_equal(got, ref) and len(longer) > len(upper)
    got, (_, _, _, jumped) = _decode(data, (150, 100, 100, 300), 1, verify=False, index=longer)
    assert np.array_equal(got, ref) and jumped > 0


@needs_ext
def test_a_row_s_points_are_closer_together_on_the_left_where_crops_start():
    """A grid row's points lie at j + (columns - points) * j^2 / points^2: with 4
    points on a row of 31 MCUs, at columns 0, 2, 8 and 18 (a crop's first column
    is small far more often than large). A crop's rows are entered at the last
    point at or before its first column, so of crops with the same rows and
    last column, one starting in column 2-7 is entered 2 MCUs on in each row,
    one starting in column 8 8 MCUs on, and the MCUs before are jumped over."""
    data = jpeg(_noisy(480, 496, 13), "4:2:0", 90)  # 30 MCU rows of 31 MCUs (16x16 px)
    # 4 points a row: 30 * 4 - 1 = 119 fit in 150, 30 * 8 - 1 = 239 do not.
    _, (_, _, index, _) = _decode(data, (0, 0, 480, 496), 1, record=True, max_points=150)
    assert index is not None

    def jumped(left: int) -> int:
        # The region is widened by 4 px a side for the chroma upsampling, then
        # to whole MCUs: first column (left - 4) // 16, last (166 + 4) / 16 -> 10.
        box = (200, left, 100, 166 - left)
        ref, _ = _decode(data, box, 1, own=False)
        got, (_, _, _, n) = _decode(data, box, 1, verify=False, index=index)
        assert np.array_equal(got, ref), left
        return n

    at0, at2, at5, at8, at9 = (jumped(left) for left in (10, 40, 90, 140, 150))
    rows = (at2 - at0) // 2
    assert rows >= 100 // 16 and at2 - at0 == 2 * rows  # every row of the crop entered at column 2
    assert at5 == at2  # column 5: still entered at 2
    assert at8 == at9 == at0 + 8 * rows  # columns 8 and 9: entered at 8


_ACROSS_RELEASES = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from tests.support.jpeg import jpeg
from feeder.synthetic import make_image
from feeder.decode import _jpeg as ext
loaded = [l.split()[-1] for l in open("/proc/self/maps") if "libjpeg" in l]
assert any(sys.argv[2] in l for l in loaded), loaded
bad = 0
for kind in ("4:2:0", "4:4:4", "gray", "restart"):
    data = jpeg(make_image(256, 512, seed=3), kind, 90, rst=3)
    out = np.empty(1 << 22, np.uint8)
    index = ext.decode(data, 0, 0, 256, 512, 1, out, 1 << 24, True, True, record=True, max_points=4096)[2]
    for box in ((100, 300, 50, 100), (0, 200, 256, 40), (10, 0, 90, 64), (200, 37, 56, 300)):
        t, l, h, w = box
        ref = np.zeros(h * w * 3, np.uint8)
        ext.decode(data, t, l, h, w, 1, ref, 1 << 24, True, own=False)
        got = np.zeros(h * w * 3, np.uint8)
        jumped = ext.decode(data, t, l, h, w, 1, got, 1 << 24, True, False, index=index)[3]
        bad += not np.array_equal(got, ref) or jumped == 0
# Fill bytes before a stuffed zero: refused on this release too; before a
# marker: libjpeg's pixels.
data = jpeg(make_image(128, 96, seed=4), "restart", 95, rst=2)
sos = data.index(b"\xff\xda")
p = data.index(b"\xff\x00", sos + 20)
out = np.empty(1 << 22, np.uint8)
try:
    ext.decode(data[:p] + b"\xff" + data[p:], 0, 0, 128, 96, 1, out, 1 << 24, True)
    bad += 1
except Exception as exc:
    bad += "fill bytes before a stuffed zero" not in str(exc)
p = data.index(b"\xff\xd1")
padded = data[:p] + b"\xff\xff" + data[p:]
ref = np.zeros(128 * 96 * 3, np.uint8)
ext.decode(padded, 0, 0, 128, 96, 1, ref, 1 << 24, True, own=False)
got = np.zeros(128 * 96 * 3, np.uint8)
ext.decode(padded, 0, 0, 128, 96, 1, got, 1 << 24, True)
bad += not np.array_equal(got, ref)
print("layout", ext.ENTROPY_LAYOUT)
print("mismatches", bad)
"""


@needs_ext
def test_column_skipping_does_not_depend_on_libjpegs_private_layout():
    """The crop's MCU columns are computed from jpeg_crop_scanline's public
    outputs: read from libjpeg-turbo's private struct, whose layout changed
    between 2.x and 3.x under the same soname, an extension built against one
    release and run on the other gave grey blocks with no error. The entropy
    decoder's struct changed too: the own decoder names only its two methods,
    the same in both, and tells which layout runs. Here the extension runs on
    Pillow's bundled libjpeg-turbo (3.x), preloaded."""
    out = run_on_other_libjpeg(_ACROSS_RELEASES)
    assert out.strip().endswith("mismatches 0"), out
    # libjpeg-turbo 3.x put two lossless-mode methods before insufficient_data
    # in the entropy decoder struct: the extension, built against the
    # system's release, tells the running library's layout.
    assert "layout 3.x" in out, out
    assert ext.ENTROPY_LAYOUT == ("3.x" if ext.LIBJPEG_TURBO_VERSION.startswith("3.") else "6b-2.x")


@needs_ext
def test_max_points_bounds_the_index():
    data = jpeg(_noisy(640, 64, 8), "4:4:4", 90)  # 80 MCU rows
    sizes = {}
    for points in (1, 4, 16, 79, 200, 1000):
        _, (_, _, index, _) = _decode(data, (0, 0, 640, 64), 1, record=True, max_points=points)
        sizes[points] = len(index)
        ref, _ = _decode(data, (600, 0, 40, 64), 1, own=False)
        fast, _ = _decode(data, (600, 0, 40, 64), 1, verify=False, index=index)
        assert np.array_equal(fast, ref), points
    # Up to 79 points: every few rows (the last, every row); then points along
    # the rows too, every 4 MCUs at the finest: 80 rows x 2 - 1 = 159 points.
    assert sizes[1] < sizes[4] < sizes[16] < sizes[79] < sizes[200] == sizes[1000]
    assert sizes[200] == 26 + 159 * 13
    _, (_, _, index, _) = _decode(data, (0, 0, 640, 64), 1, record=True, max_points=0)
    assert index is None


@needs_ext
def test_a_crop_that_stops_early_records_the_rows_it_passed_and_a_later_one_goes_on():
    data = jpeg(_noisy(320, 64, 9), "4:2:0", 90)  # 20 MCU rows
    _, (_, _, first, _) = _decode(data, (0, 0, 16, 64), 1, record=True, verify=False)
    assert first is None  # one MCU row read: nothing to keep
    _, (_, _, upper, _) = _decode(data, (40, 0, 100, 64), 1, record=True, verify=False)
    assert upper is not None  # rows down to 140 (MCU row 8)
    ref, _ = _decode(data, (250, 0, 60, 64), 1, own=False)
    got, (_, _, longer, jumped) = _decode(data, (250, 0, 60, 64), 1, verify=False, index=upper,
                                          record=True)
    assert np.array_equal(got, ref) and jumped > 0 and len(longer) > len(upper)
    # With the longer index a crop near the bottom starts lower still.
    got, (_, _, none_new, jumped_more) = _decode(data, (250, 0, 60, 64), 1, verify=False, index=longer,
                                                 record=True)
    assert np.array_equal(got, ref) and jumped_more > jumped and none_new is None
    # A read to the end records every row, whatever it was given.
    _, (_, _, whole, _) = _decode(data, (250, 0, 60, 64), 1, index=upper, record=True)
    assert len(whole) >= len(longer)


@needs_ext
@pytest.mark.parametrize("points", [16, 4096])
@pytest.mark.parametrize("kind", ["4:2:0", "4:4:4", "gray", "restart"])
def test_a_read_to_the_end_records_the_same_index_whatever_its_crop(kind, points):
    """A file's first read (verify) records its index as it decodes every MCU,
    those beside and below its crop included: the same index as a decode of
    the whole image, whichever crop it drew, and the same pixels as libjpeg."""
    data = jpeg(_noisy(200, 264, 13), kind, 90, rst=3)
    _, (_, _, whole, _) = _decode(data, (0, 0, 200, 264), 1, record=True, max_points=points)
    assert whole is not None
    for box in [(50, 100, 60, 40), (0, 0, 20, 8), (190, 250, 10, 14), (0, 130, 200, 4),
                *_boxes(200, 264, random.Random(points), 10)]:
        ref, _ = _decode(data, box, 1, own=False)
        got, (_, _, index, jumped) = _decode(data, box, 1, record=True, max_points=points)
        assert np.array_equal(got, ref), (kind, box)
        assert index == whole and jumped == 0, (kind, box)


@needs_ext
@pytest.mark.parametrize("quality", [100, 60, 15])
@pytest.mark.parametrize("optimize", [False, True])
def test_blocks_read_only_to_pass_them_take_libjpegs_bits(quality, optimize):
    """The MCUs a read to the end passes without keeping them (above, below
    and beside its crop) are read several codes at a time: each crop then
    starts at the bits libjpeg's decoder reaches (its pixels and index are
    those of a decode of every block), with the standard Huffman tables and
    the ones an encoder optimized for the image, on busy and smooth images."""
    rng = random.Random(quality)
    for img in (_noisy(136, 200, 17), make_image(136, 200, seed=18)):
        params = [cv2.IMWRITE_JPEG_QUALITY, quality, cv2.IMWRITE_JPEG_OPTIMIZE, int(optimize),
                  cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444]
        ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(img[..., ::-1]), params)
        assert ok
        data = buf.tobytes()
        _, (_, _, whole, _) = _decode(data, (0, 0, 136, 200), 1, record=True, max_points=4096)
        for box in [(135, 199, 1, 1), (120, 0, 16, 200), (60, 90, 8, 8), *_boxes(136, 200, rng, 6)]:
            ref, _ = _decode(data, box, 1, own=False)
            got, (_, _, index, _) = _decode(data, box, 1, record=True, max_points=4096)
            assert np.array_equal(got, ref), (quality, optimize, box)
            assert index == whole, (quality, optimize, box)


@needs_ext
def test_progressive_files_have_no_index():
    data = jpeg(_noisy(64, 64, 10), "progressive", 90)
    _, (_, _, index, _) = _decode(data, (0, 0, 64, 64), 1, record=True)
    assert index is None


@needs_ext
def test_an_index_of_other_bytes_or_garbled_is_never_a_crash():
    a = jpeg(_noisy(160, 96, 11), "4:2:0", 90)
    b = jpeg(_noisy(160, 96, 12), "4:2:0", 90)  # same geometry, other bytes
    c = jpeg(_noisy(96, 160, 13), "4:4:4", 90)
    index = {k: _decode(d, (0, 0, *_scaled(d, 1)), 1, record=True)[1][2] for k, d in
             {"a": a, "b": b, "c": c}.items()}
    ref, _ = _decode(a, (100, 10, 50, 50), 1, own=False)
    # Another layout's index does not fit: not used, the pixels are right.
    got, (_, _, _, jumped) = _decode(a, (100, 10, 50, 50), 1, verify=False, index=index["c"])
    assert jumped == 0 and np.array_equal(got, ref)
    rng = random.Random(14)
    blobs = [b"", b"FH", index["a"][:-1], index["a"] + b"\0", bytes(len(index["a"])),
             bytes(rng.randrange(256) for _ in range(len(index["a"])))]
    for k in range(200):  # every byte of a good index garbled in turn
        bad = bytearray(index["a"])
        bad[k % len(bad)] ^= 1 << rng.randrange(8)
        blobs.append(bytes(bad))
    blobs.append(index["b"])  # fits the layout, describes other bytes
    for blob in blobs:
        try:
            _decode(a, (100, 10, 50, 50), 1, verify=False, index=blob)
        except DecodeError:
            pass  # a garbled checkpoint can mislead the decoder: feeder keeps an
            # index with its file's fingerprints and its own CRC; here only "no
            # crash" is promised
    # An index of other bytes of the same layout: the file's length and the
    # bytes at each checkpoint (16 bits of them) do not match: not used.
    got, (_, _, _, jumped) = _decode(a, (100, 10, 50, 50), 1, verify=False, index=index["b"])
    assert jumped == 0 and np.array_equal(got, ref)
    got, (_, _, _, jumped) = _decode(a, (100, 10, 50, 50), 1, verify=False, index=index["a"])
    assert jumped > 0 and np.array_equal(got, ref)


def _mutations(data: bytes, rng: random.Random, n: int) -> list[bytes]:
    sos = data.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")
    out = []
    for _ in range(n):
        d = bytearray(data)
        kind = rng.randrange(5)
        p = rng.randrange(start, len(d) - 2)
        if kind == 0:
            d[p] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del d[p:p + rng.randrange(1, 6)]
        elif kind == 2:
            d[p:p] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 6)))
        elif kind == 3:
            d = d[:p]
        else:
            d[p] = 0xFF
        out.append(bytes(d))
    return out


@needs_ext
@pytest.mark.parametrize("kind", ["4:2:0", "4:4:4", "gray", "restart"])
def test_on_damaged_data_the_own_decoder_is_never_laxer_than_libjpegs(kind):
    rng = random.Random(kind)
    data = jpeg(_noisy(48, 40, 15), kind, 90, rst=2)
    counts = {"both refuse": 0, "both decode": 0, "only own refuses": 0}
    for bad in _mutations(data, rng, 150):
        H, W = _scaled(bad, 1) if bad[:2] == b"\xff\xd8" else (0, 0)
        # The whole image, a crop of most columns, and a narrow one (the MCUs
        # either side of it, in its rows, decoded without their coefficients)
        for box in [(0, 0, H, W), (H // 3, 5, H // 3, W - 10), (H // 3, W // 3, H // 3, 4)]:
            verdicts = []
            for own in (False, True):
                try:
                    verdicts.append(_decode(bad, box, 1, own=own)[0])
                except DecodeError:
                    verdicts.append(None)
            lib, mine = verdicts
            assert not (lib is None and mine is not None), "libjpeg refused, own decoder passed"
            if lib is not None and mine is not None:
                assert np.array_equal(lib, mine)
                counts["both decode"] += 1
            else:
                counts["both refuse" if lib is None else "only own refuses"] += 1
    assert counts["both refuse"] > 100 and counts["both decode"] > 20, counts


@needs_ext
@pytest.mark.parametrize("junk", [1, 2, 3])
def test_every_junk_byte_before_the_end_marker_is_reported(junk):
    """libjpeg-turbo's read-ahead swallows a few junk bytes before EOI unseen;
    the own decoder reports them all."""
    for seed in range(20):
        data = jpeg(_noisy(40, 56, 100 + seed), "4:2:0", 90)
        bad = data[:-2] + bytes([0x5A] * junk) + data[-2:]
        with pytest.raises(DecodeError, match="extraneous bytes before marker 0xd9"):
            _decode(bad, (0, 0, 40, 56), 1)


@needs_ext
@pytest.mark.parametrize("junk", [b"\x5a", b"\x5a\xff\x00", b"\x12\xff\x00\x34\x56", bytes(9) + b"\xff\x00",
                                  bytes(30)])
def test_junk_before_the_end_marker_is_counted_in_file_bytes(junk):
    """The count in the message is the junk's length in the file, a stuffed
    zero (FF 00) counting two, whether the reader had loaded as far as the
    marker (a few bytes: the own decoder counts what it loaded) or not (libjpeg's
    marker reader counts what follows): the same message however far a decode
    had read ahead."""
    for seed in range(10):
        data = jpeg(_noisy(40, 56, 200 + seed), "4:2:0", 90)
        bad = data[:-2] + junk + data[-2:]
        for verify in (True, False):
            with pytest.raises(DecodeError, match=f"Corrupt JPEG data: {len(junk)} extraneous bytes before marker 0xd9"):
                _decode(bad, (0, 0, 40, 56), 1, verify=verify)

@needs_ext
def test_junk_before_a_restart_marker_is_reported():
    data = jpeg(_noisy(64, 64, 16), "restart", 90, rst=2)
    at = data.index(b"\xff\xd0")
    bad = data[:at] + b"\x5a" + data[at:]
    with pytest.raises(DecodeError, match="extraneous bytes before marker 0xd0"):
        _decode(bad, (0, 0, 64, 64), 1)


# --- the memory of indexes -------------------------------------------------


def test_verified_keeps_an_index_found_by_both_fingerprints():
    mem = VerifiedJpegs(slots=64, index_bytes=4096)
    data = bytes(range(256)) * 3
    fp, check = mem.fingerprints(data)
    assert fp == mem.fingerprint(data) and fp >> 32 == len(data)
    assert mem.index(fp, check) is None
    mem.add(fp, b"ROWS", check)
    assert mem.seen(fp) and mem.index(fp, check) == b"ROWS"
    assert mem.index(fp, check ^ 1) is None  # same fingerprint, other first half
    other, other_check = mem.fingerprints(data[::-1])
    assert mem.index(other, other_check) is None
    mem.add(other, None, other_check)  # verified, no index
    assert mem.seen(other) and mem.index(other, other_check) is None


def test_the_ring_of_indexes_is_bounded_and_forgets_the_oldest():
    mem = VerifiedJpegs(slots=1024, index_bytes=1000)
    keys = []
    for k in range(40):
        data = k.to_bytes(4, "little") * 50
        fp, check = mem.fingerprints(data)
        mem.add(fp, bytes([k]) * 80, check)  # 80 + 18 bytes each: 10 fit
        keys.append((fp, check, k))
    kept = [k for fp, check, k in keys if mem.index(fp, check) is not None]
    assert kept == list(range(30, 40))
    for fp, check, k in keys[30:]:
        assert mem.index(fp, check) == bytes([k]) * 80
    too_big = VerifiedJpegs(slots=64, index_bytes=50)
    fp, check = too_big.fingerprints(b"x")
    too_big.add(fp, bytes(100), check)
    assert too_big.seen(fp) and too_big.index(fp, check) is None
    none = VerifiedJpegs(slots=64, index_bytes=0)
    none.add(fp, b"ROWS", check)
    assert none.seen(fp) and none.index(fp, check) is None


def test_the_index_memory_pickles_empty_with_its_size():
    mem = VerifiedJpegs(slots=64, index_bytes=5000)
    fp, check = mem.fingerprints(b"abc")
    mem.add(fp, b"ROWS", check)
    copy = pickle.loads(pickle.dumps(mem))
    assert copy.index_bytes == 5000 and copy.slots == 64 and copy.index(fp, check) is None
    with pytest.raises(ValueError, match="index_bytes"):
        VerifiedJpegs(index_bytes=-1)
    with pytest.raises(ValueError, match="cannot map"):  # at once, not in some later decode
        VerifiedJpegs(index_bytes=1 << 60)


def test_each_file_gets_an_equal_share_of_the_ring():
    """max_points from the ring's size and the number of files: three quarters
    of the ring shared out (half that when indexes are rewritten as they grow),
    the record and index headers taken off, 15 bytes a point (the most one
    takes), within 4..4096; 16 (a row index) when the number is not known."""
    mib = 1 << 20
    assert VerifiedJpegs.points_for(128 * mib, 1000) == 4096
    assert VerifiedJpegs.points_for(128 * mib, 2000) == (128 * mib * 3 // 4 // 2000 - 44) // 15
    assert VerifiedJpegs.points_for(128 * mib, 20_000) == (128 * mib * 3 // 4 // 20_000 - 18 - 26) // 15
    assert VerifiedJpegs.points_for(128 * mib, 1_281_167) == 4  # ImageNet: the least
    assert VerifiedJpegs.points_for(128 * mib, None) == 16
    assert VerifiedJpegs.points_for(0, 10) == 0
    assert VerifiedJpegs.points_for(128 * mib, 0) == 4096
    # What every file may take fits the ring, down to the least share.
    for files in (1, 100, 10_000, 100_000):
        points = VerifiedJpegs.points_for(128 * mib, files)
        if points > VerifiedJpegs.MIN_POINTS:
            assert files * (18 + 26 + 15 * points) <= 128 * mib * 3 // 4
    assert VerifiedJpegs(index_bytes=1 * mib, files=500).points == VerifiedJpegs.points_for(mib, 500)
    assert VerifiedJpegs(index_bytes=mib, files=500, rewritten=True).points == \
        VerifiedJpegs.points_for(mib, 1000)
    copy = pickle.loads(pickle.dumps(VerifiedJpegs(slots=64, index_bytes=5000, files=7, rewritten=True)))
    assert copy.files == 7 and copy.rewritten and copy.points == VerifiedJpegs.points_for(5000, 14)
    for bad in (-1, 1.5, True, "9"):
        with pytest.raises(ValueError, match="files"):
            VerifiedJpegs(index_bytes=5000, files=bad)


@needs_ext
def test_a_feeder_sizes_each_files_index_by_its_source(monkeypatch):
    """The feeder's memory gives each file of its source an equal share: a few
    files get the finest grid (every row, every 4 MCUs), many files in little
    memory a coarser one; the decodes are asked for that many points."""
    # Quality 98: noisy files of about 150 KB, large enough for the finest grid
    # within the cap of one point per FILE_BYTES_PER_POINT bytes.
    blobs = [jpeg(_noisy(256, 256, 500 + k), "4:4:4", 98) for k in range(6)]
    asked = []  # the max_points of the recording decodes
    _spy_on_ext(monkeypatch, lambda kw, got: kw.get("record") and asked.append(kw.get("max_points")))
    for index_bytes, want in ((128 << 20, 4096), (30_000, (30_000 * 3 // 4 // 6 - 44) // 15)):
        asked.clear()
        # (an augment stage of its own: every decode through the spied one, see _batches)
        with Feeder(MemorySource(blobs), 3, [ops.RandomResizedCrop(48)], seed=1, decode_threads=2,
                    augment_threads=1, jpeg_index_bytes=index_bytes) as feeder:
            assert work_of(feeder).verified.points == want
            for _ in range(2):
                assert drain(feeder)[1] is None
            verified = work_of(feeder).verified
            kept = [verified.index(*VerifiedJpegs.fingerprints(b)) for b in blobs]
            # Each file's share, and at most one point per FILE_BYTES_PER_POINT of its bytes.
            per_file = {verified.points_of(len(b)) for b in blobs}
        assert per_file == {min(want, len(b) // VerifiedJpegs.FILE_BYTES_PER_POINT) for b in blobs}
        assert asked and set(asked) == per_file
        # 256 / 8 = 32 MCU rows of 32 MCUs: the finest grid has 32 x 8 - 1 points
        sizes = {len(k) for k in kept if k is not None}
        finest = 26 + 13 * (32 * 8 - 1)
        assert min(per_file) >= 32 * 8 - 1 if want == 4096 else max(per_file) < 32 * 8 - 1
        assert sizes and (sizes == {finest} if want == 4096 else max(sizes) < finest)
        assert all(n <= 26 + 13 * want for n in sizes)


def test_an_index_takes_at_most_a_thirty_second_of_its_file():
    """A file's index is capped by the file's own size, whatever its share of the
    ring: a finer grid than that costs memory for next to no speed."""
    mem = VerifiedJpegs(files=10)
    assert mem.points == VerifiedJpegs.MAX_POINTS
    step = VerifiedJpegs.FILE_BYTES_PER_POINT
    assert step == 32 * VerifiedJpegs.POINT_BYTES
    assert mem.points_of(100 * step) == 100
    assert mem.points_of(10) == VerifiedJpegs.MIN_POINTS
    assert mem.points_of(10**9) == VerifiedJpegs.MAX_POINTS
    assert VerifiedJpegs(index_bytes=0, files=10).points_of(10**6) == 0
    crowded = VerifiedJpegs(index_bytes=30_000, files=100)
    assert crowded.points_of(10**6) == crowded.points  # the share binds first


def test_a_shorter_index_never_replaces_a_longer_one():
    """Two decodes of the same bytes that started with no index (two threads,
    a file listed twice) each keep what they passed: the deeper one stays."""
    mem = VerifiedJpegs(slots=64, index_bytes=10_000)
    fp, check = mem.fingerprints(b"the same bytes")
    mem.keep_index(fp, b"D" * 400, check)
    mem.keep_index(fp, b"S" * 40, check)
    assert mem.index(fp, check) == b"D" * 400
    mem.keep_index(fp, b"L" * 500, check)
    assert mem.index(fp, check) == b"L" * 500
    for k in range(40):  # the ring written round: the kept one is gone, a short one is kept again
        other = mem.fingerprints(bytes([k]) * 9)
        mem.add(other[0], bytes([k]) * 400, other[1])
    assert mem.index(fp, check) is None
    mem.keep_index(fp, b"S" * 40, check)
    assert mem.index(fp, check) == b"S" * 40


def test_threads_adding_and_looking_up_never_get_another_files_index():
    """A tiny ring written round many times while other threads read from it."""
    mem = VerifiedJpegs(slots=256, index_bytes=600)
    files = [(k.to_bytes(2, "little") * (20 + k % 7)) for k in range(300)]
    keys = [mem.fingerprints(d) for d in files]
    start = threading.Barrier(4, timeout=JOIN_TIMEOUT_S)
    wrong: list = []

    def writer(part: int) -> None:
        start.wait()
        for _ in range(20):
            for k in range(part, len(files), 2):
                fp, check = keys[k]
                mem.add(fp, files[k][:40] + bytes([k % 251]) * (k % 50), check)

    def reader() -> None:
        start.wait()
        for _ in range(20):
            for k, (fp, check) in enumerate(keys):
                got = mem.index(fp, check)
                if got is not None and got != files[k][:40] + bytes([k % 251]) * (k % 50):
                    wrong.append(k)

    threads = [threading.Thread(target=writer, args=(p,)) for p in (0, 1)] + \
              [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        assert not t.is_alive()
    assert wrong == []


# --- through a Feeder ------------------------------------------------------


def _spy_on_ext(monkeypatch, seen) -> None:
    """Put in the decode path a stand-in for the extension that calls
    ``seen(kwargs, result)`` after each of its decodes."""
    real = ext.decode

    class Spy:
        @staticmethod
        def decode(*args, **kwargs):
            got = real(*args, **kwargs)
            seen(kwargs, got)
            return got

        def __getattr__(self, name):
            return getattr(ext, name)

    monkeypatch.setattr(D.extension, "jpeg", Spy())


def _batches(blobs: list[bytes], epochs: int, **options) -> list[np.ndarray]:
    """The batches of ``epochs`` epochs, the transforms in an augment stage of
    their own: every decode then goes through the extension's ``decode``, which
    the spies see (the fused call, which reads the memory in C, is checked
    against this path in tests/decode/test_fused_memory.py)."""
    out = []
    with Feeder(MemorySource(blobs), 8, [ops.RandomResizedCrop(48), ops.RandomHorizontalFlip()],
                shuffle=True, seed=5, decode_threads=2, augment_threads=1, **options) as feeder:
        for _ in range(epochs):
            batches, error = drain(feeder)
            assert error is None
            out += [images for images, _ in batches]
    return out


@needs_ext
def test_a_feeder_gives_the_same_batches_with_and_without_indexes(monkeypatch):
    blobs = [jpeg(_noisy(90 + 7 * k, 120 - 3 * k, 200 + k), ["4:2:0", "4:4:4", "gray", "restart"][k % 4], 90)
             for k in range(24)]
    calls = []  # the MCUs jumped by each decode given an index
    plain = _batches(blobs, 3, jpeg_index_bytes=0)
    assert calls == []
    _spy_on_ext(monkeypatch, lambda kw, got: kw.get("index") is not None and calls.append(got[3]))
    indexed = _batches(blobs, 3)
    assert len(indexed) == len(plain) and all(np.array_equal(a, b) for a, b in zip(plain, indexed))
    assert len(calls) == 2 * len(blobs)  # epochs 2 and 3 decode with the index
    assert sum(calls) > 0  # and some crops start below the first row


@needs_ext
def test_without_jpeg_verify_crops_build_the_index_as_they_go(monkeypatch):
    blobs = [jpeg(_noisy(200 + 9 * k, 80, 400 + k), ["4:2:0", "4:4:4", "restart"][k % 3], 90)
             for k in range(12)]
    jumps = []  # the MCUs its decodes jumped
    plain = _batches(blobs, 4, jpeg_verify=False, jpeg_index_bytes=0)
    _spy_on_ext(monkeypatch, lambda kw, got: len(got) == 4 and jumps.append(got[3]))
    indexed = _batches(blobs, 4, jpeg_verify=False)
    assert len(indexed) == len(plain) and all(np.array_equal(a, b) for a, b in zip(plain, indexed))
    assert sum(jumps) > 0


@pytest.mark.parametrize("bad", [-1, True, "128MB", 1.5, None, 1 << 60])
def test_jpeg_index_bytes_must_be_a_count(bad):
    with pytest.raises((ValueError, ConfigError), match="jpeg_index_bytes"):
        Feeder(MemorySource([b""]), 1, jpeg_index_bytes=bad)


@needs_ext
@pytest.mark.parametrize("transforms", [[], [ops.RandomResizedCrop(32)], [ops.Resize(40), ops.CenterCrop(32)]])
def test_a_stray_byte_before_the_end_marker_fails_the_sample_whatever_the_transforms(transforms):
    """One Huffman decoder judges every JPEG the extension can decode, crop or
    not: the verdict does not depend on the transforms."""
    good = jpeg(_noisy(56, 72, 300), "4:2:0", 90)
    bad = good[:-2] + b"\x5a" + good[-2:]
    sized = {} if transforms else {"image_size": (56, 72)}
    with Feeder(MemorySource([good, bad]), 1, transforms, on_error="skip", **sized) as feeder:
        batches, error = drain(feeder)
        assert error is None and len(batches) == 1 and feeder.stats().skipped == 1


def test_no_index_memory_is_mapped_without_indexes():
    mem = VerifiedJpegs(slots=64, index_bytes=0)
    fp, check = mem.fingerprints(b"abc")
    mem.add(fp, b"ROWS", check)
    assert mem.seen(fp) and mem._where is None and mem._ring is None


# --- fill bytes ------------------------------------------------------------


def _stuffed_zeros(data: bytes) -> list[int]:
    """Offsets of the FF 00 pairs (data FFs) in the scan of ``data``."""
    sos = data.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")
    return [i for i in range(start, len(data) - 2) if data[i] == 0xFF and data[i + 1] == 0]


@needs_ext
@pytest.mark.parametrize("kind", ["4:2:0", "restart"])
def test_fill_bytes_before_a_stuffed_zero_are_refused(kind):
    """FF FF 00 is no valid stream (fill bytes come before markers only):
    libjpeg-turbo's slow path reads it as one FF, its fast path as a marker,
    and the two give other pixels. The own decoder refuses it, in a verify
    pass and from an index alike."""
    data = jpeg(_noisy(200, 160, 17), kind, 95, rst=2)
    _, (_, _, index, _) = _decode(data, (0, 0, 200, 160), 1, record=True, max_points=4096)
    wides = _stuffed_zeros(data)
    for p in wides[::max(1, len(wides) // 40)]:
        for fill in (b"\xff", b"\xff\xff"):
            bad = data[:p] + fill + data[p:]
            for kw in ({}, {"record": True, "max_points": 4096}):
                with pytest.raises(DecodeError, match="fill bytes before a stuffed zero"):
                    _decode(bad, (0, 0, 200, 160), 1, **kw)
            with pytest.raises(DecodeError, match="fill bytes before a stuffed zero"):
                _decode(bad, (190, 0, 10, 160), 1, verify=False, index=index)


@needs_ext
@pytest.mark.parametrize("kind", ["4:2:0", "restart"])
def test_fill_bytes_before_a_marker_decode_as_libjpeg_does(kind):
    """Fill bytes before a marker are valid: the pixels are libjpeg's, and a
    decode from the index recorded over them gives them again."""
    data = jpeg(_noisy(200, 160, 18), kind, 95, rst=2)
    start = _stuffed_zeros(data)[0]  # in the scan
    markers = [i for i in range(start, len(data) - 1) if data[i] == 0xFF and 0xD0 <= data[i + 1] <= 0xD9]
    rng = random.Random(18)
    for p in markers[::max(1, len(markers) // 12)]:
        padded = data[:p] + b"\xff" * rng.randrange(1, 4) + data[p:]
        _, (_, _, index, _) = _decode(padded, (0, 0, 200, 160), 1, record=True, max_points=4096)
        for box in [(0, 0, 200, 160), (120, 30, 80, 100), (64, 0, 40, 160)]:
            ref, _ = _decode(padded, box, 1, own=False)
            own, _ = _decode(padded, box, 1)
            fast, _ = _decode(padded, box, 1, verify=False, index=index)
            assert np.array_equal(own, ref) and np.array_equal(fast, ref), (p, box)


@needs_ext
def test_a_feeder_never_delivers_a_file_with_fill_bytes_before_a_stuffed_zero(monkeypatch):
    """Through a Feeder, CenterCrop, three epochs: the damaged file fails in
    the first (jpeg_verify) and in the later ones (decoded from the index of
    the files around it); the others' pixels equal libjpeg's decoder's."""
    good = [jpeg(_noisy(96 + 8 * k, 128, 500 + k), ["4:2:0", "restart"][k % 2], 95, rst=2) for k in range(6)]
    data = good[0]
    wides = _stuffed_zeros(data)
    bads = [data[:p] + b"\xff" + data[p:] for p in (wides[len(wides) // 2], wides[-1])]
    blobs = good + bads
    names = [f"{k}.jpg" for k in range(len(blobs))]

    def epochs(**options):
        out = []
        with Feeder(MemorySource(blobs, names=names), 1, [ops.CenterCrop(64)], on_error="skip",
                    seed=3, decode_threads=2, **options) as feeder:
            for _ in range(3):
                batches, error = drain(feeder)
                assert error is None
                out.append(sorted((int(labels[0]), images[0].tobytes()) for images, labels in batches))
            skipped = feeder.stats().skipped_paths
        return out, skipped

    got, skipped = epochs()
    assert sorted(set(skipped)) == names[len(good):]
    assert all([k for k, _ in epoch] == list(range(len(good))) for epoch in got)
    ref, _ = epochs(jpeg_index_bytes=0)
    monkeypatch.setattr(D.extension, "jpeg", None)  # the fallback decoder for the good files
    lib, _ = epochs()
    good_only = [[item for item in epoch if item[0] < len(good)] for epoch in lib]
    assert got == ref == good_only


def _with_ac_symbols_swapped(data: bytes, a: int, b: int) -> bytes:
    """``data`` with symbols ``a`` and ``b`` swapped in its last Huffman table (an
    AC table: libjpeg writes the chroma AC table last): another table, which
    decodes the file as before when neither symbol occurs in it."""
    out = bytearray(data)
    at = data.rfind(b"\xff\xc4")
    assert at > 0 and data[at + 4] >> 4 == 1  # an AC table
    symbols = at + 4 + 17
    i, j = data.index(bytes([a]), symbols), data.index(bytes([b]), symbols)
    out[i], out[j] = b, a
    return bytes(out)


@needs_ext
def test_a_decode_keeps_the_tables_it_reads_when_it_builds_another():
    # Each thread keeps 8 tables and a decode reads them where they are kept:
    # a table built for a file must not take the place of one that the same
    # file reads. In a fresh thread, a file with the standard tables (4 kept),
    # files with their own (optimized) tables, then a file with three of the
    # standard tables and a fourth of its own (the chroma AC table with two
    # symbols swapped, two that its data never uses): with every number of
    # files between, the next slot to fill lands on one of the three tables
    # the last file reads at some point.
    ok, std = cv2.imencode(".jpg", _noisy(48, 64, 1), [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    std = std.tobytes()
    other = _with_ac_symbols_swapped(std, 0xF9, 0xFA)  # 16-bit codes of values of 9 and 10 bits
    optimized = []
    for i in range(4):
        ok, buf = cv2.imencode(".jpg", _noisy(40, 56, 10 + i),
                               [cv2.IMWRITE_JPEG_QUALITY, 50 + 10 * i, cv2.IMWRITE_JPEG_OPTIMIZE, 1])
        assert ok
        optimized.append(buf.tobytes())
    H, W = _scaled(other, 1)
    want = _decode(other, (0, 0, H, W), 1, own=False)[0]
    np.testing.assert_array_equal(want, _decode(std, (0, 0, H, W), 1, own=False)[0])
    errors: list[BaseException] = []

    def run(between: list[bytes]) -> None:
        try:
            for data in [std, *between]:
                h, w = _scaled(data, 1)
                _decode(data, (0, 0, h, w), 1, own=True)
            np.testing.assert_array_equal(_decode(other, (0, 0, H, W), 1, own=True)[0], want)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    for n in range(len(optimized) + 1):
        t = threading.Thread(target=run, args=(optimized[:n],))  # a thread of its own: no tables yet
        t.start()
        t.join(JOIN_TIMEOUT_S)
        assert not t.is_alive() and not errors, (n, errors)


def _with_eob_as(data: bytes, symbol: int) -> bytes:
    """``data`` with the end-of-block symbol (0x00) of every AC table written as
    ``symbol``, a run/size of size 0 that is not ZRL: JPEG decoders (libjpeg)
    end a block on every such symbol, so the file decodes as before."""
    out = bytearray(data)
    at = data.find(b"\xff\xc4")
    while at >= 0:
        end = at + 2 + int.from_bytes(data[at + 2:at + 4], "big")
        p = at + 4
        while p < end:  # each table of the segment: class/id, 16 counts, the symbols
            count = sum(data[p + 1:p + 17])
            if data[p] >> 4 == 1:  # an AC table
                symbols = data[p + 17:p + 17 + count]
                assert 0 in symbols
                out[p + 17 + symbols.index(0)] = symbol
            p += 17 + count
        at = data.find(b"\xff\xc4", end)
    return bytes(out)


@needs_ext
@pytest.mark.parametrize("symbol", [0x10, 0x50, 0xE0])
def test_every_size_0_symbol_but_zrl_ends_a_block(symbol):
    # A symbol of size 0 ends a block unless it is a run of 16 zeros (0xF0):
    # the own decoder's tables read the first symbol of a look and the one
    # after it, and an end of block in either place must end the block as
    # libjpeg ends it. Smooth files at quality 75 (many blocks end right after
    # their DC: the end of block is the first symbol of a look) and noisy ones
    # at 95 (runs of 16 zeros occur too), whole and a middle region.
    for seed in range(6):
        img = make_image(48, 64, seed=300 + seed) if seed % 2 else _noisy(48, 64, 300 + seed)
        data = jpeg(img, ["4:2:0", "4:4:4", "gray"][seed % 3], 75 if seed % 2 else 95)
        other = _with_eob_as(data, symbol)
        assert other != data
        for box in [(0, 0, 48, 64), (13, 21, 20, 30)]:
            want = _decode(data, box, 1, own=False)[0]
            np.testing.assert_array_equal(_decode(other, box, 1, own=False)[0], want)
            np.testing.assert_array_equal(_decode(other, box, 1, own=True)[0], want)

def _with_symbols_swapped(data: bytes) -> bytes:
    """``data`` with the first two symbols of its last Huffman table swapped:
    the same code lengths (a valid table), other symbols for two codes."""
    b = bytearray(data)
    at = data.rfind(b"\xff\xc4")
    assert at > 0
    seg_end = at + 2 + int.from_bytes(data[at + 2:at + 4], "big")
    p = at + 4
    last = None
    while p < seg_end:  # each table of the segment: class/id, 16 counts, the symbols
        count = sum(data[p + 1:p + 17])
        last = p + 17
        p += 17 + count
    b[last], b[last + 1] = b[last + 1], b[last]
    return bytes(b)


@needs_ext
def test_each_file_decodes_with_its_own_huffman_tables():
    # The decoder keeps the tables a thread built last (with their skip tables)
    # and copies one when a file defines the same: files with the standard tables, files with their
    # own (optimized) ones, and one whose table has the same code lengths as
    # another's but other symbols, in turns, in one thread and in two, each
    # gives libjpeg's own decoder's outcome.
    files = []
    for i in range(10):
        params = [cv2.IMWRITE_JPEG_QUALITY, 40 + 6 * i]
        if i % 2:
            params += [cv2.IMWRITE_JPEG_OPTIMIZE, 1]
        ok, buf = cv2.imencode(".jpg", _noisy(24 + 8 * i, 40 + 4 * i, i), params)
        assert ok
        files.append(buf.tobytes())
    files.append(_with_symbols_swapped(files[1]))
    files.append(_with_symbols_swapped(files[2]))

    def outcome(data: bytes, own: bool):
        # The whole image, and a middle region read on to the end of the scan
        # (the MCUs around it skipped: the AC tables' skip tables, kept too).
        H, W = _scaled(data, 1)
        try:
            whole = _decode(data, (0, 0, H, W), 1, own=own)[0]
            middle = _decode(data, (H // 3, W // 3, max(1, H // 3), max(1, W // 3)), 1, own=own)[0]
            return np.concatenate([whole.ravel(), middle.ravel()])
        except DecodeError as e:
            return str(e)

    want = [outcome(data, False) for data in files]
    assert sum(isinstance(w, str) for w in want) < len(files) - 2  # most decode

    def check(order: list[int]) -> None:
        for i in order:
            got = outcome(files[i], True)
            if isinstance(want[i], str):
                assert isinstance(got, str), i
            else:
                np.testing.assert_array_equal(got, want[i], err_msg=str(i))

    rng = random.Random(3)
    orders = [rng.sample(range(len(files)), len(files)) * 3 for _ in range(3)]
    check(orders[0])
    errors: list[BaseException] = []

    def run(order: list[int]) -> None:
        try:
            check(order)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(o,)) for o in orders[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
