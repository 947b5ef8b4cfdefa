"""The sampler hands a batch's tasks to the decode threads in runs of several
(``pipeline.task_run``): the same batches as one task at a time, a failing
sample skipped alone, every other sample once."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import JOIN_TIMEOUT_S, MemorySource, drain
from tests.support.jpeg import jpeg
from feeder import Feeder, ops
from feeder.engine import pipeline
from feeder.engine.threads import ThreadOptions
from feeder.synthetic import make_image

CHAIN = [ops.RandomResizedCrop(24), ops.RandomHorizontalFlip()]


def _blobs(n: int) -> list[bytes]:
    blobs = [jpeg(make_image(30 + i % 7, 40 - i % 5, seed=i), "444", 90) for i in range(n)]
    blobs[37] = blobs[37][: len(blobs[37]) // 2] + b"\x00" * 64  # damaged: skipped
    return blobs


def _run(runs: list[int], monkeypatch, size: int, **options) -> tuple[list, int]:
    real = pipeline.task_run

    def spy(threads, batch_size):
        runs.append(real(threads, batch_size) if size is None else size)
        return runs[-1]

    monkeypatch.setattr(pipeline, "task_run", spy)
    out, skipped = [], 0
    with Feeder(MemorySource(_blobs(150)), 32, CHAIN, shuffle=True, seed=3, decode_threads=2,
                on_error="skip", timeout=JOIN_TIMEOUT_S, **options) as f:
        for epoch in range(2):
            f.set_epoch(epoch)
            batches, error = drain(f)
            assert error is None
            out += batches
        skipped = f.stats().skipped
    return out, skipped


@pytest.mark.parametrize("options", [{}, {"read_threads": 2}, {"augment_threads": 1}],
                         ids=["inline", "read-stage", "augment-pool"])
def test_runs_give_the_same_batches_as_single_tasks(monkeypatch, options):
    runs: list[int] = []
    got, skipped = _run(runs, monkeypatch, None, **options)
    if options.get("read_threads"):
        assert set(runs) == {1}  # each read thread waits on one read at a time
    else:
        # 32 samples, 2 decode threads: runs of 4 (a first pass that times the
        # reads of a source that does not say whether they wait has a read stage)
        assert runs[-1] == 4 and set(runs) <= {1, 4}
    want, skipped_one = _run([], monkeypatch, 1, **options)
    assert skipped == skipped_one == 2  # the damaged sample, once an epoch
    assert len(got) == len(want) > 0
    for (x, y), (x2, y2) in zip(got, want):
        np.testing.assert_array_equal(y, y2)
        np.testing.assert_array_equal(x, x2)
    labels = np.concatenate([y for _, y in got])
    assert sorted(labels.tolist()) == sorted([i for i in range(150) if i != 37] * 2)


@pytest.mark.parametrize("decode_threads, batch_size", [(1, 64), (2, 64), (4, 64), (3, 256), (2, 8)])
def test_a_batch_without_its_buffer_has_a_run_for_every_decode_thread(decode_threads, batch_size):
    # The samples dispatched before the batch has its buffer keep every decode
    # thread busy while the loop hands its batch back: at least one run each.
    threads = ThreadOptions(decode_threads, 0, 0)
    run = pipeline.task_run(threads, batch_size)
    n = pipeline.unbuffered_samples(threads, batch_size)
    assert n >= decode_threads * run and n >= threads.decode_queue
    items = -(-n // run)
    assert items >= decode_threads
