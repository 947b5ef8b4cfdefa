"""Bounded, closable queues: the edges between stages.

Every edge of the pipeline is a :class:`Channel`. It is bounded (``maxsize``),
and closing it wakes every thread blocked on it, so shutdown never depends on
a producer or consumer making progress. Waits also re-check the closed flag on
a short timeout, which keeps ``KeyboardInterrupt`` prompt on the main thread.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

# Upper bound on one uninterrupted wait. Closing a channel notifies waiters at
# once; the timeout only bounds how long a signal handler may be delayed.
_POLL_S = 0.1


class Closed(Exception):
    """Raised by :meth:`Channel.put` and :meth:`Channel.get` once the channel is closed."""


class _End:
    """End-of-stream marker, compared by identity, never confused with data."""

    _instance = None

    def __new__(cls) -> "_End":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "END"


END = _End()


class Channel:
    """A bounded FIFO between two stages that can be closed from any thread.

    Args:
        name: Edge name shown in stats (``"decode"`` is the decode stage's inbox).
        maxsize: Most items held at once (>= 1).
    """

    __slots__ = ("name", "maxsize", "_low_water", "_items", "_lock", "_not_empty", "_not_full",
                 "_closed", "puts", "max_depth", "depth_sum", "_getters", "_putters", "_count_lock")

    def __init__(self, name: str, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"channel {name!r}: maxsize must be >= 1, got {maxsize}")
        self.name = name
        self.maxsize = maxsize
        # A blocked producer is woken only once the channel has drained to half:
        # waking it for every freed slot costs two context switches per item.
        self._low_water = maxsize // 2
        self._items: collections.deque = collections.deque()
        # Re-entrant: a garbage-collected feeder or pass iterator stops its pass
        # from a finalizer, which runs in whatever thread the collector
        # interrupted, possibly one inside this very channel.
        self._lock = threading.RLock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._closed = False
        # Threads waiting (or about to) in get/put; see the note above put().
        self._getters = 0
        self._putters = 0
        # Several producers update the counters: ``+=`` is not atomic under the GIL,
        # so they have a lock of their own (a C lock: no Python code per put).
        self._count_lock = threading.Lock()
        self.puts = 0
        self.max_depth = 0
        self.depth_sum = 0

    # Fast paths take no lock: deque append/popleft are atomic under the GIL, and
    # the lock (a pure-Python Condition) was the largest GIL-held cost per item
    # in profiles. A thread about to sleep registers as a waiter *before* its
    # last look at the deque, and the other side looks at the waiter count
    # *after* changing the deque, so a wake-up cannot be lost; the short wait
    # timeout is a second line of defence, not the mechanism.

    def put(self, item: Any) -> None:
        """Append ``item``, blocking while the channel is full.

        With several producers the depth may pass ``maxsize`` by at most one
        item per other producer (they can see room at the same moment).

        Raises:
            Closed: the channel was closed before or while waiting.
        """
        if self._closed:
            raise Closed(self.name)
        items = self._items
        if len(items) >= self.maxsize:
            self._wait_for_room()
        items.append(item)
        if self._closed:  # close() ran between the check above and the append
            items.clear()
            raise Closed(self.name)
        depth = len(items)
        with self._count_lock:
            self.puts += 1
            self.depth_sum += depth
            if depth > self.max_depth:
                self.max_depth = depth
        if self._getters:
            with self._lock:
                self._not_empty.notify()

    def _wait_for_room(self) -> None:
        with self._lock:
            self._putters += 1  # registered before the last look at the deque (see above)
            try:
                while not self._closed and len(self._items) >= self.maxsize:
                    self._not_full.wait(_POLL_S)
            finally:
                self._putters -= 1
            if self._closed:
                raise Closed(self.name)

    def get(self, timeout: float | None = None) -> Any:
        """Remove and return the oldest item, blocking while the channel is empty.

        Args:
            timeout: Seconds to wait at most; ``None`` waits until an item or close.

        Raises:
            Closed: the channel is closed (items still queued are discarded).
            TimeoutError: ``timeout`` passed with nothing to get.
        """
        if self._closed:
            raise Closed(self.name)
        try:
            item = self._items.popleft()
        except IndexError:
            item = self._wait_for_item(timeout)
        if self._putters and len(self._items) <= self._low_water:
            with self._lock:
                self._not_full.notify_all()
        return item

    def _wait_for_item(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._closed:
                    raise Closed(self.name)
                self._getters += 1
                try:
                    try:
                        return self._items.popleft()
                    except IndexError:
                        pass
                    wait = _POLL_S
                    if deadline is not None:
                        wait = min(wait, deadline - time.monotonic())
                        if wait <= 0:
                            raise TimeoutError(f"nothing on channel {self.name!r}") from None
                    self._not_empty.wait(wait)
                finally:
                    self._getters -= 1

    def close(self) -> list:
        """Close the channel, wake every waiter and return what was still queued. Safe to repeat."""
        with self._lock:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()
        return left

    def abandon(self) -> None:
        """In a forked child, for a channel of a pass whose threads are gone: drop the
        items without the lock (a thread that no longer exists may hold it)."""
        self._closed = True
        self._items.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> int:
        return len(self._items)

    def mean_depth(self) -> float:
        """Mean depth seen right after each put (how full producers keep it)."""
        return self.depth_sum / self.puts if self.puts else 0.0
