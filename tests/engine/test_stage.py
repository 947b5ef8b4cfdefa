"""Each stage built and driven alone: real channels, a stand-in control, no pass."""

from __future__ import annotations

import threading

import pytest

from feeder.engine.batch import BufferPool, Scratch
from feeder.engine.queue import END, Channel
from feeder.sample import Task
from feeder.engine.sampler import Sampler
from feeder.engine.stage import MapStage, Step

from tests.support.stage import TIMEOUT, Control, drain_channel, join


def run_map_stage(name, threads, steps, control, n):
    """Build and start a map stage, feed it ``n`` items and END, drain it, join it."""
    inbox, outbox = Channel("in", 4), Channel("out", 100)
    stage = MapStage(name, threads, steps, control, inbox, outbox)
    stage.start()
    for i in range(n):
        inbox.put(Item(i))
    inbox.put(END)
    out = drain_channel(outbox)
    join(stage)
    return stage, out


class Item:
    def __init__(self, index):
        self.index = index
        self.value = index


def test_map_stage_runs_its_steps_on_every_item_once_across_threads():
    control = Control()

    def double(item):
        item.value *= 2
        return item

    def plus_one(item):
        item.value += 1
        return item

    stage, out = run_map_stage("work", 3, (Step("double", double), Step("plus", plus_one)), control, 50)
    assert out[-1] is END and END not in out[:-1]
    assert sorted(item.value for item in out[:-1]) == [2 * i + 1 for i in range(50)]
    assert control.started == ["work"] * 3 and sorted(control.exited) == ["work"] * 3
    assert sum(c.items for c in stage.counters) == 50 and not control.failures


def test_map_stage_reports_a_failing_step_by_name_and_goes_on():
    control = Control()

    def read(item):
        if item.index == 3:
            raise OSError("unreadable")
        return item

    def decode(item):
        if item.index == 5:
            raise ValueError("corrupt")
        return None if item.index == 7 else item  # 7: consumed, nothing to send

    _, out = run_map_stage("decode", 2, (Step("read", read), Step("decode", decode)), control, 10)
    assert sorted(item.index for item in out[:-1]) == [0, 1, 2, 4, 6, 8, 9]
    assert sorted(control.failed_samples) == [("decode", 5, "ValueError"), ("read", 3, "OSError")]


def test_inline_step_is_timed_as_its_own_stage():
    control = Control()
    inbox, outbox = Channel("in", 4), Channel("out", 100)
    in_inline = threading.Event()
    go_on = threading.Event()

    def slow_inline(item):
        in_inline.set()
        assert go_on.wait(TIMEOUT)
        return item

    stage = MapStage("decode", 1, (Step("decode", lambda x: x), Step("augment", slow_inline, inline=True)),
                     control, inbox, outbox)
    stage.start()
    inbox.put(Item(0))
    assert in_inline.wait(TIMEOUT)
    c = stage.counters[0]
    assert c.waiting == c.INLINE and c.current[:2] == ("augment", 0)
    go_on.set()
    inbox.put(END)
    drain_channel(outbox)
    join(stage)
    assert c.inline_items == 1 and c.inline_s > 0


def test_first_step_must_be_the_stages_own():
    with pytest.raises(ValueError, match="first step"):
        MapStage("x", 1, (Step("augment", id, inline=True),), Control(), Channel("a", 1), Channel("b", 1))


def test_sampler_dispatches_tasks_in_order_with_buffers_owned_by_its_pass():
    control = Control()
    pool = BufferPool(8, 3, 2, 2, pin=False)
    owner = object()
    tasks, collate = Channel("decode", 100), Channel("collate", 10)
    sampler = Sampler(control, lambda: [9, 4, 7, 1, 0, 5, 3], 3, pool, owner, Scratch(2, 2), tasks, collate)
    sampler.start()
    out = drain_channel(tasks)
    join(sampler)
    got = out[:-1]
    assert [t.index for t in got] == [9, 4, 7, 1, 0, 5, 3]
    assert [(t.batch.index, t.slot) for t in got] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert all(isinstance(t, Task) for t in got)
    buffers = {id(t.batch.buffer) for t in got}
    assert len(buffers) == 3 and len(pool.owned_by(owner)) == 3  # the ledger knows whose they are
    assert control.exited == ["sampler"] and not control.failures


def test_sampler_puts_a_buffered_batchs_tasks_in_runs():
    """run=2: each item of a batch that has its buffer is a list of up to 2 of its
    tasks, in slot order; together, every task once."""
    control = Control()
    pool = BufferPool(8, 3, 2, 2, pin=False)
    tasks, collate = Channel("decode", 100), Channel("collate", 10)
    sampler = Sampler(control, lambda: [9, 4, 7, 1, 0, 5, 3], 3, pool, object(), Scratch(2, 2), tasks,
                      collate, run=2)
    sampler.start()
    out = drain_channel(tasks)
    join(sampler)
    items = out[:-1]
    # The first two batches had their buffers; the last may start without one
    # (the pool lends a third buffer once the decode queue runs dry), and such
    # a batch's first tasks go one by one.
    assert [len(item) for item in items[:4]] == [2, 1, 2, 1]
    assert all(type(item) is list and 1 <= len(item) <= 2 for item in items[:4])
    got = [t for item in items for t in (item if type(item) is list else [item])]
    assert all(isinstance(t, Task) for t in got)
    assert [t.index for t in got] == [9, 4, 7, 1, 0, 5, 3]
    assert [(t.batch.index, t.slot) for t in got] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert control.exited == ["sampler"] and not control.failures


def test_map_stage_runs_each_task_of_a_run_and_names_the_one_that_fails():
    """A run's tasks each go through the steps in turn; one that fails is the
    only one lost, named by its step and index."""
    control = Control()
    inbox, outbox = Channel("decode", 10), Channel("out", 100)

    def double(task):
        if task.index == 2:
            raise ValueError("bad sample")
        return task.index * 2

    stage = MapStage("decode", 1, [Step("decode", double)], control, inbox, outbox)
    stage.start()
    runs = [[Task(None, s, i) for s, i in enumerate(range(a, a + 3))] for a in (0, 3)]
    inbox.put_many([*runs, END])
    out = drain_channel(outbox)
    join(stage)
    assert out[:-1] == [0, 2, 6, 8, 10]
    assert control.failed_samples == [("decode", 2, "ValueError")] and not control.failures


def test_sampler_stops_waiting_for_a_buffer_when_stopped():
    control = Control()
    pool = BufferPool(1, 1, 1, 1, pin=False)
    held = pool.acquire(lambda: False)  # the only buffer: the sampler must wait
    tasks, collate = Channel("decode", 100), Channel("collate", 10)
    sampler = Sampler(control, lambda: [0, 1], 1, pool, object(), Scratch(1, 1), tasks, collate)
    sampler.start()
    first = tasks.get(timeout=TIMEOUT)  # dispatched ahead of its buffer
    assert first.index == 0 and first.batch.buffer is None
    control.stop = True
    join(sampler)
    assert control.exited == ["sampler"] and not control.failures
    pool.release(held)


def test_a_wait_ending_while_it_is_read_never_makes_the_totals_go_back(monkeypatch):
    """The thread reads its clock, then stores its finished wait; a reader in
    between counted the wait up to its own, later clock. What the reader
    reported stays: the totals never go back (stats() polled by another thread)."""
    import feeder.engine.stage as stage_mod

    clock = [0.0]
    monkeypatch.setattr(stage_mod, "_now", lambda: clock[0])
    c = stage_mod.Counters()
    c.begin_wait(stage_mod.Counters.WAIT_OUT)
    clock[0] = 10.0
    busy, _, wait_out, _ = c.totals()  # the reader: waiting for 10 s so far
    assert (busy, wait_out) == (0.0, 10.0)
    clock[0] = 5.0  # the thread's own clock read, taken before the reader's
    c.end_wait()
    clock[0] = 11.0
    later_busy, _, later_wait_out, _ = c.totals()
    assert later_wait_out >= wait_out and later_busy >= busy
    assert later_wait_out + later_busy == 11.0


def test_a_thread_ending_while_it_is_read_never_makes_the_busy_time_go_back(monkeypatch):
    """The thread ends its last wait and its loop between a reader's look at its
    state and at its end: the reader must not pair the open wait with the end
    (the wait would count in neither), or the next reading's busy time drops."""
    import feeder.engine.stage as stage_mod

    clock = [0.0]
    monkeypatch.setattr(stage_mod, "_now", lambda: clock[0])

    class Racing(stage_mod.Counters):
        """Counters whose thread ends (its wait, then its loop) when the reader
        first looks at ``ended`` after being armed."""

        __slots__ = ("_end", "armed")

        @property
        def ended(self):
            if getattr(self, "armed", False):
                self.armed = False
                clock[0] = 7.0
                self.end_wait()  # the wait of 1..7 s is over
                self._end = 8.0
            return self._end

        @ended.setter
        def ended(self, value):
            self._end = value

    c = Racing()
    clock[0] = 1.0
    c.begin_wait(stage_mod.Counters.WAIT_IN)
    clock[0] = 3.0
    readings = [c.totals()]  # busy 1 s, waiting for 2 s so far
    c.armed = True
    clock[0] = 9.0
    readings += [c.totals(), c.totals()]
    for before, after in zip(readings, readings[1:]):
        assert all(b >= a for a, b in zip(before, after)), readings
    assert readings[-1] == (2.0, 6.0, 0.0, 0.0)  # 8 s alive: 1 + 1 busy, 6 waiting
