"""End-to-end behaviour of Feeder: options, exactly-once, determinism, epochs,
errors, skipping, shutdown and stats."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, REPO_DIR, MemorySource, drain, feeder_threads, labels_of, run_in_thread
from tests.support.faults import Gate, consume_in_thread, feeder_factory
from feeder import Feeder, FeederError, FileList, ImageFolder, SampleError, Stats, TransformError, ops
from feeder.testing import current_pass_of, engine_of, free_buffers_of, pass_of, pool_of

AUG = [ops.RandomResizedCrop(32), ops.RandomHorizontalFlip()]


make = feeder_factory(batch_size=8, transforms=AUG, seed=7, shuffle=True)


# -- shapes and basic contract ---------------------------------------------------

def test_batches_shape_dtype_layout(source):
    with make(source, batch_size=8, drop_last=True) as f:
        batches, err = drain(f)
        assert err is None
        assert len(batches) == len(f) == 60 // 8
        for x, y in batches:
            assert x.shape == (8, 3, 32, 32) and x.dtype == np.uint8
            assert y.shape == (8,) and y.dtype == np.int64
        x, y = next(iter(f))
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert x.device.type == "cpu" and y.dtype == torch.int64


def test_len_and_partial_last_batch(source):
    with make(source, batch_size=16, drop_last=False) as f:
        assert len(f) == 4
        batches, err = drain(f)
        assert err is None
        assert [len(y) for _, y in batches] == [16, 16, 16, 12]
    with make(source, batch_size=16, drop_last=True) as f:
        assert len(f) == 3
        assert [len(y) for _, y in drain(f)[0]] == [16, 16, 16]


def test_batch_larger_than_dataset(source):
    with make(source, batch_size=100, drop_last=False) as f:
        assert len(f) == 1
        batches, err = drain(f)
        assert err is None and len(batches) == 1 and len(batches[0][1]) == 60
    with pytest.raises(ValueError, match=r"len\(source\)=60.*60 samples.*batch_size=100.*"
                                         r"drop_last=True.*batch_size <= 60"):
        make(source, batch_size=100, drop_last=True)


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_rank_without_samples_is_refused_on_every_rank(source, drop_last):
    for rank in (0, 60):  # 60 samples, 61 ranks: the last gets none; every rank says so
        with pytest.raises(ValueError, match=r"world_size=61.*0 samples.*fewer ranks"):
            make(source, batch_size=1, rank=rank, world_size=61, drop_last=drop_last)


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("threads", [(1, 1), (3, 2), (6, 4), (1, 0), (4, 0)])
def test_exactly_once_per_epoch(source, ordered, threads):
    with make(source, batch_size=7, drop_last=False, ordered=ordered,
              decode_threads=threads[0], augment_threads=threads[1], queue_size=2) as f:
        for _ in range(2):
            batches, err = drain(f)
            assert err is None
            assert sorted(labels_of(batches)) == list(range(60))


def test_identical_across_threads_and_queue_sizes(source):
    results = []
    for dt, at, q in [(1, 1, 1), (4, 3, 2), (8, 2, 6), (1, 0, 1), (5, 0, 3)]:
        with make(source, batch_size=8, decode_threads=dt, augment_threads=at, queue_size=q) as f:
            f.set_epoch(3)
            batches, err = drain(f)
            assert err is None
            results.append(batches)
    ref = results[0]
    for other in results[1:]:
        assert len(other) == len(ref)
        for (xa, ya), (xb, yb) in zip(ref, other):
            np.testing.assert_array_equal(ya, yb)
            np.testing.assert_array_equal(xa, xb)


def test_unordered_same_samples_same_pixels(source):
    def by_label(batches):
        return {int(l): x[i].tobytes() for x, y in batches for i, l in enumerate(y)}
    with make(source, batch_size=8, ordered=True, drop_last=False) as f:
        f.set_epoch(1)
        a = by_label(drain(f)[0])
    with make(source, batch_size=8, ordered=False, decode_threads=5, drop_last=False) as f:
        f.set_epoch(1)
        b = by_label(drain(f)[0])
    assert a == b  # per-sample randomness does not depend on completion order


def test_epochs_differ_and_set_epoch_is_reproducible(source):
    with make(source, batch_size=60) as f:
        f.set_epoch(0)
        e0 = labels_of(drain(f)[0])
        e1 = labels_of(drain(f)[0])  # no set_epoch: the next epoch (1)
        f.set_epoch(0)
        again = labels_of(drain(f)[0])
        f.set_epoch(1)
        e1_again = labels_of(drain(f)[0])
    assert e0 != e1
    assert e0 == again and e1 == e1_again


def test_no_set_epoch_new_order_every_pass(source):
    with make(source, batch_size=60) as f:
        orders = [tuple(labels_of(drain(f)[0])) for _ in range(3)]
    assert len(set(orders)) == 3


def test_seed_changes_order_and_default_seed_follows_torch(source):
    with make(source, batch_size=60, seed=1) as a, make(source, batch_size=60, seed=2) as b:
        assert labels_of(drain(a)[0]) != labels_of(drain(b)[0])
    torch.manual_seed(123)
    s1 = Feeder(source, 4, AUG).seed
    torch.manual_seed(123)
    s2 = Feeder(source, 4, AUG).seed
    assert s1 == s2


def test_shuffle_false_is_sequential(source):
    with make(source, batch_size=10, shuffle=False) as f:
        assert labels_of(drain(f)[0]) == list(range(60))


def test_rank_shards_disjoint_equal_and_covering(source):
    world = 4
    shards = []
    for rank in range(world):
        with make(source, batch_size=5, rank=rank, world_size=world, shuffle=True) as f:
            f.set_epoch(2)
            assert len(f) == 3
            shards.append(labels_of(drain(f)[0]))
    assert all(len(s) == 15 for s in shards)
    flat = [x for s in shards for x in s]
    assert sorted(flat) == list(range(60))  # 60 divisible by 4: disjoint and covering


def _shards(blobs, world, **options):
    """Each rank's delivered source indices and its len(), for ranks given by hand."""
    shards, lengths = [], []
    for rank in range(world):
        with make(MemorySource(blobs), rank=rank, world_size=world, **options) as f:
            indices, batches = [], 0
            for x, y in drain_infos(f):
                indices += y
                batches += 1
            assert batches == len(f)  # len() is this rank's own batch count
            assert f.num_samples == f.shard_sizes()[rank]
            batch_size = f.config.batch_size
            delivered = len(f) * batch_size if f.config.drop_last else f.num_samples
            assert len(indices) == delivered
            shards.append(indices)
            lengths.append(len(f))
    return shards, lengths


def drain_infos(f):
    """One pass's (batch number, source indices from ``last_batch``) pairs."""
    out = run_in_thread(lambda: [(f.last_batch.number, f.last_batch.indices.tolist(), labels.tolist())
                                 for _, labels in f])
    assert all(indices == labels for _, indices, labels in out)  # labels are the indices here
    return [(number, indices) for number, indices, _ in out]


@pytest.mark.parametrize("world", [2, 3, 7])
@pytest.mark.parametrize("shuffle", [True, False])
def test_rank_shards_without_drop_last_cover_every_sample_once(jpeg_blobs, world, shuffle):
    blobs = [jpeg_blobs[i % len(jpeg_blobs)] for i in range(109)]
    shards, lengths = _shards(blobs, world, batch_size=8, shuffle=shuffle, drop_last=False)
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(109))  # every sample once, none twice
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert lengths == [-(-n // 8) for n in sizes]


@pytest.mark.parametrize("world", [2, 3, 7])
def test_rank_shards_with_drop_last_are_equal(jpeg_blobs, world):
    blobs = [jpeg_blobs[i % len(jpeg_blobs)] for i in range(109)]
    shards, lengths = _shards(blobs, world, batch_size=5, shuffle=True, drop_last=True)
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat))
    assert {len(s) for s in shards} == {109 // world // 5 * 5}
    assert set(lengths) == {109 // world // 5}  # the same step count on every rank


def test_early_break_then_reiterate_has_no_stale_batches(source):
    with make(source, batch_size=6, shuffle=False, queue_size=3) as f:
        it = iter(f)
        next(it)
        next(it)  # pipeline is now full of this pass's batches
        batches, err = drain(f)  # a fresh pass
        assert err is None
        assert labels_of(batches) == list(range(60))
        # The abandoned pass is over, and its iterator says why instead of ending quietly.
        with pytest.raises(FeederError, match="new pass of the same feeder"):
            next(it)


def test_image_folder_end_to_end(image_folder):
    src = ImageFolder(image_folder)
    with Feeder(src, 4, [ops.Resize(40), ops.CenterCrop(32)], shuffle=False, seed=0) as f:
        batches, err = drain(f)
    assert err is None
    assert labels_of(batches) == src.labels


def test_filelist_source(image_folder):
    src = ImageFolder(image_folder)
    fl = FileList(src.paths, src.labels)
    with Feeder(fl, 16, [ops.CenterCrop(24)], shuffle=False) as f:
        batches, _ = drain(f)
    assert labels_of(batches) == src.labels


# -- device-side conversion ----------------------------------------------------

def test_dtype_scales_to_unit_range(source):
    with make(source, batch_size=8, shuffle=False) as raw, \
         make(source, batch_size=8, shuffle=False, dtype=torch.float32) as flt:
        x8 = next(iter(raw))[0].float()
        xf = next(iter(flt))[0]
    assert xf.dtype == torch.float32
    assert xf.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(xf, x8 / 255.0)


@pytest.mark.parametrize("dtype, normalize", [
    (None, None), (torch.float32, None), (torch.float16, None),
    (torch.float32, ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))),
])
def test_contiguous_memory_format_same_values(source, dtype, normalize):
    options = dict(batch_size=8, shuffle=False, dtype=dtype, normalize=normalize)
    with make(source, **options) as nhwc, make(source, memory_format="contiguous", **options) as nchw:
        a, err_a = drain(nhwc)
        b, err_b = drain(nchw)
        x, _ = next(iter(nchw))
    assert err_a is None and err_b is None and len(a) == len(b) == len(nchw)
    assert x.is_contiguous() and x.shape == (8, 3, 32, 32)
    assert x.view(8, -1).shape == (8, 3 * 32 * 32)  # what channels_last refuses
    assert x.dtype == (dtype or torch.uint8)
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)  # the same arithmetic, only the layout differs


def test_contiguous_uint8_batches_are_copies(source):
    """A contiguous batch is made in the transfer thread, not lent from the pool:
    a loop that keeps every batch holds no buffer, and the pool stays in its bound."""
    # Few reads in flight: the pool's bound must be below the number of batches.
    with make(source, batch_size=8, shuffle=False, memory_format="contiguous", queue_size=1,
              read_threads=2) as f:
        assert f.num_buffers < len(f)
        kept = [x for x, _ in drain_tensors(f)]
        pool = pool_of(f)
        assert len(kept) == len(f) and pool.allocated <= f.num_buffers
        assert all(x.is_contiguous() for x in kept)
        assert not any(np.shares_memory(x.numpy(), buf.images) for x in kept for buf in free_buffers_of(f))


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_layout_is_changed_in_the_transfer_thread(source, monkeypatch, dtype):
    from feeder.engine import transfer as _transfer

    threads = []
    convert = _transfer.Converter.__call__

    def recording(self, images):
        out = convert(self, images)
        threads.append((threading.current_thread().name, out.is_contiguous()))
        return out
    monkeypatch.setattr(_transfer.Converter, "__call__", recording)
    with make(source, batch_size=8, memory_format="contiguous", dtype=dtype) as f:
        batches = drain_tensors(f)
    assert len(threads) == len(batches) == len(f)
    assert set(threads) == {("feeder-transfer", True)}


def drain_tensors(f):
    """One pass's (images, labels) tensors as delivered, iterated in a helper thread."""
    return run_in_thread(lambda: list(f))


def test_normalize_matches_formula(source):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    with make(source, batch_size=8, shuffle=False) as raw, \
         make(source, batch_size=8, shuffle=False, normalize=(mean, std)) as nrm, \
         make(source, batch_size=8, shuffle=False, normalize=(mean, std), dtype=torch.float16) as half:
        x8 = next(iter(raw))[0].double()
        xn = next(iter(nrm))[0]
        xh = next(iter(half))[0]
    expect = (x8 / 255.0 - torch.tensor(mean).view(1, 3, 1, 1).double()) / torch.tensor(std).view(1, 3, 1, 1).double()
    assert xn.dtype == torch.float32 and xh.dtype == torch.float16
    torch.testing.assert_close(xn.double(), expect, rtol=0, atol=1e-5)
    torch.testing.assert_close(xh.double(), expect, rtol=0, atol=2e-2)


def test_uint8_batches_own_their_memory_until_dropped(source):
    """A uint8 CPU batch is a view of a pool buffer: kept batches must never be overwritten."""
    with make(source, batch_size=4, queue_size=1, shuffle=False) as f:
        kept = []
        for x, y in f:
            kept.append((x, x.clone(), y))  # hold every batch: the pool must grow, not reuse
        for x, copy, _ in kept:
            assert torch.equal(x, copy)
        assert f.stats().buffers >= len(kept)


# -- options validation ------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(batch_size=0), "batch_size"),
    (dict(decode_threads=0), "decode_threads"),
    (dict(augment_threads="many"), "augment_threads"),
    (dict(augment_threads=-1), "augment_threads"),
    (dict(decode_threads=True), "decode_threads"),
    (dict(queue_size=-1), "queue_size"),
    (dict(device="tpu"), "device"),
    (dict(on_error="ignore"), "on_error"),
    (dict(normalize=((0.5, 0.5), (0.5, 0.5))), "normalize"),
    (dict(normalize=((0.5,) * 3, (0.0, 1, 1))), "std"),
    (dict(normalize=((0.5,) * 3, (1,) * 3), dtype=torch.int32), "floating"),
    (dict(rank=1), "rank"),
    (dict(rank=4, world_size=4), "rank"),
    (dict(seed=-1), "seed"),
    (dict(max_pixels=0), "max_pixels"),
    (dict(max_skipped=-2), "max_skipped"),
])
def test_invalid_options_name_the_value(source, kw, match):
    with pytest.raises(ValueError, match=match):
        make(source, **kw)


def test_cuda_device_without_cuda_is_a_clear_error(source):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="CUDA is not available"):
        make(source, device="cuda")


def test_source_must_have_read():
    with pytest.raises(TypeError, match="read"):
        Feeder([b"x"], 1, AUG)


def test_output_size_must_be_known(source):
    with pytest.raises(ValueError, match="image_size"):
        Feeder(source, 4, [ops.Resize(40)])
    with pytest.raises(ValueError, match="image_size"):
        Feeder(source, 4, [ops.RandomResizedCrop(32)], image_size=(30, 30))
    f = Feeder(source, 4, [ops.Resize((30, 20))])
    assert f.image_size == (30, 20)
    f.close()


def test_threads_auto_resolves_to_the_documented_counts(source):
    from feeder.engine.threads import auto_threads, available_cores
    with make(source) as f:
        assert (f.config.decode_threads, f.config.augment_threads) == auto_threads(available_cores())
    assert auto_threads(1) == (2, 0) and auto_threads(16) == (16, 0)


# -- user transforms and errors ----------------------------------------------------

def test_plain_callable_transform_gets_deterministic_rng(source):
    def brighten(img, rng):
        return np.clip(img.astype(np.int16) + rng.integers(0, 40), 0, 255).astype(np.uint8)
    outs = []
    for dt in (1, 4):
        with make(source, transforms=[brighten, ops.RandomResizedCrop(32)], decode_threads=dt,
                  augment_threads=dt) as f:
            outs.append(drain(f)[0])
    for (xa, _), (xb, _) in zip(*outs):
        np.testing.assert_array_equal(xa, xb)


def test_transform_error_names_stage_index_path(source):
    def bad(img, rng):
        raise ZeroDivisionError("boom")
    src = MemorySource(source.blobs, names=[f"/data/img{i}.jpg" for i in range(60)])
    with make(src, transforms=[bad, ops.CenterCrop(16)]) as f:
        _, err = drain(f)
    assert isinstance(err, SampleError)
    assert err.stage == "augment" and 0 <= err.index < 60
    assert f"/data/img{err.index}.jpg" in str(err) and "augment" in str(err)
    assert isinstance(err.__cause__, ZeroDivisionError)


def test_wrong_size_from_transform_names_transform_and_sizes(source):
    def shrink(img, rng):
        return img[:10, :10]
    shrink.output_size = None
    with make(source, transforms=[ops.CenterCrop(32), shrink], shuffle=False) as f:
        _, err = drain(f)
    assert isinstance(err, SampleError) and isinstance(err.__cause__, TransformError)
    msg = str(err)
    assert "shrink" in msg and "(10, 10, 3)" in msg and "(32, 32, 3)" in msg


def test_decode_error_raises_with_path(source):
    blobs = list(source.blobs)
    blobs[13] = b"\xff\xd8\xff" + b"garbage" * 10
    src = MemorySource(blobs, names=[f"f{i}.jpg" for i in range(60)])
    with make(src, batch_size=5, shuffle=False) as f:
        batches, err = drain(f)
    assert isinstance(err, SampleError) and err.stage == "decode" and err.index == 13
    assert "f13.jpg" in str(err)
    assert labels_of(batches) == list(range(10))  # ordered: batches before the bad one arrive


def test_read_error_raises_with_stage_read(tmp_path, source):
    paths = []
    for i, blob in enumerate(source.blobs[:10]):
        p = tmp_path / f"{i}.jpg"
        p.write_bytes(blob)
        paths.append(str(p))
    paths[4] = str(tmp_path / "missing.jpg")
    with make(FileList(paths, list(range(10))), batch_size=5) as f:
        _, err = drain(f)
    assert isinstance(err, SampleError) and err.stage == "read"
    assert "missing.jpg" in str(err) and isinstance(err.__cause__, FileNotFoundError)


@pytest.mark.parametrize("ordered", [True, False])
def test_skip_keeps_batch_size_and_delivers_the_rest_once(source, ordered, caplog):
    blobs = list(source.blobs)
    bad = {3, 17, 18, 40}
    for i in bad:
        blobs[i] = b"not an image"
    src = MemorySource(blobs)
    with make(src, batch_size=8, on_error="skip", drop_last=False, ordered=ordered,
              decode_threads=3) as f:
        batches, err = drain(f)
        stats = f.stats()
    assert err is None
    sizes = [len(y) for _, y in batches]
    assert sizes[:-1] == [8] * (len(sizes) - 1) and sizes[-1] == 56 % 8 or sizes[-1] == 8
    assert sorted(labels_of(batches)) == sorted(set(range(60)) - bad)
    assert stats.skipped == 4
    assert sum(1 for r in caplog.records if "skipped" in r.getMessage()) == 4


def test_skip_with_drop_last_all_full(source):
    blobs = list(source.blobs)
    blobs[5] = b""
    with make(MemorySource(blobs), batch_size=8, on_error="skip", drop_last=True) as f:
        batches, err = drain(f)
    assert err is None
    assert all(len(y) == 8 for _, y in batches) and len(batches) == 59 // 8
    got = labels_of(batches)
    assert 5 not in got and len(set(got)) == len(got)


def test_skip_is_deterministic_when_ordered(source):
    blobs = list(source.blobs)
    for i in (2, 9, 33):
        blobs[i] = b"junk"
    runs = []
    for dt in (1, 5):
        with make(MemorySource(blobs), batch_size=8, on_error="skip", decode_threads=dt) as f:
            runs.append([list(y) for _, y in drain(f)[0]])
    assert runs[0] == runs[1]


def test_max_skipped_budget(source):
    blobs = [b"junk"] * 5 + list(source.blobs[5:])
    with make(MemorySource(blobs), batch_size=8, on_error="skip", max_skipped=3, shuffle=False) as f:
        _, err = drain(f)
    assert isinstance(err, FeederError) and "max_skipped=3" in str(err)


def test_source_len_broken_is_stage_error():
    class Broken(MemorySource):
        def __len__(self):
            if threading.current_thread().name.startswith("feeder-"):
                raise RuntimeError("len exploded")
            return 10
    with make(Broken([b""] * 10)) as f:
        _, err = drain(f)
    assert isinstance(err, FeederError) and "sampler" in str(err)
    assert isinstance(err.__cause__, RuntimeError)


# -- lifecycle -------------------------------------------------------------------------

def test_close_is_prompt_with_every_stage_blocked(source):
    # A consumer that never reads: the output queue fills, the transfer thread
    # blocks on it, the sampler blocks waiting for a free buffer, the pools idle.
    # (Few reads in flight, so that the pool cannot hold the whole source.)
    f = make(source, batch_size=2, queue_size=1, decode_threads=4, augment_threads=2, read_threads=4)
    try:
        it = iter(f)
        next(it)  # the pass starts at the first next(); the loop then stops reading
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            s = f.stats()
            out = next(q for q in s.queues if q.name == "output")
            if (out.depth == out.capacity and s.stage("transfer").wait_output_s > 0.2
                    and s.stage("sampler").wait_output_s > 0.2):
                break
            time.sleep(0.01)  # polling a condition under a deadline, not waiting for threads to "run"
        else:
            pytest.fail(f"pipeline never backed up:\n{f.stats()}")
        t0 = time.monotonic()
        f.close()
        assert time.monotonic() - t0 < 1.0
        assert not feeder_threads()
        f.close()  # idempotent
        with pytest.raises(StopIteration):
            next(it)
    finally:
        f.close()


def test_close_from_another_thread_ends_iteration(source):
    gate = Gate(timeout=10, fail_on_timeout=False)
    f = make(source, transforms=[gate, ops.CenterCrop(16)])
    it = iter(f)
    got = []
    t = threading.Thread(target=lambda: got.append(_next_or_stop(it)), daemon=True)
    t.start()
    assert gate.entered.wait(10)
    closer = threading.Thread(target=f.close)
    closer.start()
    gate.release.set()
    closer.join(5)
    t.join(5)
    assert not closer.is_alive() and not t.is_alive()
    assert got in (["stop"], ["batch"])
    assert f.closed


def _next_or_stop(it):
    try:
        next(it)
        return "batch"
    except StopIteration:
        return "stop"


def test_slow_transform_close_still_prompt(source):
    gate = Gate(timeout=10, fail_on_timeout=False)
    f = make(source, transforms=[gate, ops.CenterCrop(16)], augment_threads=1)
    it = iter(f)  # held: a dropped iterator would stop its pass
    consumer, result = consume_in_thread(it)  # its first next() starts the pass
    assert gate.entered.wait(10)
    t0 = time.monotonic()
    f.close()
    assert time.monotonic() - t0 < 1.5  # returns although a thread is stuck in user code
    consumer.join(JOIN_TIMEOUT_S)
    assert not consumer.is_alive() and result == ["stop"]
    gate.release.set()  # the stuck thread finishes its call and exits (leak guard checks)
    del it


def test_iterating_closed_feeder_raises(source):
    f = make(source)
    f.close()
    with pytest.raises(FeederError, match="closed"):
        iter(f)


def test_garbage_collected_feeder_stops_threads(source):
    f = make(source, batch_size=2, queue_size=1)
    it = iter(f)
    next(it)
    assert feeder_threads()
    ref = weakref.ref(f)
    del f, it
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 5
    while feeder_threads() and time.monotonic() < deadline:
        for t in feeder_threads():
            t.join(0.05)
    assert not feeder_threads()


def test_collecting_a_closed_feeder_starts_no_thread(source):
    """A closed feeder has nothing left to stop. An exception's traceback often keeps
    it in a reference cycle, so the cyclic collector frees it later, in whatever
    thread and test it happens to run: that must not start a feeder thread then."""
    gc.collect()  # earlier tests' garbage is not this test's
    f = make(source, batch_size=2)
    with f:
        next(iter(f))
    f.me = f  # only the cyclic collector frees it
    ref = weakref.ref(f)
    engine = engine_of(f)
    # Holding the engine's lock keeps a thread started by the collection alive
    # (blocked in close()) until it is looked for, however fast it would finish.
    with engine.lock:
        del f
        gc.collect()
        assert ref() is None
        assert [t.name for t in feeder_threads()] == []


def test_threads_are_named_after_stages(source):
    with make(source, decode_threads=2, augment_threads=2, read_threads=2) as f:
        it = iter(f)
        next(it)
        # The pass's own list: a stage that has finished (the sampler, once the
        # epoch is dispatched) is no longer among the running threads.
        names = {t.name for t in pass_of(it).threads()}
    assert names == {"feeder-sampler", "feeder-transfer", "feeder-read-0", "feeder-read-1",
                     "feeder-decode-0", "feeder-decode-1", "feeder-augment-0", "feeder-augment-1"}


def test_opencv_threads_limited_while_running_and_restored(source):
    import cv2
    before = cv2.getNumThreads()
    with make(source) as f:
        it = iter(f)
        next(it)  # the pass (and the limit) starts at the first next()
        assert cv2.getNumThreads() == 1
        del it
    assert cv2.getNumThreads() == before


# -- stats -----------------------------------------------------------------------------

@pytest.mark.parametrize("augment_threads", [2, 0])
def test_stats_account_for_work(source, augment_threads):
    with make(source, batch_size=8, drop_last=False, augment_threads=augment_threads) as f:
        drain(f)
        s = f.stats()
    assert isinstance(s, Stats)
    assert s.samples == 60 and s.batches == 8 and s.skipped == 0
    assert s.stage("decode").items == 60 and s.stage("augment").items == 60
    assert s.stage("transfer").items == 8 and s.stage("sampler").items == 8
    assert s.stage("decode").busy_s > 0 and s.stage("augment").busy_s > 0 and s.consumer_wait_s >= 0
    assert s.stage("augment").threads == augment_threads
    assert s.stage("read").items == 60 and s.stage("read").threads == 32
    queues = {"read", "decode", "collate", "output"} | ({"augment"} if augment_threads else set())
    assert {q.name for q in s.queues} == queues
    table = str(s)
    for word in ("read", "decode", "augment", "transfer", "waited", "queue"):
        assert word in table
    if not augment_threads:
        assert "inline" in table and s.bottleneck != "augment"


def test_inline_time_of_failed_samples_is_still_augment_time(source):
    def slow_then_fail(img, rng):
        time.sleep(0.005)  # the transform's own cost, not a wait for threads
        raise ValueError("bad sample")
    with make(source, transforms=[slow_then_fail, ops.CenterCrop(16)], batch_size=8, decode_threads=1,
              augment_threads=0, on_error="skip") as f:
        drain(f)
        s = f.stats()
    assert s.skipped == 60 and s.stage("augment").items == 0
    assert s.stage("augment").busy_s >= 60 * 0.005 > s.stage("decode").busy_s
    assert s.stage("decode").utilization > 0.5  # the inline work counts as the threads' work


def test_inline_augment_time_is_taken_out_of_decode_time(source):
    """With augment_threads=0 the decode threads' transform time is reported as the
    augment stage's, not as decode time: a slow transform shows up where it is."""
    def slow(img, rng):
        time.sleep(0.005)  # the transform's own cost, not a wait for threads
        return img
    with make(source, transforms=[slow, ops.CenterCrop(16)], batch_size=8, decode_threads=2,
              augment_threads=0) as f:
        drain(f)
        s = f.stats()
    assert s.stage("augment").busy_s >= 60 * 0.005
    assert s.stage("augment").busy_s > s.stage("decode").busy_s


def test_reduced_scale_decode_matches_full_decode_output():
    """Large JPEGs are decoded at reduced DCT scale; the crops must be the same
    ones a full decode would give (same boxes, close pixels)."""
    from tests.support import encode_jpeg
    from feeder.synthetic import make_image
    blobs = [encode_jpeg(make_image(600, 800, seed=i), 90) for i in range(6)]
    src = MemorySource(blobs)
    class FullDecodeRRC(ops.RandomResizedCrop):
        def decode_hint(self, height, width, rng, ctx=None):
            return None  # same crops, drawn in apply, from a full-size decode

    rrc = ops.RandomResizedCrop(64, scale=(0.3, 1.0))
    with Feeder(src, 6, [rrc], seed=3, shuffle=False) as fast, \
         Feeder(src, 6, [FullDecodeRRC(64, scale=(0.3, 1.0))], seed=3, shuffle=False) as full:
        (xa, _), = drain(fast)[0]
        (xb, _), = drain(full)[0]
    err = np.abs(xa.astype(int) - xb.astype(int)).mean(axis=(1, 2, 3))
    assert (err < 12).all(), err


def test_tiny_passes_never_release_a_buffer_twice(source, caplog):
    """Regression: a sampler that finished before the other stages started made the
    pass's live-thread count touch zero and hand its buffers back while in use."""
    tiny = MemorySource(source.blobs[:3])
    with make(tiny, batch_size=3, decode_threads=3, augment_threads=3) as f:
        for _ in range(40):
            batches, err = drain(f)
            assert err is None and sorted(labels_of(batches)) == [0, 1, 2]
            del batches
    assert not [r for r in caplog.records if "released twice" in r.getMessage()]


def test_worker_threads_use_one_torch_thread_and_leave_the_loop_alone(source):
    seen = []

    def probe(img, rng):
        seen.append(torch.get_num_threads())
        return img

    before = torch.get_num_threads()
    with make(source, transforms=[probe, ops.CenterCrop(16)]) as f:
        drain(f)
    assert torch.get_num_threads() == before
    if "OpenMP" in torch.__config__.parallel_info():
        assert set(seen) == {1}


def test_worker_threads_stay_at_one_torch_thread_after_the_loop_sets_its_count(source):
    # A training script's torch.set_num_threads(N) is a process-wide count that
    # torch applies to each thread on its first torch call: a worker thread whose
    # first call came after the feeder's limit ran N-threaded.
    seen = []

    def probe(img, rng):
        seen.append(torch.get_num_threads())
        return img

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with make(source, transforms=[probe, ops.CenterCrop(16)]) as f:
            drain(f)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    if "OpenMP" in torch.__config__.parallel_info():
        assert set(seen) == {1}


def test_exhausted_iterator_keeps_raising_stop_iteration(source):
    with make(source, batch_size=30) as f:
        it = iter(f)
        batches, err = drain(it)
        assert err is None and len(batches) == 2
        again, err = drain(it)  # next() on an exhausted iterator must not wait for more
        assert err is None and again == []


def test_dropping_the_iterator_stops_its_pass(source):
    from tests.support.faults import wait_no_feeder_threads
    with make(source, batch_size=4, queue_size=1) as f:
        for i, _ in enumerate(f):
            if i == 1:
                break  # the for loop's iterator is gone now
        assert wait_no_feeder_threads(2.0) == []
        assert pool_of(f).allocated >= 1 and not pool_of(f).owned_by(current_pass_of(f))


def test_manual_shards_without_seed_agree_on_the_order(source):
    shards = []
    for rank in range(3):
        torch.manual_seed(100 + rank)  # ranks commonly seed torch differently
        with Feeder(source, 5, AUG, rank=rank, world_size=3) as f:
            shards.append(labels_of(drain(f)[0]))
    flat = [x for s in shards for x in s]
    assert len(flat) == len(set(flat)) == 60


def test_skip_with_a_loop_that_keeps_batches_does_not_hang(source):
    """The partial batch held for refilling counts as unavailable when the pool
    decides whether it must grow for a loop that keeps its batches."""
    blobs = list(source.blobs)
    blobs[1] = b"junk"
    with make(MemorySource(blobs), batch_size=3, on_error="skip", queue_size=1, shuffle=False) as f:
        kept = []

        def run():
            for x, y in f:
                kept.append((x, y))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "hang"
    assert sorted(int(v) for _, y in kept for v in y) == [i for i in range(60) if i != 1]


def test_raising_transform_is_named_in_the_error(source):
    def my_jitter(img, rng):
        raise ValueError("bad parameter")
    with make(source, transforms=[my_jitter, ops.CenterCrop(16)]) as f:
        _, err = drain(f)
    assert isinstance(err, SampleError) and "my_jitter" in str(err) and "bad parameter" in str(err)


def test_workers_do_not_change_torch_threads_of_other_threads(source):
    import subprocess
    import sys
    code = (
        "import threading, torch\n"
        f"import sys; sys.path.insert(0, {REPO_DIR!r})\n"
        "from tests.support import MemorySource, encode_jpeg\n"
        "from feeder import Feeder, ops\n"
        "from feeder.synthetic import make_image\n"
        "src = MemorySource([encode_jpeg(make_image(40, 40, i)) for i in range(8)])\n"
        "with Feeder(src, 4, [ops.CenterCrop(32)], seed=0) as f:\n"
        "    for _ in f: pass\n"
        "    r = {}\n"
        "    t = threading.Thread(target=lambda: r.setdefault('n', torch.get_num_threads()))\n"
        "    t.start(); t.join()\n"
        "    print(torch.get_num_threads(), r['n'])\n")
    expect = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                            capture_output=True, text=True, timeout=60).stdout.split()[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [expect, expect]


# -- batches bound to a buffer late ------------------------------------------------------

@pytest.fixture
def late_binding(monkeypatch):
    """Every batch starts without a buffer: its first samples go through scratch arrays."""
    from feeder.engine.batch import BufferPool
    monkeypatch.setattr(BufferPool, "try_acquire", lambda self, owner=None: None)


@pytest.mark.parametrize("threads", [(2, 0), (3, 2)])
@pytest.mark.parametrize("ordered", [True, False])
def test_late_bound_batches_deliver_each_sample_once_with_its_pixels(source, late_binding, threads, ordered):
    def by_label(batches):
        return {int(l): x[i].tobytes() for x, y in batches for i, l in enumerate(y)}
    with make(source, batch_size=7, ordered=ordered, decode_threads=threads[0],
              augment_threads=threads[1], seed=5) as f:
        f.set_epoch(2)
        late, err = drain(f)
    assert err is None and sorted(labels_of(late)) == list(range(60))
    with make(source, batch_size=7, ordered=ordered, decode_threads=1, augment_threads=1, seed=5) as f:
        f.set_epoch(2)
        ref, _ = drain(f)
    assert by_label(late) == by_label(ref)  # each label still travels with its own pixels


class _BadLabelAt(MemorySource):
    def __init__(self, blobs, bad):
        super().__init__(blobs)
        self.labels[bad] = "cat"


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_bad_label_in_a_late_bound_batch_is_that_sample_s_error(mixed_blobs, late_binding, on_error):
    bad = 45  # in the 6th batch of 8
    src = _BadLabelAt(mixed_blobs, bad)
    with make(src, batch_size=8, shuffle=False, on_error=on_error) as f:
        batches, err = drain(f)
        skipped = f.stats().skipped
    if on_error == "raise":
        # Found when the sample is read, and named as the label's fault.
        assert isinstance(err, SampleError) and err.stage == "read" and err.index == bad, repr(err)
        assert err.field == "label" and "'cat'" in str(err), str(err)
    else:
        assert err is None and skipped == 1
        assert sorted(labels_of(batches)) == [i for i in range(60) if i != bad]


def test_a_new_pass_gets_buffers_while_an_abandoned_pass_is_stuck_in_user_code(source):
    """The pool holds two buffers; the first pass is dropped while one of its threads is
    inside a transform that does not return. Its buffers will come back only when that
    call returns, so the new pass must not wait for them."""
    entered, release = threading.Event(), threading.Event()
    lock = threading.Lock()

    def stall(img, rng):
        with lock:
            first = not entered.is_set()
            entered.set()
        if first:
            assert release.wait(30), "never released"
        return img

    f = make(source, transforms=[stall, ops.CenterCrop(16)], batch_size=4, decode_threads=2,
             augment_threads=0, ordered=False)
    try:
        it = iter(f)
        held = next(it)  # the loop keeps this batch, as `for x in f: break` does
        assert entered.is_set()
        del it  # the pass is abandoned with a thread stuck in `stall`
        batches, err = drain(f, timeout=10, limit=3)
        assert err is None and len(batches) == 3
        assert held[0].shape[0] == 4
    finally:
        release.set()
        f.close()


@pytest.mark.parametrize("n, bad, drop_last", [
    (41, {3}, False),       # 40 left: the last batch (of 1) is gone
    (48, {3}, False),       # 47 left: the last batch is shorter
    (48, {3}, True),        # 47 left: a batch fewer
    (50, {3, 49}, True),    # 48 left: the tail drop_last would drop fills the gaps
])
def test_skipped_samples_shorten_the_pass_from_its_end(source, n, bad, drop_last):
    """len(feeder) counts a pass that skips nothing; skips shorten the pass from its
    end, as docs/from-dataloader.md says: the batches of the samples left."""
    from feeder.engine.sampler import num_batches
    blobs = [b"junk" if i in bad else source.blobs[i % len(source.blobs)] for i in range(n)]
    with make(MemorySource(blobs), batch_size=8, on_error="skip", drop_last=drop_last,
              decode_threads=2) as f:
        assert len(f) == num_batches(n, 8, drop_last)
        batches, err = drain(f)
        assert err is None and f.stats().skipped == len(bad)
        assert len(f) == num_batches(n, 8, drop_last)  # the next pass may skip nothing
    sizes = [len(y) for _, y in batches]
    assert len(sizes) == num_batches(n - len(bad), 8, drop_last)
    assert sizes[:-1] == [8] * (len(sizes) - 1)
    assert sum(sizes) == (n - len(bad) if not drop_last else len(sizes) * 8)


@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize("n, bad, short", [
    (41, {3}, True),    # 40 left: 5 batches of the 6 planned
    (48, {3}, False),   # 47 left: 6 batches, the last shorter
])
def test_a_pass_cut_short_by_skips_says_so_at_its_end(source, caplog, monkeypatch, n, bad, short,
                                                     isolation):
    # A progress bar takes len(feeder) before the first batch: when skips end the
    # pass a batch early, the loop still ends, and a warning gives the counts.
    tqdm = pytest.importorskip("tqdm").tqdm
    # No monitor thread: it would live on in this test process, and make every
    # later isolated Feeder's start_method="auto" spawn.
    monkeypatch.setattr(tqdm, "monitor_interval", 0)
    import io
    blobs = [b"junk" if i in bad else source.blobs[i % len(source.blobs)] for i in range(n)]
    with make(MemorySource(blobs), batch_size=8, on_error="skip", decode_threads=2,
              isolation=isolation) as f:
        planned = len(f)
        with caplog.at_level("WARNING", logger="feeder._consumer"):
            bar = tqdm(f, file=io.StringIO())
            delivered = sum(1 for _ in bar)
        assert bar.total == planned == 6 and bar.n == delivered == 6 - short
        assert bar.disable  # closed by the loop's end, as after a full pass
    ends = [r.getMessage() for r in caplog.records if "ended after" in r.getMessage()]
    if short:
        assert ends == [f"epoch 0 ended after 5 of its 6 batches (len(feeder) counts a pass that "
                        f"skips nothing): 1 sample(s) left out under on_error='skip', and the "
                        f"samples after each filled its place"]
    else:
        assert ends == []
