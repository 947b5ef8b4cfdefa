"""Where the verified-JPEG memory is read in Python (``JpegDecoder.decode``),
small JPEGs skip it (``JpegDecoder.SMALL_BYTES``): a file of fewer bytes is
region-decoded as on its first read every time (read to its end with
``jpeg_verify``, no fingerprint, no row index), which must deliver the very
same pixels, and refuse or skip the very same files, as the memory does. (The
fused call reads the memory for every file: tests/decode/test_fused_memory.py.)
Through a Feeder, both paths run: the batches must be the same either way."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import JOIN_TIMEOUT_S, MemorySource, drain
from tests.support.jpeg import jpeg
from feeder import DecodeError, Feeder, ops
from feeder import decode as _decode
from feeder.decode.jpeg import JpegDecoder
from feeder.decode.step import SampleWork
from feeder.ops.chain import Chain
from feeder.synthetic import make_image

ext = _decode._jpeg
needs_ext = pytest.mark.skipif(ext is None, reason=f"region decoder not in use: {_decode._jpeg_missing}")

CHAIN = [ops.RandomResizedCrop(48), ops.RandomHorizontalFlip()]


def _noisy(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = make_image(h, w, seed=seed).astype(np.int16)
    return np.clip(base + rng.integers(-30, 30, base.shape), 0, 255).astype(np.uint8)


def _straddling() -> list[bytes]:
    """JPEGs on both sides of SMALL_BYTES, of every layout the region decoder takes."""
    kinds = ["4:2:0", "4:4:4", "gray", "restart", "4:2:2", "progressive"]
    blobs = [jpeg(_noisy(40 + 23 * k, 56 + 17 * k, k), kinds[k % len(kinds)], 92) for k in range(18)]
    sizes = sorted(map(len, blobs))
    assert sizes[3] < JpegDecoder.SMALL_BYTES < sizes[-4], sizes  # several on each side
    return blobs


def _batches(blobs: list[bytes], epochs: int, **options) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    with Feeder(MemorySource(blobs), 4, CHAIN, shuffle=True, seed=3, decode_threads=2,
                timeout=JOIN_TIMEOUT_S, **options) as feeder:
        for epoch in range(epochs):
            feeder.set_epoch(epoch)
            batches, error = drain(feeder)
            assert error is None
            out += batches
    return out


def _same(got: list, expected: list) -> None:
    assert len(got) == len(expected) > 0
    for (images, labels), (images_0, labels_0) in zip(got, expected):
        np.testing.assert_array_equal(labels, labels_0)
        np.testing.assert_array_equal(images, images_0)


@needs_ext
@pytest.mark.parametrize("verify", [True, False])
def test_the_same_batches_with_and_without_the_threshold(monkeypatch, verify):
    """Every epoch (first reads, then indexed ones above the threshold), both sides of it."""
    blobs = _straddling()
    with_threshold = _batches(blobs, 3, jpeg_verify=verify)
    monkeypatch.setattr(JpegDecoder, "SMALL_BYTES", 0)  # every file through the memory
    through_memory = _batches(blobs, 3, jpeg_verify=verify)
    _same(with_threshold, through_memory)


@needs_ext
def test_the_process_engine_gives_the_same_batches(monkeypatch):
    """Its worker builds its own decoder (the default threshold): the batches are
    those of every file through the memory."""
    blobs = _straddling()
    isolated = _batches(blobs, 2, isolation="process")
    monkeypatch.setattr(JpegDecoder, "SMALL_BYTES", 0)
    _same(isolated, _batches(blobs, 2))


class _Recorder:
    """The extension, with each decode's verify flag and whether it had an index."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool]] = []

    def __getattr__(self, name):
        return getattr(ext, name)

    def decode(self, *args, **kwargs):
        self.calls.append((bool(args[9]), kwargs.get("index") is not None))
        return ext.decode(*args, **kwargs)


@needs_ext
@pytest.mark.parametrize("verify", [True, False])
def test_below_the_threshold_no_memory_is_kept(monkeypatch, verify):
    rec = _Recorder()
    monkeypatch.setattr(_decode.extension, "jpeg", rec)
    work = SampleWork(Chain(CHAIN, None), jpeg_verify=verify)
    blobs = sorted(_straddling(), key=len)
    small, large = blobs[0], blobs[-1]
    assert len(small) < work.jpeg.small_bytes <= len(large)
    for data in (small, small, large, large):
        img, _ = work.decode(data, 1)
        work.discard(img)
    # The small file: read to its end every time (verify) or never, no index;
    # the large one through the memory: read to its end once, then indexed.
    assert rec.calls == [(verify, False), (verify, False), (verify, False), (False, True)]
    assert len(work.verified) == 1


def _damaged(good: bytes, box_key: int) -> bytes:
    """``good`` with one bit flipped where stopping after the crop of ``box_key``
    decodes without an error and reading on to the end is one."""
    probe = SampleWork(Chain(CHAIN, None), jpeg_verify=False)
    strict = SampleWork(Chain(CHAIN, None))
    probe.jpeg.small_bytes = strict.jpeg.small_bytes = 0
    sos = good.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(good[sos + 2:sos + 4], "big")
    for at in range(len(good) - 3, start, -1):
        bad = good[:at] + bytes([good[at] ^ 0x10]) + good[at + 1:]
        try:
            probe.discard(probe.decode(bad, box_key)[0])
        except DecodeError:
            continue
        try:
            strict.decode(bad, box_key)
        except DecodeError:
            return bad
    raise AssertionError("no single-bit flip of the kind the test needs")


def _outcomes(data: list[bytes], small_bytes: int, verify: bool, keys: list[int]) -> list:
    """The pixels or the error of each decode + transform, in turn, on one SampleWork."""
    work = SampleWork(Chain(CHAIN, None), jpeg_verify=verify)
    work.jpeg.small_bytes = small_bytes
    out = np.empty((48, 48, 3), np.uint8)
    got = []
    for blob, key in zip(data, keys):
        try:
            img, ctx = work.decode(blob, key)
        except DecodeError as exc:
            got.append(str(exc))
            continue
        work.transform(img, key, ctx, out)
        got.append(out.copy())
    return got


@needs_ext
@pytest.mark.parametrize("verify", [True, False])
def test_a_damaged_small_file_is_refused_or_delivered_as_before(verify):
    """jpeg_verify keeps its meaning below the threshold: damage below the crop
    fails every read with it (the same error), and goes unread without it."""
    good = jpeg(_noisy(64, 80, 1), "4:2:0", 90)
    assert len(good) < JpegDecoder.SMALL_BYTES
    bad = _damaged(good, 0)
    seq, keys = [good, bad, good, bad, bad], [0, 0, 1, 0, 0]
    now = _outcomes(seq, JpegDecoder.SMALL_BYTES, verify, keys)
    before = _outcomes(seq, 0, verify, keys)
    for a, b in zip(now, before):
        assert type(a) is type(b)
        if isinstance(a, str):
            assert a == b
        else:
            np.testing.assert_array_equal(a, b)
    refused = [isinstance(x, str) for x in now]
    assert refused == ([False, True, False, True, True] if verify else [False] * 5)


@needs_ext
@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_damaged_small_file_is_skipped_every_epoch(isolation):
    good = jpeg(_noisy(64, 80, 1), "4:2:0", 90)
    blobs = [good, _damaged(good, 0), jpeg(_noisy(72, 64, 2), "4:4:4", 90)]
    assert max(map(len, blobs)) < JpegDecoder.SMALL_BYTES
    with Feeder(MemorySource(blobs), 3, CHAIN, on_error="skip", shuffle=False, isolation=isolation,
                timeout=JOIN_TIMEOUT_S) as f:
        labels = []
        for _ in range(3):
            batches, error = drain(f)
            assert error is None
            labels.append(sorted(int(x) for _, y in batches for x in y))
    assert labels == [[0, 2]] * 3
