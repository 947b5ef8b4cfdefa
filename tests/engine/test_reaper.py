"""feeder.engine.reaper: clean-ups that finalizers hand to the reaper thread."""

from __future__ import annotations

import gc
import threading

from feeder.engine import reaper as _reaper

from tests.support import JOIN_TIMEOUT_S, reaped


class Watched:
    """Something to free (a plain object() takes no weak reference)."""


def test_defer_runs_calls_in_order_in_the_reaper_thread():
    _reaper.ensure_running()
    got = []
    for i in range(5):
        _reaper.defer(lambda i=i: got.append((i, threading.current_thread().name)))
    reaped()
    assert got == [(i, _reaper.THREAD_NAME) for i in range(5)]


def test_watch_runs_the_call_once_the_object_is_freed():
    _reaper.ensure_running()
    done = threading.Event()
    obj = Watched()
    _reaper.watch(obj, done.set)
    reaped()
    assert not done.is_set()  # still alive: nothing ran
    del obj
    gc.collect()
    assert done.wait(JOIN_TIMEOUT_S)


def test_watch_all_runs_the_call_once_after_the_last_object_is_freed():
    _reaper.ensure_running()
    ran = []
    objs = [Watched(), Watched(), Watched()]
    _reaper.watch_all(objs, ran.append, "released")
    for _ in range(2):
        objs.pop(0)
        gc.collect()
        reaped()
        assert ran == []  # one is still alive
    objs.pop()
    gc.collect()
    reaped()
    assert ran == ["released"]


def test_unwatch_cancels_and_may_be_repeated():
    _reaper.ensure_running()
    ran = []
    obj = Watched()
    token = _reaper.watch(obj, ran.append, "cleaned")
    _reaper.unwatch(token)
    _reaper.unwatch(token)
    del obj
    gc.collect()
    reaped()
    assert ran == []


def test_a_failing_clean_up_does_not_stop_the_reaper(caplog):
    _reaper.ensure_running()

    def boom():
        raise RuntimeError("clean-up broke")

    _reaper.defer(boom)
    reaped()  # the next call still runs
    assert any(r.name == "feeder.engine.reaper" and r.exc_info and str(r.exc_info[1]) == "clean-up broke"
               for r in caplog.records)


def test_ensure_running_starts_one_thread():
    _reaper.ensure_running()
    _reaper.ensure_running()
    reapers = [t for t in threading.enumerate() if t.name == _reaper.THREAD_NAME]
    assert len(reapers) == 1 and reapers[0].daemon
