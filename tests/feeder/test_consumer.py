"""feeder._consumer: the iterator the training loop holds (PassIterator), seen
through its seams: a pass started at the first next(), each batch told to
``delivered`` (BatchInfo), the end, in-band errors, the timeout and the warning
about stuck samples, threads sharing one iterator, and a dropped iterator."""

from __future__ import annotations

import gc
import logging
import threading
import types

import numpy as np
import pytest
import torch

import feeder._consumer as consumer
from feeder._consumer import BatchInfo, PassHooks, PassIterator
from feeder.engine import reaper
from feeder.engine.queue import END, Channel
from feeder.engine.transfer import Delivery, Failure
from feeder.errors import FeederError, FeederTimeoutError

from tests.support import JOIN_TIMEOUT_S, run_in_thread


class FakePool:
    def __init__(self):
        self.waiting: list[bool] = []
        self.claimed: list = []

    def set_consumer_waiting(self, flag):
        self.waiting.append(flag)

    def claim(self, lent):
        self.claimed.append(lent)


class FakePass:
    """What PassIterator uses of a running pass: its output channel, its error,
    stop/fail, the samples in flight."""

    def __init__(self, epoch=2):
        self.output = Channel("output", 16)
        self.orphaned = False
        self.output_ended = False
        self.pool = FakePool()
        self.error = None
        self.stopped = threading.Event()
        self.replaced = False
        self.epoch = epoch
        self.cfg = types.SimpleNamespace(device=torch.device("cpu"))
        self.flight: list[tuple[str, int, str, float]] = []

    def fail(self, error):
        if self.error is None:
            self.error = error
        self.stop()

    def stop(self):
        self.stopped.set()
        self.output.close()

    def in_flight(self, older_than=0.0):
        return [f for f in self.flight if f[3] > older_than]

    def was_replaced(self):
        return self.replaced


class FakeProgress:
    def __init__(self, first_batch=0):
        self.first_batch = self.batches = first_batch
        self.recorded: list[list[int]] = []
        self.ended = False

    def record(self, indices):
        self.recorded.append([int(i) for i in indices])
        self.batches += 1

    def skipped(self):
        return []


class FakeBook:
    def __init__(self):
        self.samples = 0
        self.waits: list = []

    def delivered(self, n):
        self.samples += n

    def consumer_waiting(self, since):
        self.waits.append(since)


class Harness:
    def __init__(self, timeout=None, first_batch=0):
        self.run = FakePass()
        self.progress = FakeProgress(first_batch)
        self.book = FakeBook()
        self.infos: list[BatchInfo] = []
        self.starts = 0
        self.hooks = PassHooks(start=self._start, book=self.book, delivered=self.infos.append,
                               length=lambda: 5, cuda=False, timeout=timeout)

    def _start(self):
        reaper.ensure_running()  # as the feeder's start does: the thread that stops dropped passes
        self.starts += 1
        return self.run, self.progress

    def iterator(self):
        return PassIterator(self.hooks)


def delivery(number, indices, lent=None):
    idx = np.asarray(indices, np.int64)
    return Delivery(torch.full((len(idx), 3, 2, 2), number, dtype=torch.uint8), torch.from_numpy(idx * 10),
                    idx, number, None, lent=lent)


def test_the_pass_starts_at_the_first_next_and_batches_are_told():
    h = Harness(first_batch=3)
    h.run.output.put(delivery(0, [4, 1]))
    h.run.output.put(delivery(1, [0], lent="buffer-7"))
    h.run.output.put(END)
    it = h.iterator()
    assert iter(it) is it and len(it) == 5 and h.starts == 0  # nothing started yet
    images, labels = next(it)
    assert h.starts == 1 and images.shape == (2, 3, 2, 2) and labels.tolist() == [40, 10]
    images, labels = next(it)
    assert int(images[0, 0, 0, 0]) == 1 and h.run.pool.claimed == ["buffer-7"]
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(StopIteration):
        next(it)  # again: still the end, no second pass
    assert h.starts == 1 and h.progress.ended and h.progress.recorded == [[4, 1], [0]]
    assert [(i.epoch, i.number, i.indices.tolist()) for i in h.infos] == [(2, 3, [4, 1]), (2, 4, [0])]
    assert h.infos[0].indices.dtype == torch.int64
    assert h.book.samples == 3
    # The wait is marked around every get, and the pool told the loop waits, then not.
    assert h.run.pool.waiting[:2] == [True, False] and h.book.waits[1] is None


def test_an_error_in_band_is_raised_once_then_the_iterator_ends():
    h = Harness()
    error = ValueError("broken source")
    h.run.output.put(delivery(0, [0]))
    h.run.output.put(Failure(error))
    it = h.iterator()
    next(it)
    with pytest.raises(ValueError) as err:
        next(it)
    assert err.value is error and h.run.stopped.is_set()
    assert h.run.error is None  # moved into the iterator: the pass keeps no traceback
    with pytest.raises(StopIteration):
        next(it)


def test_threads_sharing_an_iterator_all_learn_the_error():
    h = Harness()
    it = h.iterator()
    error = OSError("disk gone")
    start = threading.Barrier(3, timeout=JOIN_TIMEOUT_S)
    got: list = []

    def take():
        start.wait()
        try:
            next(it)
        except BaseException as exc:  # noqa: BLE001 - what the thread was given
            got.append(exc)

    threads = [threading.Thread(target=take, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    start.wait()
    h.run.output.put(Failure(error))
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        assert not t.is_alive()
    assert got == [error, error] and h.starts == 1


def test_threads_sharing_an_iterator_start_one_pass_and_all_end():
    h = Harness()
    it = h.iterator()
    n = 4
    start = threading.Barrier(n, timeout=JOIN_TIMEOUT_S)
    for k in range(n - 1):
        h.run.output.put(delivery(k, [k]))
    h.run.output.put(END)
    taken: list = []

    def drain():
        start.wait()
        mine = []
        for images, _ in it:
            mine.append(int(images[0, 0, 0, 0]))
        taken.append(mine)

    threads = [threading.Thread(target=drain, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        assert not t.is_alive(), "a thread sharing the iterator missed the end"
    assert h.starts == 1 and sorted(sum(taken, [])) == list(range(n - 1)) and len(taken) == n


def test_timeout_names_the_samples_stuck_longer_than_it():
    h = Harness(timeout=0.05)
    h.run.flight = [("read", 7, "shard-3/img7.jpg", 9.5), ("decode", 2, "b.jpg", 0.01)]
    it = h.iterator()
    with pytest.raises(FeederTimeoutError) as err:
        run_in_thread(lambda: next(it))
    msg = str(err.value)
    assert "no batch within timeout=0.05 s" in msg
    assert "sample 7 (shard-3/img7.jpg) in stage 'read' for 9.5 s" in msg and "b.jpg" not in msg
    assert h.run.stopped.is_set() and h.run.error is None


def test_timeout_without_stuck_samples_says_the_pipeline_is_slow():
    h = Harness(timeout=0.02)
    h.run.flight = [("decode", 2, "b.jpg", 0.001)]
    with pytest.raises(FeederTimeoutError, match=r"no sample has been in a stage for that long "
                                                 r"\(1 in flight\): the pipeline is slower.*; the oldest: "
                                                 r"sample 2 \(b.jpg\) in stage 'decode' for 0.0 s"):
        run_in_thread(lambda: next(h.iterator()))


def test_timeout_message_lists_at_most_eight_samples():
    run = FakePass()
    run.flight = [("read", k, f"{k}.jpg", 100.0) for k in range(11)]
    msg = consumer._timeout_message(run, 1.0, 1.2)
    assert "sample 7 (7.jpg)" in msg and "8.jpg" not in msg and "and 3 more" in msg


def test_a_stuck_sample_is_named_in_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(consumer, "STUCK_WARNING_S", 0.0)
    monkeypatch.setattr(consumer, "_WATCH_S", 0.005)
    h = Harness(timeout=0.1)  # several watch periods before the timeout
    h.run.flight = [("read", 3, "slow/mount.jpg", 61.0)]
    with caplog.at_level(logging.WARNING, logger="feeder._consumer"):
        with pytest.raises(FeederTimeoutError):
            run_in_thread(lambda: next(h.iterator()))
    warnings = [r.getMessage() for r in caplog.records if "has been in stage" in r.getMessage()]
    assert len(warnings) == 1
    assert "sample 3 (slow/mount.jpg)" in warnings[0] and "'read' for 61 s" in warnings[0]


def test_a_pass_of_a_forked_parent_is_refused():
    h = Harness()
    h.run.orphaned = True
    with pytest.raises(FeederError, match="started before the process forked"):
        next(h.iterator())


def test_a_pass_replaced_by_a_newer_one_says_so():
    h = Harness()
    it = h.iterator()
    h.run.output.put(delivery(0, [0]))
    next(it)
    h.run.replaced = True
    h.run.stop()
    with pytest.raises(FeederError, match="a new pass of the same feeder started"):
        next(it)


def test_a_pass_stopped_without_error_ends_the_iterator():
    h = Harness()
    it = h.iterator()
    h.run.output.put(delivery(0, [0]))
    next(it)
    h.run.stop()
    with pytest.raises(StopIteration):
        next(it)


def test_an_interrupt_while_waiting_stops_the_pass():
    h = Harness()

    class Interrupted:
        def get(self, timeout=None):
            raise KeyboardInterrupt

        def close(self):
            return []

    h.run.output = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        next(h.iterator())
    assert h.run.stopped.is_set() and h.run.pool.waiting == [True, False]
    assert h.book.waits[-1] is None


def test_a_dropped_iterator_stops_its_pass():
    h = Harness()
    h.run.output.put(delivery(0, [0]))
    it = h.iterator()
    next(it)
    del it
    gc.collect()
    assert h.run.stopped.wait(JOIN_TIMEOUT_S)  # stopped by the reaper thread


def test_an_iterator_never_started_leaves_no_pass():
    h = Harness()
    it = h.iterator()
    del it
    gc.collect()
    assert h.starts == 0 and not h.run.stopped.is_set()
