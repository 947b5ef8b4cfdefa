"""The decode threads take a run of a batch's FileList samples in one call of the
region decoder (``Step.run``: ``ext.fused_run``), the GIL let go once for the
run: the same batches, the same failures named by the same step and sample, and
the same counts as when each sample takes its steps alone."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import JOIN_TIMEOUT_S, MemorySource, drain
from tests.support.jpeg import KINDS, jpeg, write_files
from feeder import Feeder, FeederTimeoutError, SampleError, ops
from feeder.errors import DecodeError
from feeder.decode import extension
from feeder.engine.stage import RunAt
from feeder.sources import FileList
from feeder.synthetic import make_image

pytestmark = pytest.mark.skipif(extension.jpeg is None, reason="the region decoder is not built")

CHAIN = [ops.RandomResizedCrop(40), ops.RandomHorizontalFlip()]
# Batch 16 and 2 decode threads: runs of 2 samples; batch 24 and 1 thread: runs of 6.
SHAPES = [(16, 2), (24, 1)]


class _Spy:
    """The extension, keeping the length of every run it was given."""

    def __init__(self, ext) -> None:
        self._ext, self.runs = ext, []

    def fused_run(self, paths, *args):
        got = self._ext.fused_run(paths, *args)
        self.runs.append(len(paths))
        return got

    def __getattr__(self, name):
        return getattr(self._ext, name)


def _files(tmp_path, copies: int = 3) -> tuple[list[str], list[bytes]]:
    rng = np.random.default_rng(3)
    blobs = []
    for n in range(copies):
        for k, kind in enumerate(KINDS):
            h, w = [(60, 44), (333, 400), (97, 131)][(n + k) % 3]
            noisy = make_image(h, w, seed=n * 17 + k).astype(np.int16) + rng.integers(-40, 40, (h, w, 3))
            blobs.append(jpeg(np.clip(noisy, 0, 255).astype(np.uint8), kind, 90))
    return write_files(tmp_path, blobs), blobs


def _run(source, batch: int, threads: int, chain=CHAIN, epochs: int = 2, **options):
    out = []
    with Feeder(source, batch, chain, shuffle=True, seed=7, decode_threads=threads,
                timeout=JOIN_TIMEOUT_S, **options) as f:
        for epoch in range(epochs):
            f.set_epoch(epoch)
            batches, error = drain(f)
            out += batches
            if error is not None:
                return out, error, f.stats()
        return out, None, f.stats()


def _same(a: list, b: list) -> None:
    assert len(a) == len(b) > 0
    for (x, y), (x2, y2) in zip(a, b):
        np.testing.assert_array_equal(y, y2)
        np.testing.assert_array_equal(x, x2)


class _Halve(ops.Transform):
    """An in-place step after the fused ones (the samples then finish in their own steps)."""

    preserves_size = True
    inplace = True

    def apply(self, img, rng, out=None, ctx=None):
        out = np.empty_like(img) if out is None else out
        np.right_shift(img, 1, out=out)
        return out


@pytest.mark.parametrize("batch, threads", SHAPES)
@pytest.mark.parametrize("chain", ["fused", "more after"])
def test_runs_give_the_batches_of_samples_taken_alone(tmp_path, monkeypatch, batch, threads, chain):
    """Whatever follows the fused steps (nothing: the run finishes its samples
    itself; an in-place step: each sample finishes in its own steps), the same
    pixels and labels as the read step reading the bytes, every sample once."""
    paths, blobs = _files(tmp_path)
    labels = [3 * i + 1 for i in range(len(paths))]
    transforms = CHAIN + [_Halve()] if chain == "more after" else CHAIN
    options = {}
    spy = _Spy(extension.jpeg)
    monkeypatch.setattr(extension, "jpeg", spy)
    got, error, stats = _run(FileList(paths, labels), batch, threads, transforms, **options)
    assert error is None
    assert max(spy.runs) > 1, spy.runs  # runs of several samples were taken at once
    monkeypatch.setattr(extension, "jpeg", spy._ext)
    want, error, _ = _run(MemorySource(blobs, labels), batch, threads, transforms, **options)
    assert error is None
    _same(got, want)
    alone, error, _ = _run(FileList(paths, labels), batch, threads, transforms, read_threads=1, **options)
    assert error is None
    _same(got, alone)
    delivered = sorted(int(y) for _, ys in got for y in ys)
    assert delivered == sorted(labels * 2)
    # Every sample counted by the stages that ran its steps.
    stages = {stage.name: stage for stage in stats.stages}
    assert stages["decode"].items == stages["augment"].items == len(paths) * 2


@pytest.mark.parametrize("damage", ["missing", "corrupt", "directory", "empty", "png"])
def test_a_bad_file_in_a_run_fails_as_it_does_alone(tmp_path, damage):
    """The run leaves a file it cannot use to its own steps: the same error,
    named by the same step and sample, or, skipped, every other sample once."""
    paths, blobs = _files(tmp_path)
    bad = 5
    if damage == "missing":
        os.remove(paths[bad])
    elif damage == "corrupt":
        with open(paths[bad], "wb") as f:
            f.write(blobs[bad][:len(blobs[bad]) * 3 // 5])  # cut in its entropy-coded data
    elif damage == "directory":
        os.remove(paths[bad])
        os.mkdir(paths[bad])
    elif damage == "empty":
        open(paths[bad], "wb").close()
    else:  # not an error: a PNG, which the run hands on as bytes for the decode step
        import cv2

        ok, png = cv2.imencode(".png", make_image(50, 70, seed=1))
        with open(paths[bad], "wb") as f:
            f.write(png.tobytes())
    labels = list(range(len(paths)))
    runs, error_runs, _ = _run(FileList(paths, labels), 24, 1)
    alone, error_alone, _ = _run(FileList(paths, labels), 24, 1, read_threads=1)
    if damage == "png":
        assert error_runs is None and error_alone is None
        _same(runs, alone)
        return
    assert isinstance(error_runs, SampleError), error_runs
    assert str(error_runs) == str(error_alone)
    assert f"sample {bad}" in str(error_runs)
    runs, error_runs, stats = _run(FileList(paths, labels), 24, 1, on_error="skip")
    alone, error_alone, _ = _run(FileList(paths, labels), 24, 1, read_threads=1, on_error="skip")
    assert error_runs is None and error_alone is None
    _same(runs, alone)
    assert sorted(int(y) for _, ys in runs for y in ys) == sorted([i for i in labels if i != bad] * 2)
    assert stats.skipped == 2


def test_the_samples_a_run_leaves_fail_in_the_run_s_order(tmp_path):
    """A run takes sample 6 (a str path) in its call and leaves sample 7 (a bytes
    path) to the steps; both are missing. They fail in slot order, as taken
    alone: the max_skipped error names the same last sample."""
    paths, _ = _files(tmp_path, copies=6)
    paths[6] = str(tmp_path / "missing6.jpg")
    paths[7] = os.fsencode(str(tmp_path / "missing7.jpg"))
    errors = []
    for read_threads in (0, 1):
        with Feeder(FileList(paths, list(range(len(paths)))), 24, CHAIN, on_error="skip", max_skipped=1,
                    decode_threads=1, read_threads=read_threads, shuffle=False,
                    timeout=JOIN_TIMEOUT_S) as f:
            _, error = drain(f)
        errors.append(str(error))
    assert "sample 7" in errors[1], errors
    assert errors[0] == errors[1]


def test_a_large_file_the_run_does_not_take_is_read_again_alone(tmp_path, monkeypatch):
    """A run holds a file it read but cannot take (here a PNG) for the decode
    step only up to 1 MiB; a larger one is read again alone: the same batches."""
    import cv2

    paths, _ = _files(tmp_path, copies=2)
    noise = np.random.default_rng(5).integers(0, 256, (700, 700, 3), dtype=np.uint8)
    ok, png = cv2.imencode(".png", noise)
    assert png.size > 1 << 20
    with open(paths[4], "wb") as f:
        f.write(png.tobytes())
    spy = _Spy(extension.jpeg)
    monkeypatch.setattr(extension, "jpeg", spy)
    got, error, _ = _run(FileList(paths, list(range(len(paths)))), 8, 1)
    assert error is None and max(spy.runs) > 1
    want, error, _ = _run(FileList(paths, list(range(len(paths)))), 8, 1, read_threads=1)
    assert error is None
    _same(got, want)


def test_a_pipe_in_a_run_is_read_alone_and_named_when_it_blocks(tmp_path):
    """A run reads only regular files: a FIFO is left to its own read, which
    blocks there, and a timeout names that sample, not the run's first."""
    paths, _ = _files(tmp_path)
    fifo = str(tmp_path / "stuck.jpg")
    os.mkfifo(fifo)
    paths[3] = fifo
    try:
        with Feeder(FileList(paths, list(range(len(paths)))), 24, CHAIN, decode_threads=1,
                    shuffle=False, timeout=1.0) as f:
            _, error = drain(f)
        assert isinstance(error, FeederTimeoutError), error
        assert "stuck.jpg" in str(error) and "sample 3" in str(error), str(error)
        assert "in stage 'read and decode'" in str(error)
    finally:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)


def _args(paths, outs, at=None, keys=None):
    keys = keys if keys is not None else [11 * i + 5 for i in range(len(paths))]
    # crop_stream, flip_stream, flip_p, lo, span_s, log_lo, span_r, oh, ow, antialias,
    # verify, max_steps, max_pixels
    import math

    lo, hi = 0.08, 1.0
    log_lo, log_hi = math.log(3 / 4), math.log(4 / 3)
    return (paths, keys, outs, at, 17, 29, 0.5, lo, hi - lo, log_lo, log_hi - log_lo,
            40, 40, False, True, 10000, 1 << 28)


def test_the_extension_run_gives_what_each_call_alone_gives(tmp_path):
    """Per file: True and the same pixels as fused() on that path alone; the
    file's bytes where fused() hands them back; None for what it cannot read
    or decode (the caller then takes that file alone); ``at`` ends on the last."""
    ext = extension.jpeg
    paths, _ = _files(tmp_path, copies=1)
    import cv2

    ok, png = cv2.imencode(".png", make_image(30, 30, seed=2))
    (tmp_path / "p.png").write_bytes(png.tobytes())
    garbage = b"\xff\xd8\xff\xe0" + b"\x00" * 64  # no frame: not taken, handed back
    (tmp_path / "garbage.jpg").write_bytes(garbage)
    whole = (tmp_path / os.path.basename(paths[0])).read_bytes()
    (tmp_path / "cut.jpg").write_bytes(whole[:len(whole) * 3 // 5])  # a decode error
    os.mkdir(tmp_path / "d.jpg")
    noise = np.random.default_rng(5).integers(0, 256, (700, 700, 3), dtype=np.uint8)
    big = cv2.imencode(".png", noise)[1].tobytes()  # over 1 MiB: not held for the run
    (tmp_path / "big.png").write_bytes(big)
    files = [*paths, str(tmp_path / "p.png"), str(tmp_path / "garbage.jpg"), str(tmp_path / "big.png"),
             str(tmp_path / "cut.jpg"), str(tmp_path / "d.jpg"), str(tmp_path / "gone.jpg")]
    outs = [np.zeros((40, 40, 3), np.uint8) for _ in files]
    at = np.full(1, -1, np.int64)
    got = ext.fused_run(*_args(files, outs, at))
    assert int(at[0]) == len(files) - 1
    assert got[-6:-4] == [png.tobytes(), garbage]
    assert got[-4:] == [None, None, None, None]
    with pytest.raises(DecodeError):  # what the caller meets when it takes the file alone
        ext.fused(files[-3], 1, *_args([], [])[4:], np.zeros((40, 40, 3), np.uint8))
    for i, path in enumerate(paths):
        alone = np.zeros((40, 40, 3), np.uint8)
        want = ext.fused(path, 11 * i + 5, *_args([path], [alone])[4:], alone)
        assert got[i] == want, (path, got[i], want)
        if want is True:
            np.testing.assert_array_equal(outs[i], alone)
    assert sum(g is True for g in got) >= len(paths) - 2  # a progressive file may go its own way


@pytest.mark.parametrize("bad", ["lengths", "path type", "out size", "key", "at", "too many"])
def test_the_extension_run_refuses_bad_arguments(tmp_path, bad):
    ext = extension.jpeg
    paths, _ = _files(tmp_path, copies=1)
    paths = paths[:2]
    outs = [np.zeros((40, 40, 3), np.uint8) for _ in paths]
    args = list(_args(paths, outs))
    if bad == "lengths":
        args[1] = args[1][:1]
        error = ValueError
    elif bad == "path type":
        args[0] = [paths[0], os.fsencode(paths[1])]
        error = TypeError
    elif bad == "out size":
        args[2] = [outs[0], np.zeros((40, 39, 3), np.uint8)]
        error = ValueError
    elif bad == "key":
        args[1] = [1, -1]
        error = OverflowError
    elif bad == "at":
        args[3] = np.zeros(1, np.int8)
        error = ValueError
    else:
        args[0] = [paths[0]] * 1025
        args[1] = [1] * 1025
        args[2] = [outs[0]] * 1025
        error = ValueError
    with pytest.raises(error):
        ext.fused_run(*args)
    assert outs[1].max() == 0  # nothing was read or written


def test_run_at_names_the_task_in_work():
    class T:
        def __init__(self, index):
            self.index = index

    at = RunAt()
    assert at.index == -1
    at.tasks = [T(7), T(9), T(4)]
    assert at.index == 7
    at.at[0] = 2
    assert at.index == 4
    at.at[0] = 99  # never past the run's last
    assert at.index == 4


def _read_step(source, scratch):
    from feeder.engine.steps import SampleWork, steps
    from feeder.ops.chain import Chain

    work = SampleWork(Chain(CHAIN, None), files=len(source))
    work.schema.classic = True  # as after the first sample of a pass
    read, _, _ = steps(source, work, scratch, seed=7, epoch=0, inline=True, read_inline=True)
    return read


def test_a_run_whose_batch_has_no_buffer_waits_in_scratch_arrays_fused(tmp_path):
    """A batch dispatched before the training loop has handed a buffer back: its
    runs are still read and decoded in one call each, into scratch arrays, and
    copied into the buffer when it is bound; the same bytes as a run into the
    buffer itself, every scratch array given back."""
    from feeder.engine.buffers import BatchBuffer
    from feeder.engine.filling import FillingBatch, Scratch
    from feeder.sample.rng import epoch_key, index_key
    from feeder.sample.schema import Task

    paths, _ = _files(tmp_path, copies=1)
    source = FileList(paths, list(range(len(paths))))
    n = len(paths)
    h, w = CHAIN[0].output_size
    results = []
    for buffered in (True, False):
        scratch = Scratch(h, w)
        read = _read_step(source, scratch)
        buf = BatchBuffer(n, h, w, None, serial=0)
        batch = FillingBatch(0, buf if buffered else None, n)
        keys = [index_key(epoch_key(7, 0), i) for i in range(n)]
        tasks = [Task(batch, slot, slot, keys[slot]) for slot in range(n)]
        left, done, complete = read.run(tasks, RunAt())
        assert (left, done) == ([], n)
        if buffered:
            assert complete is batch
        else:
            assert complete is None and scratch.nbytes() == n * h * w * 3  # waiting in scratch
            assert batch.bind(buf, scratch.give)  # the binding completes the batch
            assert len(scratch._free) == n  # every array back
        results.append((buf.images.copy(), buf.labels.copy(), buf.indices.copy()))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(results[0][1], np.arange(n))
