"""jpeg_verify reads each distinct JPEG byte string to its end once
(feeder/decode/verified.py): the same bytes again stop after the crop, and bytes
that changed in any way, even by one bit at the same length, are read to their
end again, so damage that appears after a file first passed still fails it."""

from __future__ import annotations

import numpy as np
import pytest
import simplejpeg

from tests.support import JOIN_TIMEOUT_S, drain
from tests.support.jpeg import jpeg
from feeder import DecodeError, Feeder, ops
from feeder.engine.steps import SampleWork
from feeder.synthetic import make_image
from feeder import decode as _decode
from feeder.ops.chain import Chain
from feeder.decode.jpeg import JpegDecoder
from feeder.decode.verified import VerifiedJpegs

ext = _decode._jpeg
needs_ext = pytest.mark.skipif(ext is None, reason=f"region decoder not in use: {_decode._jpeg_missing}")


@pytest.fixture(autouse=True)
def _every_file_through_the_memory(monkeypatch):
    """The files here are small: below JpegDecoder.SMALL_BYTES they would skip the
    memory these tests are about (tests/decode/test_jpeg_small.py tests that threshold)."""
    monkeypatch.setattr(JpegDecoder, "SMALL_BYTES", 0)


GOOD = jpeg(make_image(256, 64, seed=5), "4:2:0")
CENTRE = (120, 24, 16, 16)  # CenterCrop(16) of the 256x64 image: (top, left, height, width)


def _region(data: bytes, box: tuple[int, int, int, int], verify: bool) -> np.ndarray:
    t, l, h, w = box
    buf = np.empty(h * (w + 2 * ext.PAD + 32) * 3, np.uint8)
    stride, offset = ext.decode(data, t, l, h, w, 1, buf, 1 << 30, False, verify)
    return buf[:h * stride * 3].reshape(h, stride, 3)[:, offset:offset + w]


def _silently_damaged() -> bytes:
    """GOOD with one bit flipped above the centre crop such that stopping after the
    crop gives wrong pixels and no error, and reading to the end is an error."""
    ref = simplejpeg.decode_jpeg(GOOD)[120:136, 24:40]
    sos = GOOD.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(GOOD[sos + 2:sos + 4], "big")
    for at in range(start + 10, start + (len(GOOD) - start) // 3):
        bad = GOOD[:at] + bytes([GOOD[at] ^ 0x10]) + GOOD[at + 1:]
        try:
            if np.array_equal(_region(bad, CENTRE, False), ref):
                continue
        except DecodeError:
            continue
        try:
            _region(bad, CENTRE, True)
        except DecodeError:
            return bad
    raise AssertionError("no single-bit flip of the kind the test needs")


class _Recorder:
    """The extension with each decode call's verify flag, and whether it was given
    a row index, recorded."""

    def __init__(self) -> None:
        self.verify: list[bool] = []
        self.indexed: list[bool] = []

    def __getattr__(self, name):
        return getattr(ext, name)

    def decode(self, *args, **kwargs):
        self.verify.append(bool(args[9]))
        self.indexed.append(kwargs.get("index") is not None)
        return ext.decode(*args, **kwargs)


def _recording(monkeypatch, chain: list, recorder: _Recorder | None = None,
               **options) -> tuple[_Recorder, SampleWork]:
    """A SampleWork of ``chain`` whose extension calls ``recorder`` records."""
    rec = _Recorder() if recorder is None else recorder
    monkeypatch.setattr(_decode.extension, "jpeg", rec)
    return rec, SampleWork(Chain(chain, None), **options)


def _decode_once(work: SampleWork, data) -> None:
    img, _ = work.decode(data, 0)
    work.discard(img)


def test_fingerprint_is_nonzero_and_changes_with_any_byte_or_the_length():
    fp = VerifiedJpegs.fingerprint
    assert fp(b"") != 0 and fp(GOOD) != 0
    assert fp(GOOD) == fp(bytearray(GOOD)) == fp(memoryview(GOOD))
    flipped = {fp(GOOD[:k] + bytes([GOOD[k] ^ 1]) + GOOD[k + 1:]) for k in range(0, len(GOOD), 97)}
    assert fp(GOOD) not in flipped and len(flipped) == len(range(0, len(GOOD), 97))
    assert fp(GOOD + b"\x00") != fp(GOOD) and fp(GOOD[:-1]) != fp(GOOD)


def _crc(data: bytes) -> int:
    """The CRC in the fingerprint."""
    return VerifiedJpegs.fingerprint(data) & 0xFFFFFFFF


def _forge_suffix(data: bytes, target: int) -> bytes:
    """4 bytes whose appending to ``data`` gives the CRC ``target`` (a CRC is
    affine over GF(2): solve for the 32 bits)."""
    base = _crc(data + bytes(4))
    columns = [_crc(data + (1 << k).to_bytes(4, "little")) ^ base for k in range(32)]
    rows, want = list(columns), base ^ target
    # Gaussian elimination on 32 columns of 32 bits, tracking which input bits make each.
    combo = [1 << k for k in range(32)]
    solution = 0
    for bit in range(32):
        pivot = next((i for i in range(bit, 32) if rows[i] >> bit & 1), None)
        assert pivot is not None
        rows[bit], rows[pivot] = rows[pivot], rows[bit]
        combo[bit], combo[pivot] = combo[pivot], combo[bit]
        for i in range(32):
            if i != bit and rows[i] >> bit & 1:
                rows[i] ^= rows[bit]
                combo[i] ^= combo[bit]
    for bit in range(32):
        if want >> bit & 1:
            solution ^= combo[bit]
    suffix = solution.to_bytes(4, "little")
    assert _crc(data + suffix) == target
    return suffix


def _crc32c_reference(data: bytes) -> int:
    """CRC-32C from its definition (reflected polynomial 0x82F63B78), a byte at a time."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


@needs_ext
@pytest.mark.skipif(ext is None or not ext.CRC32C_HARDWARE, reason="no CRC-32C instruction")
def test_crc32c_is_the_castagnoli_crc_of_every_byte():
    assert ext.crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert ext.crc32c(b"") == 0 and ext.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720's zeros
    rng = np.random.default_rng(7)
    # Short strings at every alignment, and lengths around the three-stream
    # split (1536 bytes and up), whose joined registers must be one stream's;
    # the last is past the size where the GIL is given up.
    for n in [*range(0, 40), 1535, 1536, 1537, 1543, 1544, 1545, 3 * 1024 + 7, 10_007, (256 << 10) + 5]:
        data = rng.integers(0, 256, n + 3, dtype=np.uint8).tobytes()
        for start in (0, 1, 3):
            view = memoryview(data)[start:start + n]
            assert ext.crc32c(view) == _crc32c_reference(bytes(view)), (n, start)
    assert VerifiedJpegs.fingerprint(GOOD) == (len(GOOD) << 32) | ext.crc32c(GOOD)


def test_fingerprint_holds_the_length_and_every_byte_of_a_large_file():
    big = jpeg(np.random.default_rng(1).integers(0, 255, (320, 320, 3), dtype=np.uint8), "4:4:4", 95)
    assert len(big) > 3 * 65536
    tail = big[:-10] + bytes([big[-10] ^ 1]) + big[-9:]  # one bit, past the first 192 KiB
    assert VerifiedJpegs.fingerprint(tail) != VerifiedJpegs.fingerprint(big)
    longer = big + _forge_suffix(big, _crc(big))  # the same CRC, 4 bytes longer
    assert _crc(longer) == _crc(big)
    assert VerifiedJpegs.fingerprint(longer) != VerifiedJpegs.fingerprint(big)


def test_memory_keeps_what_fits():
    """At 60% of the slots, buckets of four in two places keep all but a few
    percent (one slot per fingerprint would keep about 75%)."""
    memo = VerifiedJpegs(slots=4096)
    rng = np.random.default_rng(2)
    fps = [int(x) | 1 for x in rng.integers(1, 1 << 62, 2458)]
    for f in fps:
        memo.add(f)
    kept = sum(memo.seen(f) for f in fps)
    assert kept >= 0.97 * len(fps), kept
    assert len(memo) == kept  # nothing stored twice


def test_memory_is_bounded_and_forgets_rather_than_confuses():
    with pytest.raises(ValueError, match="power of two"):
        VerifiedJpegs(12)
    memo = VerifiedJpegs(slots=64)
    assert len(memo) == 0 and not memo.seen(VerifiedJpegs.fingerprint(GOOD))
    fps = [VerifiedJpegs.fingerprint(i.to_bytes(4, "little")) for i in range(1000)]
    for f in fps:
        memo.add(f)
        assert memo.seen(f)  # just added: always found
    assert len(memo) <= 64
    # Entries pushed out are forgotten (read to the end again), never mistaken
    # for others: every remembered fingerprint is one that was added.
    remembered = [f for f in fps if memo.seen(f)]
    assert 0 < len(remembered) <= 64
    assert not any(memo.seen(VerifiedJpegs.fingerprint(i.to_bytes(4, "little") + b"x")) for i in range(1000))


@needs_ext
def test_same_bytes_are_read_to_their_end_once_and_give_the_same_pixels(monkeypatch):
    rec, work = _recording(monkeypatch, [ops.RandomResizedCrop(32)])
    other = jpeg(make_image(200, 120, seed=6), "4:4:4")
    out = np.empty((32, 32, 3), np.uint8)
    firsts = []
    for data in (GOOD, other):
        img, ctx = work.decode(data, 7)
        work.transform(img, 7, ctx, out)
        firsts.append(out.copy())
    for data, first in zip((bytearray(GOOD), memoryview(other)), firsts):  # equal bytes, other objects
        img, ctx = work.decode(data, 7)
        work.transform(img, 7, ctx, out)
        np.testing.assert_array_equal(out, first)
    assert rec.verify == [True, True, False, False]
    assert len(work.verified) == 2


@needs_ext
def test_bytes_damaged_after_they_passed_are_read_to_their_end_again(monkeypatch):
    bad = _silently_damaged()
    rec, work = _recording(monkeypatch, [ops.CenterCrop(16)])
    _decode_once(work, GOOD)
    for _ in range(2):  # a failed decode is not remembered
        with pytest.raises(DecodeError, match="corrupt JPEG"):
            work.decode(bad, 0)
    _decode_once(work, GOOD)
    assert rec.verify == [True, True, True, False]


@needs_ext
def test_jpeg_verify_false_reads_no_file_to_its_end(monkeypatch):
    """It keeps row indexes (of the rows its crops passed), never a verdict."""
    rec, work = _recording(monkeypatch, [ops.CenterCrop(16)], jpeg_verify=False)
    for _ in range(2):
        _decode_once(work, GOOD)
    assert rec.verify == [False, False] and rec.indexed == [False, True]
    _, work = _recording(monkeypatch, [ops.CenterCrop(16)], rec, jpeg_verify=False, jpeg_index_bytes=0)
    assert work.verified is None
    _decode_once(work, GOOD)
    assert rec.verify == [False, False, False] and rec.indexed == [False, True, False]


@needs_ext
def test_bytes_that_changed_while_decoded_are_not_remembered(monkeypatch):
    """A source's mutable buffer that another thread rewrites during the decode:
    the fingerprint taken before it (damaged bytes) must not be remembered for
    the bytes that were decoded (good ones)."""
    bad = _silently_damaged()
    data = bytearray(bad)

    class Swap(_Recorder):
        def decode(self, *args, **kwargs):
            data[:] = GOOD  # what the decoder reads is not what was fingerprinted
            return super().decode(*args, **kwargs)

    _, work = _recording(monkeypatch, [ops.CenterCrop(16)], Swap())
    _decode_once(work, data)  # the good bytes decode
    assert not work.verified.seen(VerifiedJpegs.fingerprint(bad))
    monkeypatch.setattr(_decode.extension, "jpeg", ext)
    with pytest.raises(DecodeError):
        work.decode(bad, 0)


@needs_ext
def test_progressive_files_are_not_remembered(monkeypatch):
    """Their scans are all read before any row, so their end is reached anyway."""
    rec, work = _recording(monkeypatch, [ops.CenterCrop(16)])
    data = jpeg(make_image(256, 64, seed=5), "progressive")
    for _ in range(2):
        _decode_once(work, data)
    assert rec.verify == [True, True] and len(work.verified) == 0


@needs_ext
def test_the_engine_keeps_its_memory_across_epochs(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(_decode.extension, "jpeg", rec)
    blobs = [GOOD, jpeg(make_image(256, 64, seed=9), "4:2:0")]

    class Source:
        def __len__(self):
            return 2

        def read(self, i):
            return blobs[i], i

    with Feeder(Source(), 2, [ops.CenterCrop(16)], shuffle=False, timeout=JOIN_TIMEOUT_S) as f:
        for _ in range(3):
            batches, error = drain(f)
            assert error is None and sum(len(y) for _, y in batches) == 2
    assert rec.verify == [True, True, False, False, False, False]


class _Republished:
    """Index 0 is re-published between its reads: good bytes the first time,
    damaged ones (same length, one bit flipped) after."""

    def __init__(self, bad: bytes) -> None:
        self.bad = bad
        self.reads = 0

    def __len__(self) -> int:
        return 2

    def read(self, i):
        if i == 1:
            return jpeg(make_image(256, 64, seed=9), "4:2:0"), 1
        self.reads += 1
        return (GOOD if self.reads == 1 else self.bad), 0


@needs_ext
@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_file_damaged_between_epochs_is_skipped_in_the_next_epoch(isolation):
    """The memory is of bytes, not of samples: a sample whose bytes changed after
    an epoch in which they passed fails again, in every engine."""
    with Feeder(_Republished(_silently_damaged()), 2, [ops.CenterCrop(16)], on_error="skip",
                shuffle=False, isolation=isolation, timeout=JOIN_TIMEOUT_S) as f:
        labels = []
        for _ in range(3):
            batches, error = drain(f)
            assert error is None
            labels.append(sorted(int(x) for _, y in batches for x in y))
    assert labels == [[0, 1], [1], [1]]


def test_a_pickled_copy_starts_empty():
    import pickle

    memo = VerifiedJpegs(slots=64)
    fp = VerifiedJpegs.fingerprint(GOOD)
    memo.add(fp)
    copy = pickle.loads(pickle.dumps(memo))
    assert memo.seen(fp) and not copy.seen(fp) and copy.slots == 64
    copy.add(fp)
    assert copy.seen(fp)
