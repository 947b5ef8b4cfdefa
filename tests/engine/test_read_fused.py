"""A FileList's file is read by the region decoder in the call that decodes it
(the read step's ``SampleWork.read_into``): the same batches as when the read
step reads the bytes, the same errors, named by the same step and sample."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import JOIN_TIMEOUT_S, MemorySource, drain
from tests.support.jpeg import KINDS, jpeg, write_files
from feeder import Feeder, FeederTimeoutError, SampleError, ops
from feeder.decode import extension
from feeder.sources import FileList
from feeder.synthetic import make_image

pytestmark = pytest.mark.skipif(extension.jpeg is None, reason="the region decoder is not built")

CHAIN = [ops.RandomResizedCrop(40), ops.RandomHorizontalFlip()]


def _noisy(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = make_image(h, w, seed=seed).astype(np.int16)
    return np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)


def _files(tmp_path) -> tuple[list[str], list[bytes]]:
    blobs = [jpeg(_noisy(h, w, 5 * n + h), kind, 90)
             for n, kind in enumerate(KINDS) for h, w in [(60, 44), (333, 400)]]
    return write_files(tmp_path, blobs), blobs


def _run(source, epochs: int = 3, **options) -> tuple[list, BaseException | None, None]:
    out = []
    with Feeder(source, 4, CHAIN, shuffle=True, seed=7, decode_threads=2, timeout=JOIN_TIMEOUT_S,
                **options) as f:
        for epoch in range(epochs):
            f.set_epoch(epoch)
            batches, error = drain(f)
            out += batches
            if error is not None:
                return out, error, None
    return out, None, None


def _same(a: list, b: list) -> None:
    assert len(a) == len(b) > 0
    for (x, y), (x2, y2) in zip(a, b):
        np.testing.assert_array_equal(y, y2)
        np.testing.assert_array_equal(x, x2)


def test_the_same_batches_as_when_the_read_step_reads(tmp_path):
    paths, blobs = _files(tmp_path)
    labels = list(range(len(paths)))
    fused, error, _ = _run(FileList(paths, labels))
    assert error is None
    in_memory, error, _ = _run(MemorySource(blobs))
    assert error is None
    unfused, error, _ = _run(FileList(paths, labels), augment_threads=1)
    assert error is None
    _same(fused, in_memory)
    _same(fused, unfused)


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_bad_file_fails_as_it_does_when_the_read_step_reads(tmp_path, damage):
    paths, blobs = _files(tmp_path)
    if damage == "missing":
        os.remove(paths[5])
    else:
        bad = bytearray(blobs[5])
        bad[len(bad) // 2:len(bad) // 2 + 40] = b"\x00" * 40
        with open(paths[5], "wb") as f:
            f.write(bytes(bad))
    errors = []
    for augment in (0, 1):  # fused read, and the read step reading the bytes
        _, error, _ = _run(FileList(paths, list(range(len(paths)))), augment_threads=augment)
        assert isinstance(error, SampleError), error
        errors.append(str(error))
    assert errors[0] == errors[1]
    assert "sample 5" in errors[0]
    assert ("read" if damage == "missing" else "DecodeError") in errors[0]
    for augment in (0, 1):
        out, error, _ = _run(FileList(paths, list(range(len(paths)))), epochs=2, on_error="skip",
                             augment_threads=augment)
        assert error is None
        assert sum(len(y) for _, y in out) == 2 * (len(paths) - 1)


def test_a_filelist_with_its_own_read_is_read_through_it(tmp_path):
    """A subclass that overrides read keeps its read: its samples, not the files'."""
    paths, blobs = _files(tmp_path)

    class Flipped(FileList):
        def read(self, index):
            data, label = super().read(index)
            return blobs[(index + 1) % len(blobs)], label

    got, error, _ = _run(Flipped(paths, list(range(len(paths)))))
    assert error is None
    want, error, _ = _run(MemorySource([blobs[(i + 1) % len(blobs)] for i in range(len(blobs))]))
    assert error is None
    _same(got, want)


class _Spy:
    """The extension, counting the fused calls that read a file themselves."""

    def __init__(self, ext) -> None:
        self._ext, self.paths = ext, 0

    def fused(self, data, *args):
        self.paths += isinstance(data, str)
        return self._ext.fused(data, *args)

    def __getattr__(self, name):
        return getattr(self._ext, name)


@pytest.mark.parametrize("read_threads", [0, 1])
def test_the_file_is_read_in_the_decode_call_only_where_the_decode_threads_read(
        tmp_path, monkeypatch, read_threads):
    """Without a read stage the decode call reads the file; with one, the read
    stage's threads only read (the decode stays in the decode threads) and the
    batches are the same."""
    paths, blobs = _files(tmp_path)
    spy = _Spy(extension.jpeg)
    monkeypatch.setattr(extension, "jpeg", spy)
    got, error, _ = _run(FileList(paths, list(range(len(paths)))), read_threads=read_threads)
    assert error is None
    if read_threads:
        assert spy.paths == 0
    else:
        assert spy.paths >= len(paths)  # every sample of every epoch, the first included
    want, error, _ = _run(MemorySource(blobs), read_threads=read_threads)
    assert error is None
    _same(got, want)


def test_a_read_replaced_on_the_instance_is_called(tmp_path):
    """A read set on the FileList itself (a wrapper that logs, retries or swaps
    the bytes) is what reads every sample, as without the fusion."""
    paths, blobs = _files(tmp_path)
    source = FileList(paths, list(range(len(paths))))
    calls = []

    def read(index):
        calls.append(index)
        return blobs[(index + 1) % len(blobs)], index

    source.read = read
    got, error, _ = _run(source, epochs=1)
    assert error is None
    assert sorted(calls) == list(range(len(paths)))
    want, error, _ = _run(MemorySource([blobs[(i + 1) % len(blobs)] for i in range(len(blobs))]), epochs=1)
    assert error is None
    _same(got, want)


def test_a_path_label_override_does_not_change_what_is_read(tmp_path):
    """A subclass's own path_label (here a name for its logs) leaves the file that
    read() reads, fused or not."""
    paths, _ = _files(tmp_path)

    class Named(FileList):
        def path_label(self, index):
            return os.path.basename(self.paths[index]), self.labels[index]

    fused, error, _ = _run(Named(paths, list(range(len(paths)))))
    assert error is None
    unfused, error, _ = _run(Named(paths, list(range(len(paths)))), augment_threads=1)
    assert error is None
    _same(fused, unfused)


def test_a_patched_module_reader_is_used(tmp_path, monkeypatch):
    from feeder import sources

    paths, blobs = _files(tmp_path)
    swapped = {p: blobs[(i + 1) % len(blobs)] for i, p in enumerate(paths)}
    monkeypatch.setattr(sources, "_read_file", lambda path: swapped[path])
    got, error, _ = _run(FileList(paths, list(range(len(paths)))), epochs=1)
    assert error is None
    want, error, _ = _run(MemorySource([swapped[p] for p in paths]), epochs=1)
    assert error is None
    _same(got, want)


def test_a_sample_stuck_in_the_fused_read_is_named_as_read_and_decoded(tmp_path):
    """Its time is the decode's as much as the read's: a timeout names both."""
    paths, _ = _files(tmp_path)
    fifo = str(tmp_path / "stuck.jpg")
    os.mkfifo(fifo)  # opening it blocks until a writer comes
    paths[0] = fifo
    try:
        with Feeder(FileList(paths, list(range(len(paths)))), 4, CHAIN, decode_threads=2,
                    timeout=1.0) as f:
            _, error = drain(f)
        assert isinstance(error, FeederTimeoutError), error
        assert "in stage 'read and decode'" in str(error), str(error)
        assert "stuck.jpg" in str(error)
    finally:
        # Let the blocked open go (the file then fails to decode, in a pass already stopped).
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
