"""Bounded, closable queues: the edges between stages.

Every edge of the pipeline is a :class:`Channel`. It is bounded (``maxsize``),
and closing it wakes every thread blocked on it, so shutdown never depends on
a producer or consumer making progress. Waits also re-check the closed flag on
a short timeout, which keeps ``KeyboardInterrupt`` prompt on the main thread.
A blocked thread sleeps on a semaphore that is posted without holding the GIL
(:class:`_Wakeup`): waking it must not stall the training thread's Python.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os
import threading
import time
from typing import Any

# Upper bound on one uninterrupted wait. Closing a channel notifies waiters at
# once; the timeout only bounds how long a signal handler may be delayed.
_POLL_S = 0.1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc_semaphores() -> tuple[Any, Any, Any] | None:
    """libc's ``sem_init``, ``sem_post`` and a wait with an absolute deadline on
    ``CLOCK_MONOTONIC`` (``sem_clockwait``, glibc 2.30+), through ctypes; or None.

    ``sem_timedwait`` is not used: its deadline is on the wall clock, and a step
    of the wall clock backwards would stretch every wait (and ``get``'s timeout).
    """
    if not hasattr(time, "CLOCK_MONOTONIC"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        init, post, clockwait = libc.sem_init, libc.sem_post, libc.sem_clockwait
    except (OSError, AttributeError):
        return None
    init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    post.argtypes = [ctypes.c_void_p]
    clockwait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Timespec)]

    def wait(sem: int, timeout: float) -> None:
        deadline = time.clock_gettime(time.CLOCK_MONOTONIC) + timeout
        sec = int(deadline)
        clockwait(sem, time.CLOCK_MONOTONIC,
                  ctypes.byref(_Timespec(sec, min(999_999_999, int((deadline - sec) * 1e9)))))
    return init, post, wait


_SEM = _libc_semaphores() if os.name == "posix" else None


class _Wakeup:
    """A counting semaphore whose ``post`` does not hold the GIL.

    Waking a sleeping thread is a system call in which the kernel may switch
    to the woken thread at once, on the waker's own core. A Python lock's
    release makes that call holding the GIL, so for the whole switch no
    Python code runs anywhere: the training thread's next torch call waits
    too. Profiled (``bench/experiments/gil_profile.py``, decode thread and
    sampler sharing a core), those wake-ups were about a quarter of the
    decode thread's GIL time. libc's semaphores called through ctypes release the
    GIL around the call, so the switch happens with the GIL free. Where they
    are missing (not POSIX, or ``sem_init`` unsupported), a ``threading``
    semaphore does the same job, GIL held. A wait that a signal interrupts
    returns early (the caller looks again), so Ctrl-C stays prompt.
    """

    __slots__ = ("_sem", "_fallback")

    def __init__(self) -> None:
        self._sem = None
        self._fallback: threading.Semaphore | None = None
        if _SEM is not None:
            # sem_t is 32 bytes on 64-bit glibc, 16 on 32-bit; 64 word-aligned bytes cover both.
            sem = (ctypes.c_long * 8)()
            if _SEM[0](ctypes.addressof(sem), 0, 0) == 0:
                self._sem = sem
        if self._sem is None:
            self._fallback = threading.Semaphore(0)

    def post(self, n: int = 1) -> None:
        """Wake up to ``n`` waiters (a post with no waiter is kept for the next wait)."""
        if self._sem is None:
            self._fallback.release(n)
            return
        post, address = _SEM[1], ctypes.addressof(self._sem)
        for _ in range(n):
            post(address)

    def wait(self, timeout: float) -> None:
        """Return after a post, after ``timeout`` seconds, or on a signal, whichever comes first."""
        if self._sem is None:
            self._fallback.acquire(timeout=timeout)
            return
        _SEM[2](ctypes.addressof(self._sem), timeout)


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

#: What :meth:`Channel.poll` returns from an empty channel (never an item).
EMPTY = object()


class Channel:
    """A bounded FIFO between two stages that can be closed from any thread.

    Args:
        name: Edge name shown in stats (``"decode"`` is the decode stage's inbox).
        maxsize: Most items held at once (>= 1).
    """

    __slots__ = ("name", "maxsize", "_low_water", "_items", "_lock", "_closed", "puts",
                 "max_depth", "depth_sum", "_getters", "_putters", "_count_lock", "wakeups", "_room",
                 "_ready")

    def __init__(self, name: str, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"channel {name!r}: maxsize must be >= 1, got {maxsize}")
        self.name = name
        self.maxsize = maxsize
        # A blocked producer is woken only once the channel has drained to a
        # quarter (the pipeline's task queues hold 4 items per consumer thread:
        # one left for each), so it refills 3 items per wake-up instead of 2 at
        # half: each wake-up is two context switches on a loaded core, and the
        # producer refills from what it has in hand far faster than the
        # consumers drain what is left.
        self._low_water = maxsize // 4
        self._items: collections.deque = collections.deque()
        # Only close() takes it. Re-entrant: a garbage-collected feeder or pass
        # iterator stops its pass from a finalizer, which runs in whatever thread
        # the collector interrupted, possibly one inside close().
        self._lock = threading.RLock()
        self._closed = False
        # Waiting threads sleep on these, not on a Condition (see _Wakeup):
        # producers for room, consumers for an item.
        self._room = _Wakeup()
        self._ready = _Wakeup()
        # Threads waiting (or about to) in get/put; see the note above put().
        self._getters = 0
        self._putters = 0
        # Several producers update the counters: ``+=`` is not atomic under the GIL,
        # so they have a lock of their own (a C lock: no Python code per put).
        self._count_lock = threading.Lock()
        self.puts = 0
        self.max_depth = 0
        self.depth_sum = 0
        # Times a get woke blocked producers (each costs the consumer a context switch).
        self.wakeups = 0

    # Fast paths take no lock: deque append/popleft are atomic under the GIL, and
    # the lock (a pure-Python Condition) was the largest GIL-held cost per item
    # in profiles. A thread about to sleep registers as a waiter *before* its
    # last look at the deque, and the other side looks at the waiter count
    # *after* changing the deque and then posts; a post is kept until a wait
    # takes it, so a wake-up cannot be lost. A post nobody needed (the waiter
    # found its item or room on its last look) makes one later wait return
    # early, to look again. The short wait timeout is a second line of
    # defence, not the mechanism.

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
            self._ready.post()

    def put_many(self, items: list) -> None:
        """:meth:`put` each of ``items`` in turn, in one call: as many as there is
        room for at a time, the same counters kept (each item's depth right after
        it, as if put alone), waking at most one getter per item.

        Raises:
            Closed: the channel was closed before or while waiting (the items not
                yet put are dropped, as a closed channel's are).
        """
        queued = self._items
        maxsize = self.maxsize
        start, n = 0, len(items)
        while start < n:
            if self._closed:
                raise Closed(self.name)
            room = maxsize - len(queued)
            if room <= 0:
                self._wait_for_room()
                room = maxsize - len(queued)
                if room <= 0:  # another producer filled it first: one item, as put() would
                    room = 1
            end = min(n, start + room)
            before = len(queued)
            queued.extend(items[start:end])
            if self._closed:  # close() ran between the check above and the extend
                queued.clear()
                raise Closed(self.name)
            k = end - start
            with self._count_lock:
                self.puts += k
                # Depths right after each item: before + 1 ... before + k.
                self.depth_sum += k * before + k * (k + 1) // 2
                if before + k > self.max_depth:
                    self.max_depth = before + k
            getters = self._getters
            if getters:
                self._ready.post(min(k, getters))
            start = end

    def _wait_for_room(self) -> None:
        # A post made between this thread's last look and its wait is kept by
        # the semaphore, so no wake-up is lost; a stale one (a post for a
        # producer that had already found room) only costs one more look.
        with self._count_lock:
            self._putters += 1  # registered before the last look at the deque (see above)
        try:
            while not self._closed and len(self._items) >= self.maxsize:
                self._room.wait(_POLL_S)
        finally:
            with self._count_lock:
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
        item = self.poll()
        if item is EMPTY:
            item = self._wait_for_item(timeout)
            if self._putters and len(self._items) <= self._low_water:
                self._wake_putters()
        return item

    def poll(self) -> Any:
        """:meth:`get` without waiting: the oldest item, or :data:`EMPTY` when there
        is none (a stage times only the waits that :meth:`get` then makes).

        Raises:
            Closed: the channel is closed.
        """
        if self._closed:
            raise Closed(self.name)
        try:
            item = self._items.popleft()
        except IndexError:
            return EMPTY
        if self._putters and len(self._items) <= self._low_water:
            self._wake_putters()
        return item

    def _wake_putters(self) -> None:
        """The channel drained to its low-water mark: wake the blocked producers."""
        with self._count_lock:
            self.wakeups += 1
        self._room.post(self._putters)

    def _wait_for_item(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._count_lock:
            self._getters += 1  # registered before the last look at the deque (see above)
        try:
            while True:
                if self._closed:
                    raise Closed(self.name)
                try:
                    return self._items.popleft()
                except IndexError:
                    pass
                wait = _POLL_S
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise TimeoutError(f"nothing on channel {self.name!r}") from None
                self._ready.wait(wait)
        finally:
            with self._count_lock:
                self._getters -= 1

    def close(self) -> list:
        """Close the channel, wake every waiter and return what was still queued. Safe to repeat."""
        with self._lock:
            self._closed = True
            left = list(self._items)
            self._items.clear()
        self._ready.post(self._getters + 1)
        self._room.post(self._putters + 1)
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
