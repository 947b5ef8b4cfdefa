"""Invariants, checked by content hash: exactly-once across thread
counts, queue sizes and both ``ordered`` modes; no leaks over 200 build /
partial epoch / close cycles; and a soak run of 20 epochs with randomly
injected faults (deterministic seed) under ``on_error="skip"`` with exact
accounting and stable memory.

``FEEDER_SOAK_LONG=1`` makes the soak 200 epochs over 5000 images and the leak
test 2000 cycles, for manual runs.
"""

from __future__ import annotations

import gc
import hashlib
import os
import threading

import numpy as np
import pytest
import simplejpeg

import feeder.engine.engine as feeder_mod
from tests.support import JOIN_TIMEOUT_S, MemorySource, drain, feeder_threads
from tests.support.faults import (SIDE, assert_exactly_once, batch_sizes, delivered_hashes, distinct_jpegs,
                            expected_sizes, jpeg_with_size, pixel_hash, reference_hash, rss_mb,
                            wait_no_feeder_threads)
from feeder import Feeder, ops
from feeder.engine.threads import LibraryThreads

LONG = os.environ.get("FEEDER_SOAK_LONG") == "1"


# -- exactly-once across thread counts, queue sizes and ordered modes -------------------------------

@pytest.fixture(scope="module")
def matrix_data():
    blobs = distinct_jpegs(45, seed=1200)
    hashes = [reference_hash(b) for b in blobs]
    bad = {3, 22, 23, 44}  # the last sample too: a hole in the final, partial batch
    broken = [b"corrupt" if i in bad else blob for i, blob in enumerate(blobs)]
    return blobs, broken, hashes, bad


@pytest.mark.parametrize("faults", [False, True], ids=["clean", "with-skips"])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("queue_size", [1, 4])
@pytest.mark.parametrize("threads", [(1, 1), (2, 3), (4, 2), (3, 0)], ids=["1x1", "2x3", "4x2", "3x0"])
def test_exactly_once_by_content(matrix_data, threads, queue_size, ordered, faults):
    blobs, broken, hashes, bad = matrix_data
    data = broken if faults else blobs
    # Every label is 0: only the pixels can tell the samples apart.
    src = MemorySource(data, labels=[0] * len(data))
    expect = [h for i, h in enumerate(hashes) if not (faults and i in bad)]
    with Feeder(src, 8, [ops.CenterCrop(SIDE)], shuffle=True, seed=4, decode_threads=threads[0],
                augment_threads=threads[1], queue_size=queue_size, ordered=ordered,
                on_error="skip") as f:
        per_epoch = []
        for epoch in range(2):
            batches, err = drain(f, timeout=30)
            assert err is None
            assert batch_sizes(batches) == expected_sizes(len(expect), 8, False)
            got = delivered_hashes(batches)
            assert_exactly_once(got, expect)
            per_epoch.append(got)
        assert f.stats().skipped == (2 * len(bad) if faults else 0)
    assert per_epoch[0] != per_epoch[1]  # shuffled afresh each epoch


def test_ordered_output_is_identical_across_configurations(matrix_data):
    """ordered=True with skips: the exact batch contents depend only on seed and epoch."""
    _, broken, _, _ = matrix_data
    runs = []
    for dt, at, q in [(1, 1, 1), (4, 2, 3), (2, 4, 1)]:
        with Feeder(MemorySource(broken), 8, [ops.CenterCrop(SIDE)], shuffle=True, seed=9, decode_threads=dt,
                    augment_threads=at, queue_size=q, on_error="skip") as f:
            f.set_epoch(5)
            batches, err = drain(f, timeout=30)
        assert err is None
        runs.append([delivered_hashes([b]) for b in batches])
    assert runs[0] == runs[1] == runs[2]


# -- no leaks -------------------------------------------------------------------------------------

LEAK_CYCLES = 2000 if LONG else 200
LEAK_BOUND_MB = 50  # RSS growth allowed over all cycles (after warm-up)


def _one_cycle(src, broken, i: int) -> None:
    """Build a feeder, take part of an epoch, and end it in one of five ways."""
    kw = dict(seed=i, decode_threads=1 + i % 3, augment_threads=i % 3, queue_size=1 + i % 3,
              ordered=bool(i % 2))
    way = i % 5
    if way == 0:  # close() after a partial epoch
        f = Feeder(src, 4, [ops.CenterCrop(SIDE)], **kw)
        it = iter(f)
        next(it)
        f.close()
    elif way == 1:  # context manager, break out of the loop
        with Feeder(src, 4, [ops.CenterCrop(SIDE)], **kw) as f:
            for k, _ in enumerate(f):
                if k == 1:
                    break
    elif way == 2:  # the training loop raises inside the with-block
        try:
            with Feeder(src, 4, [ops.CenterCrop(SIDE)], **kw) as f:
                for _ in f:
                    raise KeyError("boom")
        except KeyError:
            pass
    elif way == 3:  # never closed: dropped and collected
        f = Feeder(src, 4, [ops.CenterCrop(SIDE)], **kw)
        it = iter(f)
        next(it)
        del f, it
    else:  # a pass that fails on a bad sample, then close()
        f = Feeder(broken, 4, [ops.CenterCrop(SIDE)], on_error="raise", shuffle=False, **kw)
        try:
            for _ in f:
                pass
        except Exception:  # noqa: BLE001 - the SampleError of the corrupt sample
            pass
        f.close()


def _threads_but_the_reaper() -> int:
    """Live threads, leaving out the one process-wide reaper (started with the first feeder)."""
    return sum(1 for t in threading.enumerate() if t.name != "feeder-reaper")


def test_build_partial_epoch_close_cycles_leak_nothing():
    blobs = distinct_jpegs(24, seed=1500)
    src = MemorySource(blobs)
    broken = MemorySource(blobs[:9] + [b"\xff\xd8\xff broken"] + blobs[10:])
    threads_before = _threads_but_the_reaper()
    engines_before = len(feeder_mod._live_engines)
    for i in range(25):  # warm-up: allocator pools, thread stacks, lazy imports
        _one_cycle(src, broken, i)
    gc.collect()
    assert wait_no_feeder_threads(3.0) == []
    base = rss_mb()
    peak = base
    for i in range(25, 25 + LEAK_CYCLES):
        _one_cycle(src, broken, i)
        if i % 25 == 0:
            gc.collect()
            peak = max(peak, rss_mb())
    gc.collect()
    assert wait_no_feeder_threads(3.0) == []
    growth = max(peak, rss_mb()) - base
    print(f"leak: {LEAK_CYCLES} cycles, RSS {base:.0f} MB -> peak {peak:.0f} MB (growth {growth:.1f} MB)")
    assert growth < LEAK_BOUND_MB, f"RSS grew {growth:.1f} MB over {LEAK_CYCLES} cycles"
    assert _threads_but_the_reaper() <= threads_before
    assert len(feeder_mod._live_engines) <= engines_before  # every engine object was freed
    assert LibraryThreads._users == 0  # OpenCV's thread setting was handed back


def test_many_abandoned_passes_keep_the_buffer_pool_bounded():
    src = MemorySource(distinct_jpegs(40, seed=1600))
    with Feeder(src, 4, [ops.CenterCrop(SIDE)], seed=1, queue_size=2, decode_threads=3) as f:
        for k in range(60):
            it = iter(f)
            for _ in range(k % 4 + 1):
                next(it)
        drain(f, timeout=30)
        assert f.stats().buffers <= f.num_buffers


# -- soak: many epochs, injected faults, exact accounting ------------------------------------------

SOAK_IMAGES = 5000 if LONG else 1000
SOAK_EPOCHS = 200 if LONG else 20
SOAK_SEED = 20240604
SOAK_BATCH = 32
SOAK_MEMORY_BOUND_MB = 40  # RSS growth allowed between the end of epoch 2 and the end of the run


def _unit(*parts) -> float:
    """A deterministic number in [0, 1) from ``parts``."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _noise_jpegs(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        img = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
        out.append(simplejpeg.encode_jpeg(img, quality=85, colorspace="RGB"))
    return out


class FaultySource(MemorySource):
    """Permanent corruption on some samples; transient read errors on (epoch, index) pairs."""

    def __init__(self, blobs, read_rate):
        super().__init__(blobs, labels=[0] * len(blobs), names=[f"soak/{i:05d}.jpg" for i in range(len(blobs))])
        self.epoch = 0
        self.read_rate = read_rate

    def read_fails(self, epoch, index) -> bool:
        return _unit("read", SOAK_SEED, epoch, index) < self.read_rate

    def read(self, index):
        if self.read_fails(self.epoch, index):
            raise OSError(5, "injected I/O error", self.names[index])
        return super().read(index)


class FaultyTransform:
    """Raises, or returns a wrong dtype, for some (epoch, sample content) pairs."""

    def __init__(self, rate):
        self.epoch = 0
        self.rate = rate

    def verdict(self, epoch, h) -> str:
        u = _unit("transform", SOAK_SEED, epoch, h)
        if u < self.rate:
            return "raise"
        if u < 2 * self.rate:
            return "dtype"
        return "ok"

    def __call__(self, img, rng):
        v = self.verdict(self.epoch, pixel_hash(img))
        if v == "raise":
            raise ValueError("injected transform failure")
        if v == "dtype":
            return img.astype(np.float32)  # the writer: a TransformError when stored
        return img


def test_soak_with_injected_faults():
    blobs = _noise_jpegs(SOAK_IMAGES, SOAK_SEED)
    hashes = [reference_hash(b) for b in blobs]
    assert len(set(hashes)) == SOAK_IMAGES
    rng = np.random.default_rng(SOAK_SEED)
    corrupt = set(rng.choice(SOAK_IMAGES, SOAK_IMAGES // 100, replace=False).tolist())
    kinds = [lambda b: b[:len(b) // 2], lambda b: b"", lambda b: b"text, not an image" * 9,
             lambda b: rng.integers(0, 256, len(b), dtype=np.uint8).tobytes(),
             lambda b: jpeg_with_size(b, 60000, 60000)]
    for k, i in enumerate(sorted(corrupt)):
        blobs[i] = kinds[k % len(kinds)](blobs[i])
    source = FaultySource(blobs, read_rate=0.005)
    transform = FaultyTransform(rate=0.003)
    names = source.names
    total_skipped = 0
    injected = {"read": 0, "raise": 0, "dtype": 0}
    with Feeder(source, SOAK_BATCH, [ops.CenterCrop(SIDE), transform], seed=SOAK_SEED, on_error="skip",
                ordered=False, decode_threads=3, augment_threads=2, queue_size=2) as f:
        rss_after_warmup = None
        rss_peak = 0.0
        seen_skips = 0
        for epoch in range(SOAK_EPOCHS):
            source.epoch = transform.epoch = epoch  # the previous pass has ended: drain() saw its end
            expect_skip = {i for i in range(SOAK_IMAGES)
                           if i in corrupt or source.read_fails(epoch, i)
                           or transform.verdict(epoch, hashes[i]) != "ok"}
            batches, err = drain(f, timeout=60)
            assert err is None, f"epoch {epoch}: {err!r}"
            got = delivered_hashes(batches)
            skipped_now = list(f.stats().skipped_paths[seen_skips:])
            seen_skips += len(skipped_now)
            # Exact accounting: delivered + skipped == total, each sample in exactly one of them.
            assert len(got) + len(skipped_now) == SOAK_IMAGES, epoch
            assert sorted(skipped_now) == sorted(names[i] for i in expect_skip), epoch
            assert_exactly_once(got, [h for i, h in enumerate(hashes) if i not in expect_skip])
            assert batch_sizes(batches) == expected_sizes(SOAK_IMAGES - len(expect_skip), SOAK_BATCH, False)
            total_skipped += len(expect_skip)
            for i in range(SOAK_IMAGES):
                if i not in corrupt:
                    if source.read_fails(epoch, i):
                        injected["read"] += 1
                    else:
                        v = transform.verdict(epoch, hashes[i])
                        if v != "ok":
                            injected[v] += 1
            gc.collect()
            if epoch == 2:
                rss_after_warmup = rss_mb()
            elif epoch > 2:
                rss_peak = max(rss_peak, rss_mb())
        s = f.stats()
        assert s.skipped == total_skipped
        assert s.samples == SOAK_EPOCHS * SOAK_IMAGES - total_skipped
        assert s.buffers <= f.num_buffers
    assert all(n > 0 for n in injected.values()), injected  # every kind of fault was exercised
    growth = rss_peak - rss_after_warmup
    print(f"soak: {SOAK_EPOCHS} epochs x {SOAK_IMAGES} images, {total_skipped} skipped "
          f"({len(corrupt)} corrupt files per epoch, injected {injected}), RSS growth {growth:.1f} MB")
    assert growth < SOAK_MEMORY_BOUND_MB, f"RSS grew {growth:.1f} MB over {SOAK_EPOCHS} epochs"
    assert not feeder_threads() or wait_no_feeder_threads(2.0) == []


def test_closed_feeders_leave_no_pass_or_decode_memory_behind():
    """A pass holds its threads; the registry of stage threads must not hold the
    pass through them (it kept every pass, its decode buffers and its table of
    verified JPEGs, for the life of the process)."""
    import weakref

    from feeder.engine import reaper
    from feeder.engine.pipeline import Pass
    from feeder.engine.steps import SampleWork

    def live() -> list:
        gc.collect()
        kinds = (Pass, SampleWork)  # by exact type: isinstance would ask odd objects their __class__
        return [o for o in gc.get_objects() if type(o) in kinds]

    def reaper_done() -> None:
        # The reaper runs its calls in order: once this one has run, so has every
        # clean-up queued before it (a dropped feeder's, say), references dropped.
        for _ in range(2):  # a clean-up may queue another
            gc.collect()
            done = threading.Event()
            reaper.ensure_running()
            reaper.defer(done.set)
            assert done.wait(JOIN_TIMEOUT_S)

    blobs = distinct_jpegs(24, seed=1700)
    src = MemorySource(blobs)
    broken = MemorySource(blobs[:9] + [b"\xff\xd8\xff broken"] + blobs[10:])
    reaper_done()
    assert wait_no_feeder_threads(3.0) == []
    before = weakref.WeakSet(live())  # other tests' objects, if any are still held
    for i in range(10):  # every way of ending a pass, twice
        _one_cycle(src, broken, i)
    reaper_done()
    assert wait_no_feeder_threads(3.0) == []
    left = [type(o).__name__ for o in live() if o not in before]
    assert left == []
