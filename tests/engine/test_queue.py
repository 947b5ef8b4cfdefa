"""Channels: bounded, closable, never hang."""

from __future__ import annotations

import threading
import time

import pytest

from feeder.engine.queue import EMPTY, END, Channel, Closed


def test_fifo_and_stats():
    ch = Channel("x", 3)
    for i in range(3):
        ch.put(i)
    assert [ch.get(timeout=1) for _ in range(3)] == [0, 1, 2]
    assert ch.max_depth == 3 and ch.puts == 3 and ch.mean_depth() == 2.0


def test_get_timeout():
    with pytest.raises(TimeoutError):
        Channel("x", 1).get(timeout=0.05)


def closed_while_blocked(ch: Channel, blocked) -> list[str]:
    """Run ``blocked()`` in a thread, close ``ch``, and return what the thread saw."""
    started, result = threading.Event(), []

    def run():
        started.set()
        try:
            blocked()
        except Closed:
            result.append("closed")

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(5)
    ch.close()
    t.join(5)
    assert not t.is_alive()
    return result


@pytest.mark.parametrize("blocked", ["put", "get"])
def test_close_wakes_blocked_threads(blocked):
    ch = Channel("x", 1)
    if blocked == "put":
        ch.put(1)
    assert closed_while_blocked(ch, (lambda: ch.put(2)) if blocked == "put" else ch.get) == ["closed"]


def test_close_returns_leftovers_and_end_is_a_singleton():
    ch = Channel("x", 2)
    ch.put(END)
    assert ch.close() == [END] and ch.closed
    assert type(END)() is END and repr(END) == "END"
    with pytest.raises(ValueError):
        Channel("y", 0)


def test_many_producers_and_consumers_exactly_once_and_bounded():
    """Lock-free fast paths: no item lost or duplicated, depth stays within
    maxsize plus one per extra producer, every thread finishes."""
    ch = Channel("x", 4)
    producers, consumers, per = 4, 3, 3000
    got: list[list[int]] = [[] for _ in range(consumers)]

    def produce(p):
        for i in range(per):
            ch.put(p * per + i)

    def consume(k):
        while True:
            item = ch.get(timeout=10)
            if item is END:
                ch.put(END)  # pass the end on to the other consumers
                return
            got[k].append(item)

    ps = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    cs = [threading.Thread(target=consume, args=(k,)) for k in range(consumers)]
    for t in ps + cs:
        t.start()
    for t in ps:
        t.join(30)
    ch.put(END)
    for t in cs:
        t.join(30)
    assert not any(t.is_alive() for t in ps + cs)
    flat = sorted(x for g in got for x in g)
    assert flat == list(range(producers * per))
    assert ch.max_depth <= 4 + producers - 1


def test_poll_takes_a_ready_item_or_says_empty_and_wakes_producers():
    ch = Channel("x", 4)
    assert ch.poll() is EMPTY
    ch.put_many([1, 2, 3, 4])
    producer = threading.Thread(target=ch.put, args=(5,))
    producer.start()  # blocks on the full channel (or finds room after the polls)
    got = [ch.poll() for _ in range(4)]
    producer.join(10)  # woken by the poll that drained the channel to a quarter
    assert not producer.is_alive()
    got.append(ch.poll())
    assert got == [1, 2, 3, 4, 5] and ch.poll() is EMPTY
    ch.close()
    with pytest.raises(Closed):
        ch.poll()


def test_put_many_is_put_of_each_item_bounded_and_in_order():
    """The sampler puts a batch's tasks in one call: the same order, bound and
    counters as one put per item, waiting for room as the consumer drains it."""
    one, many = Channel("x", 4), Channel("x", 4)
    for i in range(3):
        one.put(i)
    many.put_many([0, 1, 2])
    assert (many.puts, many.max_depth, many.depth_sum) == (one.puts, one.max_depth, one.depth_sum)
    ch = Channel("x", 4)
    got: list[int] = []

    def consume():
        while True:
            item = ch.get(timeout=10)
            if item is END:
                return
            assert ch.depth() <= 4
            got.append(item)

    t = threading.Thread(target=consume)
    t.start()
    for start in range(0, 1000, 37):
        ch.put_many(list(range(start, min(1000, start + 37))))
    ch.put(END)
    t.join(30)
    assert not t.is_alive() and got == list(range(1000))
    assert ch.puts == 1001 and ch.max_depth <= 4


def test_put_many_on_a_closed_channel_raises():
    ch = Channel("x", 2)
    ch.put(0)
    ch.put(1)
    assert closed_while_blocked(ch, lambda: ch.put_many([2, 3, 4])) == ["closed"]
    with pytest.raises(Closed):
        ch.put_many([5])


def test_a_blocked_producer_is_woken_once_the_channel_drains_to_a_quarter():
    """Each wake-up costs the consumer a context switch while it holds the GIL:
    a full channel of 8 wakes its producer when 2 items are left, not before."""
    ch = Channel("x", 8)
    for i in range(8):
        ch.put(i)
    waiting = threading.Event()

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def wait(self, timeout):
            waiting.set()  # the producer is about to sleep on the full channel
            self.inner.wait(timeout)

        def post(self, n=1):
            self.inner.post(n)

    ch._room = Spy(ch._room)
    producer = threading.Thread(target=ch.put, args=(8,))
    producer.start()
    assert waiting.wait(5)
    got = [ch.get(timeout=5) for _ in range(5)]  # 3 left: above a quarter
    assert ch.wakeups == 0
    got.append(ch.get(timeout=5))  # 2 left: the producer is woken
    assert ch.wakeups == 1
    producer.join(5)
    assert not producer.is_alive()
    got += [ch.get(timeout=5) for _ in range(3)]
    assert got == list(range(9)) and ch.depth() == 0


@pytest.mark.parametrize("native", [True, False])
def test_wakeup_keeps_a_post_for_the_next_wait_and_times_out(monkeypatch, native):
    """A post made before the wait is not lost (a producer registers, looks, then
    sleeps: the consumer may post in between); without a post the wait times out."""
    import feeder.engine.queue as q

    if not native:
        monkeypatch.setattr(q, "_SEM", None)
    w = q._Wakeup()
    assert (w._sem is not None) == (native and q._SEM is not None)
    w.post(2)
    done = threading.Event()

    def waiter():
        w.wait(30)  # returns at once: the posts are kept
        w.wait(30)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert done.wait(10)
    t.join(5)
    t0 = time.monotonic()
    w.wait(0.05)  # nothing posted: back after the timeout, not never
    assert time.monotonic() - t0 >= 0.04
