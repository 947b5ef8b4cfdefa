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
                 "_closed", "puts", "max_depth", "_depth_sum", "_getters", "_putters")

    def __init__(self, name: str, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"channel {name!r}: maxsize must be >= 1, got {maxsize}")
        self.name = name
        self.maxsize = maxsize
        # A blocked producer is woken only once the channel has drained to half:
        # waking it for every freed slot costs two context switches per item.
        self._low_water = maxsize // 2
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._closed = False
        # Threads waiting in get/put. Condition.notify is pure Python and was the
        # largest GIL-held cost per item in profiles, so it is skipped when nobody waits.
        self._getters = 0
        self._putters = 0
        self.puts = 0
        self.max_depth = 0
        self._depth_sum = 0

    def put(self, item: Any) -> None:
        """Append ``item``, blocking while the channel is full.

        Raises:
            Closed: the channel was closed before or while waiting.
        """
        with self._not_full:
            while len(self._items) >= self.maxsize:
                if self._closed:
                    raise Closed(self.name)
                self._putters += 1
                try:
                    self._not_full.wait(_POLL_S)
                finally:
                    self._putters -= 1
            if self._closed:
                raise Closed(self.name)
            self._items.append(item)
            depth = len(self._items)
            self.puts += 1
            self._depth_sum += depth
            if depth > self.max_depth:
                self.max_depth = depth
            if self._getters:
                self._not_empty.notify()

    def get(self, timeout: float | None = None) -> Any:
        """Remove and return the oldest item, blocking while the channel is empty.

        Args:
            timeout: Seconds to wait at most; ``None`` waits until an item or close.

        Raises:
            Closed: the channel is closed (items still queued are discarded).
            TimeoutError: ``timeout`` passed with nothing to get.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_empty:
            while not self._items:
                if self._closed:
                    raise Closed(self.name)
                wait = _POLL_S
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise TimeoutError(f"nothing on channel {self.name!r}")
                self._getters += 1
                try:
                    self._not_empty.wait(wait)
                finally:
                    self._getters -= 1
            if self._closed:
                raise Closed(self.name)
            item = self._items.popleft()
            if self._putters and len(self._items) <= self._low_water:
                self._not_full.notify_all()
            return item

    def close(self) -> list:
        """Close the channel, wake every waiter and return what was still queued. Safe to repeat."""
        with self._lock:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()
        return left

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> int:
        return len(self._items)

    def mean_depth(self) -> float:
        """Mean depth seen right after each put (how full producers keep it)."""
        return self._depth_sum / self.puts if self.puts else 0.0
