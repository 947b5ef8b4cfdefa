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
