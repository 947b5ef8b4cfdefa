"""Starting the worker process: the start-method rule (``start_method="auto"``),
holding feeder's own threads still for a fork, the collector's freeze, and the
launch. The design note ``docs/design/isolated-engine.md`` says why each step
is there."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..engine import reaper as _reaper
from ..engine.config import Config
from ..engine.engine import live_engines
from ..engine.stage import of_ended_pass
from ..engine.threads import LibraryThreads
from ..errors import ConfigError, FeederError, safe_text
from . import protocol as msg
from .worker import worker_main

log = logging.getLogger(__name__)

# How long the fork check waits, in all, for the threads of ended passes to exit
# (see quiet_threads); they have left their loops, so it is milliseconds.
_SETTLE_S = 0.5


def worker_config(config: Config) -> Config:
    """The worker's configuration: the CPU stages only (dtype, normalization and
    batch transforms run in the training process's transfer stage)."""
    return dataclasses.replace(config, device=torch.device("cpu"), dtype=None, normalize=None,
                               batch_transforms=(), isolation="thread", start_method="auto")


def payload(config: Config, source: Any, transforms: list[Any], method: str = "spawn",
            chosen: str = "") -> bytes:
    """What the worker is built from, pickled; an object that cannot be sent is a
    :class:`~feeder.errors.ConfigError` naming it and how to fix it. ``chosen``:
    why ``start_method="auto"`` chose ``method`` (empty when it was given)."""
    config = worker_config(config)
    parts = [("source", source)] + [(f"transforms[{i}]", t) for i, t in enumerate(transforms)]
    pickled = []
    for what, obj in parts:
        try:
            pickled.append(msg.dumps(obj))
        except Exception as exc:  # noqa: BLE001 - pickle raises many types
            # Under "auto" the user never asked for a pickling start method: say why it ran.
            auto = f"start_method='auto' chose {method} because {chosen}; " if chosen else ""
            raise ConfigError(
                f"{auto}isolation='process' with start_method={method!r} sends the {what} "
                f"({safe_text(repr(obj))}) to a worker process, but it cannot be pickled "
                f"({type(exc).__name__}: {exc}); define it at module level (a module-level "
                f"function or class instead of a lambda, a local function or a bound object "
                f"holding open handles), use start_method='fork' (Linux: nothing is pickled), "
                f"or isolation='thread'"
            ) from exc
    return msg.dumps((config, pickled[0], pickled[1:]))


def start_rule() -> tuple[str, str]:
    """``start_method="auto"`` before looking at the threads: the method and why."""
    if not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return "spawn", f"auto: no safe fork on {sys.platform}"
    if torch.cuda.is_initialized():
        return "spawn", "auto: CUDA is initialized in this process, and its state is not fork-safe"
    return "fork", "auto: Linux, CUDA not initialized, no other thread running"


@contextlib.contextmanager
def quiet_threads() -> Iterator[list[str]]:
    """Hold feeder's own idle threads still; yield the names of every other running thread.

    The reaper and the isolated engines' receiving threads hold a lock while
    they work. Taking it shows one idle (blocked on its queue or pipe, holding
    nothing) and keeps it so until the fork is done; one still at work when the
    wait below ends, and any other thread but the caller, is named.

    feeder's own threads finish what they do in moments: the threads of a pass
    that has ended (the loop took its end, or it was stopped) are still exiting,
    the reaper may be closing a feeder just dropped, a receiving thread handling
    a message. Not waiting for them would make the choice depend on timing (a
    pass run to its end just before ``Feeder(...)``). So the ended passes'
    threads are joined and the locks taken with a wait, ``_SETTLE_S`` in all;
    the reaper's first, as its work may wait for a receiving thread's answer."""
    me = threading.current_thread()
    deadline = time.monotonic() + _SETTLE_S
    for thread in threading.enumerate():
        if thread is not me and of_ended_pass(thread):
            thread.join(max(0.0, deadline - time.monotonic()))
    quiet: dict[threading.Thread, threading.Lock] = {}
    reaper = _reaper.quiet_lock()
    if reaper is not None:
        quiet[reaper[0]] = reaper[1]
    for engine in live_engines():
        for thread, lock in engine.quiet_locks():
            quiet[thread] = lock
    held: list[threading.Lock] = []
    idle: set[threading.Thread] = set()
    try:
        for thread, lock in quiet.items():  # in insertion order: the reaper's first
            if thread.is_alive() and lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                held.append(lock)
                idle.add(thread)
        yield [t.name for t in threading.enumerate() if t is not me and t not in idle]
    finally:
        for lock in held:
            lock.release()


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Fork with the parent's objects in the collector's permanent generation.

    The child then never traverses them: a collection writes to every object it
    visits, which would copy the parent's whole heap page by page into the
    worker (copy-on-write)."""
    if gc.get_freeze_count():  # the program freezes objects itself: leave it alone
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Start the worker with SIGINT ignored: an ignored signal stays ignored across
    exec, and Python keeps it so, so a Ctrl-C during its start-up cannot kill it
    with a traceback (the worker ignores it again itself, for other threads)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_worker(config: Config, source: Any, transforms: list[Any]) -> tuple[Any, Any, str]:
    """Start the worker by the start-method rule (``docs/design/isolated-engine.md``).

    Returns:
        This process's end of the control pipe, the worker process, and the
        start method used.
    """
    requested = config.placement.start_method
    if requested == "auto":
        method, why = start_rule()
    else:
        if requested not in multiprocessing.get_all_start_methods():
            raise ConfigError(f"start_method={requested!r} is not available on this platform "
                              f"({sys.platform}); it offers "
                              f"{multiprocessing.get_all_start_methods()}")
        method, why = requested, "given"
    if method == "fork":
        with quiet_threads() as others:
            if not others or requested == "fork":
                if others:
                    log.warning("start_method='fork' while other threads run (%s): a lock "
                                "one of them holds stays held in the worker process; "
                                "start_method='auto' would spawn", ", ".join(others))
                return _launch("fork", (worker_config(config), source, list(transforms)), why)
            why = (f"other threads are running ({', '.join(others)}): a lock one of them "
                   f"holds would stay held in a forked child")
            method = "spawn"
    chosen = why.removeprefix("auto: ") if requested == "auto" else ""
    return _launch(method, payload(config, source, transforms, method, chosen), why)


def _launch(method: str, data: Any, why: str) -> tuple[Any, Any, str]:
    ctx = multiprocessing.get_context(method)
    mine, theirs = ctx.Pipe()
    # A forked worker closes its copy of this process's end first thing.
    parent = None if method == "forkserver" else os.getpid()
    # The fork server's worker is its child, whichever thread asked for it.
    watch = method == "forkserver" or threading.current_thread() is threading.main_thread()
    # A pickled payload goes over the control pipe once the worker runs (see
    # _send_payload), not in the start method's own arguments.
    later = isinstance(data, bytes)
    args = (theirs, None if later else data, parent, mine if method == "fork" else None, watch)
    process = ctx.Process(target=worker_main, args=args, name="feeder-worker", daemon=True)
    try:
        with _sigint_ignored():
            if method == "fork":
                with LibraryThreads.parked(), _gc_frozen(), warnings.catch_warnings():
                    # Python 3.12+ warns of any fork with threads: these were checked.
                    warnings.filterwarnings("ignore", r".*fork\(\) may lead to deadlocks",
                                            DeprecationWarning)
                    process.start()
            else:
                process.start()
    except BaseException:
        mine.close()
        theirs.close()
        raise
    theirs.close()  # only the worker holds that end now: its death is EOF here
    log.info("feeder worker process %d started with %s (%s)", process.pid, method, why)
    if later:
        _send_payload(mine, process, data)
    return mine, process, method


# How long a worker that broke the pipe is given to finish exiting, for its exit code.
_EXIT_WAIT_S = 5.0


def _send_payload(conn: Any, process: Any, data: bytes) -> None:
    """Send the worker what it is built from, first thing on the control pipe.

    The start method's own pipe would hang here: ``spawn`` writes its arguments
    while this process still holds the pipe's other end, so a worker that dies
    before reading them all (an import that fails in the fresh interpreter, or a
    script without an ``if __name__ == "__main__":`` guard starting a second
    feeder while it is imported there) leaves a write of more than the pipe's
    buffer (64 KiB) waiting forever. Only the worker holds the far end of the
    control pipe, so its death fails this write at once.
    """
    try:
        conn.send_bytes(data)
    except OSError as exc:
        process.join(_EXIT_WAIT_S)
        conn.close()
        raise FeederError(
            f"the feeder's worker process (pid {process.pid}) exited with code {process.exitcode} "
            f"before it had read the source and transforms ({len(data)} bytes); its error, if "
            f"it printed one, is above. A start method that imports the script again "
            f"(spawn, forkserver) runs its module-level code in the worker: a script that "
            f"builds a Feeder at module level must do so under 'if __name__ == \"__main__\":'"
        ) from exc
