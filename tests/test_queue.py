"""Channels: bounded, closable, never hang."""

from __future__ import annotations

import threading

import pytest

from feeder._queue import END, Channel, Closed


def test_fifo_and_stats():
    ch = Channel("x", 3)
    for i in range(3):
        ch.put(i)
    assert [ch.get(timeout=1) for _ in range(3)] == [0, 1, 2]
    assert ch.max_depth == 3 and ch.puts == 3 and ch.mean_depth() == 2.0


def test_get_timeout():
    with pytest.raises(TimeoutError):
        Channel("x", 1).get(timeout=0.05)


@pytest.mark.parametrize("blocked", ["put", "get"])
def test_close_wakes_blocked_threads(blocked):
    ch = Channel("x", 1)
    if blocked == "put":
        ch.put(1)
    started, result = threading.Event(), []

    def run():
        started.set()
        try:
            ch.put(2) if blocked == "put" else ch.get()
        except Closed:
            result.append("closed")

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(5)
    ch.close()
    t.join(5)
    assert result == ["closed"]


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
