"""Work that finalizers hand off, so that no finalizer takes a lock or runs Python code.

:func:`watch` registers a weak reference whose callback is ``SimpleQueue.put``
itself (reentrant C: freeing a watched object runs no Python bytecode in the
freeing thread); one process-wide daemon thread, ``feeder-reaper``, runs the
registered calls with ordinary locking; :func:`defer` queues a call directly.
Why, the lock audit and the fork rules: docs/design/finalizers.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

THREAD_NAME = "feeder-reaper"

# Items: (fn, args) from defer(), or a dead weak reference from watch().
_calls: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
# id(weak reference) -> (the reference, fn, args). The reference is kept here, so
# its id stays unique, until the reaper has run its call or unwatch() dropped it.
_watched: dict[int, tuple[weakref.ref, Callable[..., Any], tuple]] = {}
_thread: threading.Thread | None = None
_start_lock = threading.Lock()
_STOP = object()  # tells the reaper thread to return
_LOOK_AGAIN_S = 0.5  # see the note on fork above
_exiting = False
# Held while the reaper runs a call: an isolated engine forks only while it can
# take this (see ``feeder.isolation.start.quiet_threads``), so no clean-up is half-way
# through, holding a lock, in the forked child.
busy = threading.Lock()
# True from the moment the reaper takes an item off the queue until its call has
# run (the item is then neither queued nor running under ``busy``). Written by the
# reaper thread only; a bool assignment needs no lock.
_in_hand = False


def quiet_lock() -> tuple[threading.Thread, threading.Lock] | None:
    """The reaper thread, if one was started, and the lock it holds while it runs a
    call (see ``feeder.isolation.start.quiet_threads``)."""
    t = _thread
    return None if t is None else (t, busy)


def pending() -> bool:
    """Whether a freed object's call (or a deferred one) is queued or running:
    work that may be about to give something back. Takes no lock; a hint that
    is at most one call out of date."""
    return _in_hand or busy.locked() or not _calls.empty()


def defer(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` soon in the reaper thread. Takes no lock."""
    _calls.put((fn, args))


def watch(obj: Any, fn: Callable[..., Any], *args: Any) -> int:
    """Run ``fn(*args)`` in the reaper thread once ``obj`` has been freed.

    ``args`` must not refer to ``obj`` (it would never be freed). Returns a
    token for :func:`unwatch`.
    """
    ref = weakref.ref(obj, _calls.put)
    _watched[id(ref)] = (ref, fn, args)
    return id(ref)


class _Countdown:
    """Runs ``fn(*args)`` at its ``count``-th call. Called in the reaper thread only,
    one call at a time, so it needs no lock."""

    __slots__ = ("left", "fn", "args")

    def __init__(self, count: int, fn: Callable[..., Any], args: tuple) -> None:
        self.left, self.fn, self.args = count, fn, args

    def __call__(self) -> None:
        self.left -= 1
        if self.left == 0:
            fn, args = self.fn, self.args
            self.fn = self.args = None  # hold nothing once done
            fn(*args)


def watch_all(objs: list[Any], fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` in the reaper thread once every object of ``objs`` has
    been freed (several views of one resource: it is free when the last goes).

    ``args`` must not refer to any of ``objs``."""
    countdown = _Countdown(len(objs), fn, args)
    for obj in objs:
        watch(obj, countdown)


def unwatch(token: int) -> None:
    """Cancel a :func:`watch`; safe to repeat."""
    _watched.pop(token, None)


def ensure_running() -> None:
    """Start the reaper thread if it is not running. Not for finalizers (takes locks)."""
    global _thread
    t = _thread
    if (t is not None and t.is_alive()) or _exiting:
        return
    with _start_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name=THREAD_NAME, daemon=True)
            _thread.start()


def _run() -> None:
    global _in_hand
    while True:
        _in_hand = False
        try:
            item = _calls.get(timeout=_LOOK_AGAIN_S)
        except queue.Empty:
            continue
        _in_hand = True
        if item is _STOP:
            _in_hand = False
            return
        if isinstance(item, weakref.ref):
            entry = _watched.pop(id(item), None)
            del item
            if entry is None:
                continue  # unwatched
            _, fn, args = entry
            del entry
        else:
            fn, args = item
            del item
        with busy:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - cleanup must never kill the reaper
                log.exception("feeder cleanup %r failed", fn)
        # Drop the references before waiting: an engine held here while the
        # reaper idles would never be freed.
        del fn, args


def _stop_at_exit() -> None:
    """Stop the reaper before the interpreter finalizes. Its last collection frees
    watched objects, whose clean-up would then run in this daemon thread while
    Python shuts down: a thread that frees a torch tensor releases the GIL, and
    taking it back during finalization ends the thread from inside torch's C++
    code, which aborts the whole process ("terminate called without an active
    exception"). What is queued after this point is dropped with the process."""
    global _exiting
    _exiting = True
    t = _thread
    if t is not None and t.is_alive():
        _calls.put(_STOP)
        t.join(0.5)


atexit.register(_stop_at_exit)


def _after_fork_in_child() -> None:
    # The reaper thread does not exist in the child: the next feeder call starts one.
    # The queue is a new one too, holding what was queued: the parent's reaper may
    # have been waiting in get(), and a queue's wait state is not the child's (a
    # call put there was seen only at the next put, so a batch the loop dropped
    # never came back to the pool, and a new pass waited for it forever).
    global _thread, _start_lock, busy, _calls, _in_hand
    _thread = None
    _start_lock = threading.Lock()
    busy = threading.Lock()
    _in_hand = False
    inherited, fresh = _calls, queue.SimpleQueue()
    while True:
        try:
            fresh.put(inherited.get_nowait())
        except queue.Empty:
            break
    _calls = fresh


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
