"""feeder.engine.stats: the StatsBook that folds every thread's and queue's counters
into ``Feeder.stats()``, and the Stats it prints."""

from __future__ import annotations

import logging

import pytest

from feeder.engine.queue import Channel
from feeder.engine.stats import ACTIVE_HISTORY, QueueStats, StageStats, Stats, StatsBook


class FixedCounters:
    """A stage thread's counters (the interface of ``feeder.engine.stage.Counters``) with set figures."""

    def __init__(self, items, busy, wait_in, wait_out, inline=0.0, inline_items=0, cpu_s=0.0):
        self.items, self.inline_items, self.cpu_s = items, inline_items, cpu_s
        self.figures = (busy, wait_in, wait_out, inline)

    def totals(self):
        return self.figures


def test_live_and_folded_counters_count_once():
    book = StatsBook({"decode": 2, "augment": 0})
    a, b = FixedCounters(10, 1.0, 0.5, 0.25), FixedCounters(5, 2.0, 0.0, 0.0)
    book.attach_thread("decode", a)
    book.attach_thread("decode", b)
    live = book.snapshot().stage("decode")
    book.fold_thread("decode", a)
    book.fold_thread("decode", a)  # a second fold of the same thread adds nothing
    book.fold_thread("decode", b)
    folded = book.snapshot().stage("decode")
    assert live == folded == StageStats("decode", 2, 15, 3.0, 0.5, 0.25)


def test_decode_threads_running_the_transforms_report_them_as_augment():
    book = StatsBook({"decode": 2, "augment": 0})
    book.attach_thread("decode", FixedCounters(8, 1.0, 0.5, 0.0, inline=3.0, inline_items=8))
    s = book.snapshot()
    decode, augment = s.stage("decode"), s.stage("augment")
    assert (augment.items, augment.busy_s, augment.threads, augment.utilization) == (8, 3.0, 0, 0.0)
    assert decode.inline_s == 3.0 and decode.busy_s == 1.0
    assert decode.utilization == pytest.approx(4.0 / 4.5)
    assert "augment     inline" in str(s)


def test_queue_figures_from_channels():
    book = StatsBook({"decode": 1})
    ch = Channel("decode", 4)
    book.attach_channel(ch)
    for i in range(3):
        ch.put(i)  # depths 1, 2, 3 right after each put
    ch.get()
    live = book.snapshot().queues
    assert live == (QueueStats("decode", 4, 2, 2.0, 3),)
    book.fold_channel(ch)
    book.fold_channel(ch)  # safe to repeat: counted once
    assert book.snapshot().queues == (QueueStats("decode", 4, 0, 2.0, 3),)  # no live depth once folded


def test_delivered_and_skipped_counts_and_the_first_skip_is_logged(caplog):
    book = StatsBook({"decode": 1})
    book.delivered(8)
    book.delivered(3)
    with caplog.at_level(logging.WARNING, logger="feeder"):
        assert book.skipped("a.jpg", ValueError("bad")) == 1
        assert book.skipped("a.jpg", ValueError("bad")) == 2  # a later epoch: counted, not logged
        assert book.skipped("b.jpg", ValueError("worse")) == 3
    s = book.snapshot(buffers=4)
    assert (s.samples, s.batches, s.skipped, s.buffers) == (11, 2, 3, 4)
    assert s.skipped_paths == ("a.jpg", "a.jpg", "b.jpg")
    assert [r.getMessage() for r in caplog.records] == ["skipped a.jpg: bad", "skipped b.jpg: worse"]


def test_a_wait_in_next_counts_while_it_lasts():
    book = StatsBook({"decode": 1})
    book.start()
    assert book.snapshot().waiting_in_next == 0
    book.consumer_waiting(0.0)  # began long ago (perf_counter's epoch)
    ongoing = book.snapshot()
    assert ongoing.waiting_in_next == 1 and ongoing.consumer_wait_s > 0
    book.consumer_waiting(None)
    done = book.snapshot()
    assert done.waiting_in_next == 0 and done.consumer_wait_s >= ongoing.consumer_wait_s
    book.consumer_waiting(None)  # no wait in progress: nothing changes
    assert book.snapshot().consumer_wait_s == done.consumer_wait_s


def test_active_threads_history_is_bounded_and_read_back():
    book = StatsBook({"decode": 4, "read": 16})
    assert book.last_active("decode") is None
    for n in range(ACTIVE_HISTORY + 5):
        book.record_active("decode", n % 4 + 1)
    book.record_active("read", 7)
    s = book.snapshot()
    assert len(s.active_threads) == ACTIVE_HISTORY
    assert s.active("read") == 7 == book.last_active("read")
    assert s.active("decode") == (ACTIVE_HISTORY + 4) % 4 + 1 == book.last_active("decode")
    assert s.active("augment") is None
    assert "decode threads tuned" in str(s) and "read threads tuned: 7 active now (of 16)" in str(s)


def test_stats_derived_figures_and_table():
    stages = (StageStats("sampler", 1, 4, 0.1, 0.0, 0.9),
              StageStats("decode", 2, 32, 3.0, 1.0, 0.0),
              StageStats("transfer", 1, 4, 0.2, 1.8, 0.0, cpu_s=0.04))
    s = Stats(stages, (QueueStats("decode", 8, 1, 2.5, 8),), samples=32, batches=4, skipped=0,
              consumer_wait_s=1.0, elapsed_s=4.0, buffers=3)
    assert s.starvation == 0.25
    assert s.bottleneck == "decode"  # the sampler's utilization does not count
    assert s.stage("transfer").cpu_per_item_s == pytest.approx(0.01)
    with pytest.raises(KeyError):
        s.stage("augment")
    text = str(s)
    assert text.startswith("feeder: 32 samples in 4 batches, 4.00 s (8 samples/s)")
    assert "25.0% of elapsed" in text and "busiest stage: decode" in text
    assert "transfer thread CPU: 10.00 ms per batch" in text
    empty = Stats((), (), 0, 0, 0, 0.0, 0.0, 0)
    assert empty.starvation == 0.0 and empty.bottleneck == "none"
