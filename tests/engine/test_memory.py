"""The memory a feeder reports (``stats().memory``) against what the process holds:
the terms of ``docs/design/memory.md``'s formula, checked where they can be
measured on CPU (the JPEG table and index ring are mappings of their own, whose
resident pages the kernel reports in ``/proc/self/smaps``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import MemorySource, drain
from tests.support.measure import resident_bytes
from feeder.decode.jpeg import JpegDecoder
from feeder import Feeder, MemoryStats, ops
from feeder.engine.batch import BufferPool, Scratch
from feeder import decode as D
from feeder.decode import DecodeBuffers
from feeder.decode.verified import VerifiedJpegs
from feeder.testing import engine_of, pool_of, work_of

PAGE = 4096
needs_ext = pytest.mark.skipif(D._jpeg is None, reason=f"region decoder not in use: {D._jpeg_missing}")


def resident(view) -> int:
    """Resident bytes of the mapping holding ``view`` (there must be one)."""
    n = resident_bytes(view)
    assert n is not None, "no mapping of this process holds the buffer"
    return n


def pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def test_the_table_is_sized_from_the_source_length():
    assert VerifiedJpegs.slots_for(None) == VerifiedJpegs.SLOTS
    assert VerifiedJpegs.slots_for(0) == VerifiedJpegs.MIN_SLOTS
    assert VerifiedJpegs.slots_for(2000) == 4096  # at most half full
    assert VerifiedJpegs.slots_for(2048) == 4096
    assert VerifiedJpegs.slots_for(2049) == 8192
    assert VerifiedJpegs.slots_for(1_281_167) == VerifiedJpegs.SLOTS  # ImageNet: the most
    assert VerifiedJpegs.slots_for(10**9) == VerifiedJpegs.SLOTS
    assert VerifiedJpegs(files=2000).slots == 4096
    assert VerifiedJpegs(slots=64, files=2000).slots == 64  # an explicit size stays
    with pytest.raises(ValueError, match="slots"):
        VerifiedJpegs(slots=100)


def test_a_sized_table_keeps_every_file_of_its_source():
    # Twice as many slots as files: none is pushed out, so none is read to its
    # end twice (the default table's promise, kept at a fraction of its memory).
    files = 5000
    mem = VerifiedJpegs(files=files, index_bytes=0)
    rng = np.random.default_rng(0)
    fps = [int(x) | 1 for x in rng.integers(1, 2**63, files, dtype=np.int64)]
    for fp in fps:
        mem.add(fp)
    assert len(mem) == files
    assert all(mem.seen(fp) for fp in fps)


def test_table_and_index_sizes_are_what_the_kernel_holds():
    mem = VerifiedJpegs(files=300, index_bytes=1 << 20)
    assert mem.table_bytes() == 0 and mem.indexes_bytes() == 0  # nothing mapped before the first add
    assert resident(mem._ring) == 0  # reserved, not resident
    rng = np.random.default_rng(1)
    for i in range(300):
        mem.add(int(rng.integers(1, 2**62)) | 1, bytes(200 + i % 50), check=i)
    assert mem.table_bytes() == 2 * mem.slots * 8
    # Every slot page is written at 300 files in 1024 slots: the reported size is resident.
    assert resident(mem._table) == pages(mem.slots * 8)
    assert resident(mem._where) == pages(mem.slots * 8)
    written = mem.indexes_bytes()
    assert 300 * 200 < written < 300 * 300
    assert resident(mem._ring) == pages(written)


def test_buffer_pools_count_the_bytes_they_made():
    pool = BufferPool(4, 8, 16, 24, pin=False)
    assert pool.nbytes() == 0
    buf = pool.try_acquire(object())
    assert buf is not None
    assert pool.nbytes() == 8 * 16 * 24 * 3 + 8 * 8 + 8 * 8
    buf.masks()
    assert pool.nbytes() == 8 * 16 * 24 * 3 + 8 * 8 + 8 * 8 + 8 * 16 * 24
    scratch = Scratch(16, 24)
    a, b = scratch.take(), scratch.take()
    scratch.give(a)
    assert scratch.nbytes() == 2 * 16 * 24 * 3
    del a, b
    scratch.close()
    assert scratch.nbytes() == 0  # spares freed, and the one in use was dropped
    dec = DecodeBuffers()
    x = dec.take(1000)
    assert dec.nbytes() == x.nbytes >= 1000
    dec.give(np.empty(5000, np.uint8))  # not the pool's: neither kept nor counted
    assert dec.nbytes() == x.nbytes


@needs_ext
def test_stats_memory_matches_the_formula_terms(jpeg_blobs):
    batch, side = 8, 32
    source = MemorySource(jpeg_blobs)
    with Feeder(source, batch, [ops.RandomResizedCrop(side), ops.RandomHorizontalFlip()], seed=0,
                decode_threads=2) as f:
        batches, err = drain(f)
        assert err is None and len(batches) == -(-len(jpeg_blobs) // batch)
        mem = f.stats().memory
        engine = engine_of(f)
        verified = engine.work.verified
        buffers = engine.pool.allocated
    assert isinstance(mem, MemoryStats)
    # Batch buffers: images, labels and indices per buffer, as the page says.
    assert buffers >= 2
    assert mem.batch_buffers == buffers * (batch * side * side * 3 + 2 * 8 * batch)
    # Scratch: whole one-sample arrays. Decode buffers: at most one per decode
    # thread, each at most 1.25 x the largest image; none at all where every
    # sample took the fused decode, which writes into the batch or a scratch
    # array (test_stats_memory_counts_decode_buffers sees them used).
    assert mem.scratch % (side * side * 3) == 0
    assert 0 <= mem.decode_buffers <= 2 * (120 * 150 * 3 * 5 // 4)
    # The table, sized from the source's 60 files (two tables, one page each) and
    # the indexes written, both what the kernel holds resident.
    assert verified.slots == 128
    assert mem.jpeg_table == 2 * 128 * 8
    assert resident(verified._table) == pages(128 * 8)
    assert 0 < mem.jpeg_indexes < 60 * 4096
    assert resident(verified._ring) == pages(mem.jpeg_indexes)
    assert mem.total == (mem.batch_buffers + mem.scratch + mem.decode_buffers + mem.jpeg_table
                         + mem.jpeg_indexes)
    assert "JPEG table" in str(f.stats())


def test_stats_memory_counts_decode_buffers(jpeg_blobs):
    """A chain the fused decode does not take (bicubic) decodes each image into
    a decode buffer and runs the transforms on it: one per decode thread, each
    at most 1.25 x the largest image, counted in stats().memory."""
    with Feeder(MemorySource(jpeg_blobs), 8, [ops.RandomResizedCrop(32, interpolation="bicubic")],
                seed=0, decode_threads=2) as f:
        batches, err = drain(f)
        assert err is None and len(batches) == -(-len(jpeg_blobs) // 8)
        mem = f.stats().memory
    assert 0 < mem.decode_buffers <= 2 * (120 * 150 * 3 * 5 // 4)


def test_stats_memory_counts_mask_planes():
    from tests.support import collect, encode_jpeg, encode_png
    from feeder.synthetic import make_segmentation_sample

    samples = []
    for i in range(12):
        img, mask = make_segmentation_sample(40, 48, seed=i)
        samples.append({"image": encode_jpeg(img), "mask": encode_png(mask)})

    class Dicts:
        def __len__(self):
            return len(samples)

        def read(self, index):
            return dict(samples[index])

    with Feeder(Dicts(), 4, [ops.RandomCrop(32)], seed=0) as f:
        got, err = collect(f, keep=lambda b: None)
        assert err is None and len(got) == 3
        mem = f.stats().memory
        buffers = pool_of(f).allocated
    assert mem.batch_buffers == buffers * (4 * 32 * 32 * 3 + 2 * 8 * 4 + 4 * 32 * 32)


def test_the_isolated_engine_reports_its_worker_memory(jpeg_blobs):
    source = MemorySource(jpeg_blobs[:16])
    # A bicubic crop, which the fused decode never takes: the worker then holds
    # decode buffers, whose bytes only its own report can give.
    with Feeder(source, 4, [ops.RandomResizedCrop(32, interpolation="bicubic")], seed=0,
                isolation="process") as f:
        batches, err = drain(f)
        assert err is None and len(batches) == 4
        mem = f.stats().memory
    assert mem.batch_buffers >= 2 * (4 * 32 * 32 * 3)
    assert mem.decode_buffers > 0


@needs_ext
def test_the_dataset_view_shares_the_engines_table(jpeg_blobs, monkeypatch):
    # The blobs are small: below JpegDecoder.SMALL_BYTES they would skip the table.
    monkeypatch.setattr(JpegDecoder, "SMALL_BYTES", 0)
    source = MemorySource(jpeg_blobs[:12])
    with Feeder(source, 4, [ops.RandomResizedCrop(32)], seed=0) as f:
        view = f.dataset
        assert work_of(view).verified is work_of(f).verified
        image, label = view[3]
        assert tuple(image.shape) == (3, 32, 32) and label == 3
        assert f.stats().memory.jpeg_table > 0  # the view's read filled the shared table
    with Feeder(source, 4, [ops.RandomResizedCrop(32)], seed=0, isolation="process") as f:
        assert work_of(f.dataset).verified is not None  # its own: the engine's is in the worker
