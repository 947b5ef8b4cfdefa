"""Work that finalizers hand off, so that no finalizer ever takes a lock.

The garbage collector runs finalizers (``weakref.finalize`` callbacks) in
whatever thread allocated when a collection triggered, in the middle of
whatever that thread was doing, possibly while it holds one of feeder's locks:
a pass iterator caught in a reference cycle is freed by the cyclic collector
inside whichever code allocates next. A finalizer that took such a lock would
deadlock its thread on itself (a plain ``Lock``) or re-enter a critical section
half-way through (an ``RLock``). So every finalizer in feeder does exactly one
thing: :func:`defer` puts the call on a :class:`queue.SimpleQueue`, whose
``put`` is documented as reentrant (safe from ``__del__`` and weakref
callbacks), and one process-wide daemon thread, ``feeder-reaper``, runs it
with ordinary locking.

Lock audit (what a finalizer or a signal can reach):

* Finalizers: a dropped pass iterator (stops its pass), a dropped CPU batch
  view (returns its buffer to the pool), an unclosed :class:`~feeder.Feeder`
  (stops its engine). All three go through :func:`defer`.
* Signals: feeder installs no signal handler. ``KeyboardInterrupt`` is raised
  in the main thread between bytecodes; ``with lock:`` blocks release their
  locks as it unwinds, and ``next()`` stops the pass in ordinary code after.

The reaper is started from ordinary code (building a feeder, starting a pass)
and never from a finalizer, since starting a thread takes threading's own
locks. After ``fork`` the child has no reaper thread; the next feeder call in
the child starts one, and it runs whatever was deferred meanwhile.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

THREAD_NAME = "feeder-reaper"

_calls: "queue.SimpleQueue[tuple[Callable[..., Any], tuple]]" = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def defer(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` soon in the reaper thread. Safe from any finalizer: takes no lock."""
    _calls.put((fn, args))


def ensure_running() -> None:
    """Start the reaper thread if it is not running. Not for finalizers (takes locks)."""
    global _thread
    t = _thread
    if t is not None and t.is_alive():
        return
    with _start_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name=THREAD_NAME, daemon=True)
            _thread.start()


def _run() -> None:
    while True:
        fn, args = _calls.get()
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - cleanup must never kill the reaper
            log.exception("feeder cleanup %r failed", fn)
        # Drop the references before waiting: an engine held here while the
        # reaper idles would never be freed.
        del fn, args


def _after_fork_in_child() -> None:
    # The reaper thread does not exist in the child, and the old queue may have
    # been mid-operation in it at the fork: start over with fresh objects.
    global _calls, _thread, _start_lock
    pending = []
    try:
        while True:
            pending.append(_calls.get_nowait())
    except Exception:  # noqa: BLE001 - an inconsistent queue is dropped, not fatal
        pass
    _calls = queue.SimpleQueue()
    for item in pending:
        _calls.put(item)
    _thread = None
    _start_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
