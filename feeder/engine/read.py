"""The read stage's bound on bytes: reads in flight are capped in count and in bytes.

Reads wait on storage; decoding waits on the CPU. The read stage has threads of
its own (``read_threads``, many: a thread blocked in a read costs no CPU) so
that a slow read never idles a decode thread. Its count bound is its threads
plus the decode inbox; its byte bound is :class:`ReadBudget`: bytes read and
not yet taken by a decode thread. A read thread that would pass it waits, as on
a full queue (the wait is counted as the stage's ``wait out``), except when
nothing is held, so one sample larger than the whole budget still passes.
"""

from __future__ import annotations

import dataclasses

import threading
import time
from typing import Any

from .queue import END, Channel, Closed
from .stage import Step

# Longest uninterrupted wait for budget: a closed pass is noticed this fast.
_POLL_S = 0.1


def nbytes(data: Any) -> int:
    """Size of what a source's ``read`` returned, in bytes (the same answer each time
    for the same object: it is charged and credited with it)."""
    size = getattr(data, "nbytes", None)  # memoryview, numpy
    if isinstance(size, int):
        return size
    if isinstance(data, (bytes, bytearray)):
        return len(data)
    if isinstance(data, dict):
        return sum(nbytes(v) for v in data.values())
    return 0


class ReadBudget:
    """Bytes read and not yet taken by the next stage, capped at ``limit``, and the
    turnstile through which read threads hand their samples over, one at a time,
    first come, first served.

    Why a turnstile: with a plain bounded queue, a producer blocked on a full
    queue is woken only once it drains to half, while a thread arriving with a
    fresh sample finds a free slot and takes it; the oldest samples lost that
    race again and again (the epoch's first batch came last), and waking the
    blocked herd cost CPU. Here each handing-over thread takes a ticket and waits
    on an event of its own; only the ticket being served waits for bytes and room.

    Args:
        limit: Most bytes held at once (bytes).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._room = threading.Condition(threading.Lock())  # bytes given back
        self._next_ticket = 0
        self._serving = 0
        self._waiting: dict[int, threading.Event] = {}

    def hand_over(self, item: Any, n: int, channel: Channel) -> None:
        """Put ``item`` (holding ``n`` bytes) into ``channel`` in arrival order, once
        the budget has room for it (always when nothing is held).

        Raises:
            Closed: the channel was closed while waiting.
        """
        turn = None
        with self._lock:
            ticket = self._next_ticket
            self._next_ticket += 1
            if self._serving != ticket:
                turn = self._waiting[ticket] = threading.Event()
        try:
            if turn is not None:
                while not turn.wait(_POLL_S):
                    if channel.closed:
                        raise Closed(channel.name)
            with self._room:
                while self.held and self.held + n > self.limit:
                    if channel.closed:
                        raise Closed(channel.name)
                    self._room.wait(_POLL_S)
                self.held += n
                if self.held > self.peak:
                    self.peak = self.held
            channel.put(item)  # the only producer now: it waits for room alone
        finally:
            with self._lock:
                self._waiting.pop(ticket, None)
                self._serving += 1
                nxt = self._waiting.get(self._serving)
            if nxt is not None:
                nxt.set()

    def give(self, n: int) -> None:
        """Release ``n`` bytes held by :meth:`hand_over`."""
        if not n:
            return
        with self._room:
            self.held -= n
            self._room.notify()


class BudgetedOutbox:
    """The read stage's outbox: a channel whose items also hold their bytes
    against a :class:`ReadBudget` until the next stage takes them."""

    def __init__(self, channel: Channel, budget: ReadBudget) -> None:
        self.channel = channel
        self.budget = budget

    def put(self, item: Any) -> None:
        if item is END:
            self.channel.put(item)
        else:
            self.budget.hand_over(item, nbytes(item.data), self.channel)


def releasing(step: Step, budget: ReadBudget) -> Step:
    """``step``, first releasing the bytes its task's data holds in ``budget``."""
    fn = step.fn

    def run(task: Any) -> Any:
        budget.give(nbytes(task.data))
        return fn(task)

    return dataclasses.replace(step, fn=run)


class ReadWaits:
    """How long the read stage's reads waited off the CPU (seconds: wall time less
    the thread's CPU time), for ``read_threads="auto"`` on a source that does not
    say whether its reads wait (see ``MeasuredReadThreads``). Only the reads the
    pipeline makes anyway are timed (two clock pairs per read), never an extra one.

    Args:
        keep: Most waits kept (the first ones; later reads are not timed).
    """

    def __init__(self, keep: int = 256) -> None:
        self.keep = keep
        # Appended by many read threads: list.append is atomic, and a few waits
        # past ``keep`` from a race are harmless.
        self.waits: list[float] = []

    def timed(self, step: Step) -> Step:
        """``step``, timing each call that returns until ``keep`` are timed."""
        fn, waits, keep = step.fn, self.waits, self.keep
        clock, cpu = time.perf_counter, time.thread_time

        def run(task: Any) -> Any:
            if len(waits) >= keep:
                return fn(task)
            wall, used = clock(), cpu()
            out = fn(task)
            waits.append(max(0.0, (clock() - wall) - (cpu() - used)))
            return out

        return dataclasses.replace(step, fn=run)
