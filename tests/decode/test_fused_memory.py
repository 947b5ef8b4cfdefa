"""The fused call reads the verified-JPEG memory in C (``JpegDecoder.fused`` with
``VerifiedJpegs.native``): it must remember what the region decode in Python
remembers (the same files read to their end, the same row indexes), give the
same pixels and the same verdicts on damaged files, never trust an index that
was damaged or written over, and refuse a memory it cannot read."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from tests.support.jpeg import KINDS, jpeg
from feeder import DecodeError, ops
from feeder.decode import extension
from feeder.decode.headers import _MAX_HEADER_STEPS
from feeder.decode.verified import VerifiedJpegs
from feeder.engine.steps import SampleWork
from feeder.ops.chain import Chain
from feeder.sample.rng import epoch_key, index_key
from feeder.synthetic import make_image

ext = extension.jpeg
pytestmark = pytest.mark.skipif(ext is None or not ext.CRC32C_HARDWARE,
                                reason="the region decoder is not built, or reads no memory here")

CHAIN = [ops.RandomResizedCrop(40), ops.RandomHorizontalFlip()]
RECORD = struct.Struct("<QIIH")


class _InPython(VerifiedJpegs):
    """A memory the fused call leaves to the region decode in Python."""

    native = None


def _noisy(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = make_image(h, w, seed=seed).astype(np.int16)
    return np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)


def _files() -> list[bytes]:
    """Small and large files of every kind (restart markers and progressive ones too)."""
    return [jpeg(_noisy(h, w, 7 * n + h), kind, 90)
            for n, kind in enumerate(KINDS) for h, w in [(60, 44), (210, 170), (333, 400)]]


def _works(files: list[bytes], **options) -> tuple[SampleWork, SampleWork]:
    """(the memory in C, the memory in Python), every file through the memory."""
    native = SampleWork(Chain(CHAIN, None), files=len(files), **options)
    python = SampleWork(Chain(CHAIN, None), files=len(files),
                        verified=_InPython(files=len(files), index_bytes=native.verified.index_bytes,
                                           rewritten=native.verified.rewritten), **options)
    python.jpeg.small_bytes = 0
    return native, python


def _sample(work: SampleWork, data: bytes, key: int) -> np.ndarray | str:
    out = np.full((40, 40, 3), 3, np.uint8)
    try:
        img, ctx = work.decode_into(data, key, out)
    except DecodeError as exc:
        return str(exc)
    if img is None:
        work.finish_into(key, out)
    else:
        work.transform(img, key, ctx, out)
    return out


def _remembered(work: SampleWork, files: list[bytes]) -> list[tuple[bool, bytes | None]]:
    memo = work.verified
    out = []
    for data in files:
        fp, check = memo.fingerprints(data)
        out.append((memo.seen(fp), memo.index(fp, check)))
    return out


@pytest.mark.parametrize("verify", [True, False])
def test_the_memory_in_c_remembers_what_the_python_path_remembers(verify):
    files = _files()
    native, python = _works(files, jpeg_verify=verify)
    for epoch in range(3):
        pass_key = epoch_key(5, epoch)
        for i, data in enumerate(files):
            key = index_key(pass_key, i)
            a, b = _sample(native, data, key), _sample(python, data, key)
            np.testing.assert_array_equal(a, b, err_msg=f"file {i}, epoch {epoch}")
        assert _remembered(native, files) == _remembered(python, files), epoch
    kept = _remembered(native, files)
    # Every file of one scan is remembered with an index (without verify, as
    # bytes whose index is kept), a progressive one not at all.
    assert sum(index is not None and seen for seen, index in kept) >= len(files) - 3


def _damaged(good: bytes, key: int) -> bytes:
    """``good`` with one bit flipped where stopping after the crop of ``key``
    decodes without an error and reading on to the end is one."""
    probe = SampleWork(Chain(CHAIN, None), jpeg_verify=False, jpeg_index_bytes=0)
    strict = SampleWork(Chain(CHAIN, None), jpeg_index_bytes=0)
    sos = good.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(good[sos + 2:sos + 4], "big")
    for at in range(len(good) - 3, start, -1):
        bad = good[:at] + bytes([good[at] ^ 0x10]) + good[at + 1:]
        if isinstance(_sample(probe, bad, key), str):
            continue
        if isinstance(_sample(strict, bad, key), str):
            return bad
    raise AssertionError("no single-bit flip of the kind the test needs")


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("size", [(60, 44), (333, 400)], ids=["small", "large"])
def test_a_damaged_file_gets_the_same_verdict_every_read(verify, size):
    """Damage below the crop: with jpeg_verify every read of it fails (it is never
    remembered, even after the good bytes were), the same error as in Python;
    without it, its crop is delivered."""
    good = jpeg(_noisy(*size, 1), "4:2:0", 90)
    key = index_key(epoch_key(5, 0), 0)
    bad = _damaged(good, key)
    native, python = _works([good, bad], jpeg_verify=verify)
    seq = [good, bad, good, bad, bad]
    got = [_sample(native, data, key) for data in seq]
    want = [_sample(python, data, key) for data in seq]
    for a, b in zip(got, want):
        assert type(a) is type(b)
        if isinstance(a, str):
            assert a == b and "corrupt JPEG" in a
        else:
            np.testing.assert_array_equal(a, b)
    assert [isinstance(x, str) for x in got] == ([False, True, False, True, True] if verify else [False] * 5)


def _record_at(memo: VerifiedJpegs, data: bytes) -> int:
    """Where in the ring the record of ``data``'s index starts."""
    fp, _ = memo.fingerprints(data)
    table = np.frombuffer(memo._table, np.uint64)
    (slot,) = np.flatnonzero(table == fp)
    return (int(memo._where[slot]) - 1) % memo.index_bytes


def _epochs(work: SampleWork, files: list[bytes], epochs: range) -> list:
    return [_sample(work, data, index_key(epoch_key(9, e), i))
            for e in epochs for i, data in enumerate(files)]


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_a_damaged_index_is_not_used():
    """A record whose bytes no longer match its CRC (a torn read) is passed over:
    the crops decode from the scan's start, to the same pixels."""
    files = [jpeg(_noisy(333, 400, s), "4:2:0", 90) for s in range(3)]
    work = SampleWork(Chain(CHAIN, None), files=len(files))
    reference = SampleWork(Chain(CHAIN, None), jpeg_index_bytes=0)
    _epochs(work, files, range(1))
    ring = work.verified._ring
    for data in files:
        at = _record_at(work.verified, data)
        n = RECORD.unpack_from(ring, at)[3]
        body = at + RECORD.size
        ring[body:body + n] = bytes(255 - b for b in ring[body:body + n])
    _same(_epochs(work, files, range(1, 4)), _epochs(reference, files, range(1, 4)))


def _shifted_dc(index: bytes) -> bytes:
    """A row index (``_huffman.c``'s layout: a 26-byte header, then per
    checkpoint its position, bits, signature, restart count, and each
    component's DC prediction) with every luma DC prediction moved by 40."""
    out = bytearray(index)
    ncomp, restart, count = out[3], int.from_bytes(out[16:18], "little"), int.from_bytes(out[22:24], "little")
    entry = 7 + (2 if restart else 0) + 2 * ncomp
    for k in range(count):
        at = 26 + k * entry + 7 + (2 if restart else 0)
        dc = (int.from_bytes(out[at:at + 2], "little", signed=True) + 40) & 0xFFFF
        out[at:at + 2] = dc.to_bytes(2, "little")
    return bytes(out)


def test_an_index_written_over_meanwhile_is_not_used():
    """A record the ring's head has come round to (a writer may be rewriting it)
    is passed over, even where its CRC checks out. The forged records, read
    before the head came round, give other pixels: the head is what keeps
    them out after."""
    files = [jpeg(_noisy(333, 400, s), "4:2:0", 90) for s in range(3)]
    work = SampleWork(Chain(CHAIN, None), files=len(files))
    reference = SampleWork(Chain(CHAIN, None), jpeg_index_bytes=0)
    _epochs(work, files, range(1))
    memo = work.verified
    ring = memo._ring
    for data in files:
        # Each checkpoint's luma DC prediction moved (a valid-looking index
        # that gives other pixels), the record's CRC made to match.
        at = _record_at(memo, data)
        fp, check, _, n = RECORD.unpack_from(ring, at)
        forged = _shifted_dc(bytes(ring[at + RECORD.size:at + RECORD.size + n]))
        RECORD.pack_into(ring, at, fp, check, ext.crc32c(forged), n)
        ring[at + RECORD.size:at + RECORD.size + n] = forged
    want = _epochs(reference, files, range(1, 4))
    trusted = _epochs(work, files, range(1, 4))  # the forged records, whole as far as anyone can tell
    assert any(isinstance(a, str) or not np.array_equal(a, b) for a, b in zip(trusted, want))
    memo._head = memo._head + memo.index_bytes + 1  # the ring came round to them
    _same(_epochs(work, files, range(1, 4)), want)


def _call(memory, data: bytes, out: np.ndarray):
    return ext.fused(data, 1, 0, 0, 0.5, 0.08, 0.92, -0.29, 0.58, 40, 40, True, True,
                     _MAX_HEADER_STEPS, 1 << 30, out, memory)


def test_a_memory_the_call_cannot_read_is_refused():
    data = jpeg(_noisy(210, 170, 3), "4:2:0", 90)
    memo = VerifiedJpegs(files=4)
    memo.add(1, b"x" * 20, 2)
    table, where, ring, head, bits, points, low, per = memo.native
    out = np.zeros((40, 40, 3), np.uint8)
    hostile = [
        (table, where, ring, head, bits),                                      # too short
        (None, where, ring, head, bits, points, low, per),                     # where without a table
        (table, where, ring, bytearray(4), bits, points, low, per),            # head not one word
        (table, where, ring, None, bits, points, low, per),
        (table, where, ring, head, bits + 1, points, low, per),                # bits not the table's
        (table, where, ring, head, 0, points, low, per),
        (table, where, ring, head, 63, points, low, per),
        (bytearray(40), bytearray(40), ring, head, 1, points, low, per),       # slots not 4 << bits
        (table, bytearray(8), ring, head, bits, points, low, per),             # where shorter than table
        (table, where, ring, head, bits, points, low, 0),                      # no bytes per point
        (table, where, ring, head, bits, 1 << 20, low, per),
        (table, where, ring, head, -1, points, low, per),
        (table, where, ring, head, (1 << 32) + bits, points, low, per),        # no wrapping round
        (table, where, ring, head, bits, points, -1, per),
        (table, where, ring, head, bits, points, low, -1),
        (table, where, ring, head, bits, -1, low, per),
        ("table", where, ring, head, bits, points, low, per),
        [table, where, ring, head, bits, points, low, per],                    # not a tuple
    ]
    for memory in hostile:
        with pytest.raises((ValueError, TypeError, OverflowError)):
            _call(memory, data, out)
        assert not out.any()
    assert _call(memo.native, data, out) is not False  # the memory as it is: taken
    assert out.any()


def _writes(memo: VerifiedJpegs, ops_: list) -> None:
    for kind, fp, check, index in ops_:
        if kind == "add":
            memo.add(fp, index, check)
        else:
            memo.keep_index(fp, index, check)


@pytest.mark.parametrize("slots, index_bytes", [(8, 4096), (64, 1 << 16), (1024, 0)])
def test_the_extensions_writer_writes_what_the_python_one_writes(slots, index_bytes):
    """VerifiedJpegs' adds through the extension (memory_put) leave the table,
    the index starts, the ring and its head byte for byte as the Python writer
    does: full buckets, indexes replaced by longer ones, records that do not
    fit, a ring written round several times."""
    rng = np.random.default_rng(slots)
    fps = [int(x) | 1 for x in rng.integers(1, 1 << 62, 40)]  # 40 files for 8-1024 slots
    ops_ = []
    for _ in range(400):
        fp = fps[int(rng.integers(len(fps)))]
        check = fp & 0xFFFF
        n = int(rng.choice([0, 5, 40, 300, 5000, 70000]))
        index = None if n == 0 else bytes(rng.integers(0, 256, n, dtype=np.uint8))
        ops_.append(("add" if rng.random() < 0.6 else "keep", fp, check, index))
    native = VerifiedJpegs(slots=slots, index_bytes=index_bytes, rewritten=True)
    python = _InPython(slots=slots, index_bytes=index_bytes, rewritten=True)
    _writes(native, ops_)
    _writes(python, ops_)
    assert native._head == python._head > (0 if index_bytes else -1)
    assert bytes(native._table) == bytes(python._table)
    if index_bytes:
        assert bytes(native._where) == bytes(python._where)
        assert bytes(native._ring) == bytes(python._ring)
    for fp in fps:
        assert native.seen(fp) == python.seen(fp)
        assert native.index(fp, fp & 0xFFFF) == python.index(fp, fp & 0xFFFF)
    assert len(native) == len(python) > 0


def test_the_extensions_writer_refuses_what_it_cannot_write():
    memo = VerifiedJpegs(files=4)
    with pytest.raises(ValueError, match="no table"):
        ext.memory_put(memo.native, 5, 1, b"x", False)
    memo.add(7, b"abc", 1)
    for args in [(0, 1, b"x", False), (5, 1 << 40, b"x", False), (5, 1, "text", False),
                 (5, 1, b"x", False, 3), ("fp", 1, b"x", False)]:
        with pytest.raises((ValueError, TypeError, OverflowError)):
            ext.memory_put(memo.native, *args)
    table, where, ring, head, *rest = memo.native
    with pytest.raises((TypeError, BufferError)):  # read-only buffers cannot be written
        ext.memory_put((bytes(table), bytes(where), ring, head, *rest), 9, 1, b"x", False)
    assert memo.seen(7) and memo.index(7, 1) == b"abc" and not memo.seen(9)


def test_the_native_memory_never_keeps_a_table_without_its_index_starts(monkeypatch):
    """Another thread reading ``native`` while the first add maps the memory
    (between the table and where each index starts) must not fix a view with
    the table but without the starts: every later read would then miss every
    index."""
    import mmap as _mmap
    import threading

    from feeder.decode import verified as _verified

    memo = VerifiedJpegs(files=4)
    seen = []
    calls = []

    class _Mmap:
        @staticmethod
        def mmap(*args, **kwargs):
            calls.append(args)
            if len(calls) == 2:  # the table is mapped; where is next
                t = threading.Thread(target=lambda: seen.append(memo.native))
                t.start()
                t.join(timeout=10)
            return _mmap.mmap(*args, **kwargs)

    monkeypatch.setattr(_verified, "mmap", _Mmap)
    memo.add(11, b"index", 3)
    assert len(calls) == 2 and seen and seen[0][0] is None  # the table not yet visible to it
    table, where, ring, *_ = memo.native
    assert table is not None and where is not None and ring is not None
    assert memo.index(11, 3) == b"index"


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_forked_child_writes_its_own_copy_of_the_memory():
    """A child forked after the first add (the isolated engine's worker, a
    DataLoader worker over the dataset view) starts a memory of its own, as a
    pickled copy does: it adds files its parent never sees, and leaves the
    parent's ring as it was."""
    import os
    import select
    import signal

    memo = VerifiedJpegs(files=8)
    memo.add(21, b"parent's index", 1)
    ring_before = bytes(memo._ring[:4096])
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: add, report, then leave without running anything of pytest's
        code = 4
        try:
            fresh = not memo.seen(21)
            memo.add(22, b"child's index", 2)
            memo.keep_index(21, b"a longer index of the child's", 1)
            code = 0 if fresh and memo.seen(22) else 3
        finally:
            os.write(writable, bytes([code]))
            os._exit(code)
    os.close(writable)
    try:
        ready, _, _ = select.select([readable], [], [], 60)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        report = os.read(readable, 1) if ready else b""
    finally:
        os.close(readable)
        os.waitpid(pid, 0)  # it has reported (or been killed): it is exiting
    assert report == b"\x00", "the child did not start empty, or hung"
    assert not memo.seen(22) and memo.index(21, 1) == b"parent's index"
    assert bytes(memo._ring[:4096]) == ring_before
