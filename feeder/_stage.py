"""The one stage abstraction: threads, queue waits, end propagation, error
wrapping and stats live here once; a concrete stage says what it does to an item.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ._queue import END, Channel, Closed
from ._threads import limit_torch_threads
from .errors import StageError

if TYPE_CHECKING:
    from ._pipeline import Pass

log = logging.getLogger(__name__)
_now = time.perf_counter


class Counters:
    """One thread's stats. Only its own thread writes them, so no lock is needed."""

    __slots__ = ("items", "_wait_in_s", "_wait_out_s", "started", "ended", "_since", "_waiting",
                 "inline_items", "inline_s")

    def __init__(self) -> None:
        self.items = 0
        # Work of the next stage done in this thread (decode threads running the
        # transforms when there is no augment pool): reported as that stage's.
        self.inline_items = 0
        self.inline_s = 0.0
        self._wait_in_s = 0.0
        self._wait_out_s = 0.0
        self.started = _now()
        self.ended: float | None = None
        self._since = 0.0
        self._waiting = 0  # 0: working, 1: waiting for input, 2: waiting to output

    # A wait in progress counts too, so a snapshot of a stalled pipeline shows
    # its threads as waiting, not busy.
    def begin_wait(self, kind: int) -> None:
        self._since = _now()
        self._waiting = kind

    def end_wait(self) -> None:
        waited = _now() - self._since
        if self._waiting == 1:
            self._wait_in_s += waited
        else:
            self._wait_out_s += waited
        self._waiting = 0

    def _ongoing(self, kind: int) -> float:
        return _now() - self._since if self._waiting == kind and self.ended is None else 0.0

    @property
    def wait_in_s(self) -> float:
        return self._wait_in_s + self._ongoing(1)

    @property
    def wait_out_s(self) -> float:
        return self._wait_out_s + self._ongoing(2)

    def busy_s(self) -> float:
        """Seconds alive minus seconds waiting on either queue and inline work of the next stage."""
        end = self.ended if self.ended is not None else _now()
        return max(0.0, end - self.started - self.wait_in_s - self.wait_out_s - self.inline_s)


def timed_put(c: Counters, channel: Channel, item: Any) -> None:
    """``channel.put(item)``, its blocked time counted as ``c``'s wait on output."""
    c.begin_wait(2)
    try:
        channel.put(item)
    finally:
        c.end_wait()


class Stage:
    """A named group of threads that take items from ``inbox`` and give to ``outbox``.

    Subclasses implement :meth:`work` (a whole thread loop) or, for one item at
    a time, subclass :class:`MapStage`. The base gives every thread timed
    ``get``/``put`` helpers, turns an unexpected exception into a failure of the
    pass, and exits quietly when the pass closes its channels.
    """

    name = "stage"

    def __init__(self, run: "Pass", threads: int, inbox: Channel | None, outbox: Channel | None) -> None:
        self.run = run
        self.num_threads = threads
        self.inbox = inbox
        self.outbox = outbox
        self.counters: list[Counters] = []
        self._lock = threading.Lock()
        self._running = threads
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.num_threads):
            c = Counters()
            self.counters.append(c)
            name = f"feeder-{self.name}" if self.num_threads == 1 else f"feeder-{self.name}-{i}"
            t = threading.Thread(target=self._main, args=(c,), name=name, daemon=True)
            self.threads.append(t)
            t.start()

    def _main(self, c: Counters) -> None:
        try:
            limit_torch_threads()  # N workers each fanning out over all cores would oversubscribe
            self.work(c)
        except Closed:
            pass  # the pass is shutting down
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the consumer
            err = StageError(self.name, f"{type(exc).__name__}: {exc}")
            err.__cause__ = exc
            self.run.fail(err)
        finally:
            c.ended = _now()
            self.run.thread_exited(self, c)

    def work(self, c: Counters) -> None:
        raise NotImplementedError

    # Timed queue access: waiting time is what the stats call wait_in / wait_out.
    def get(self, c: Counters) -> Any:
        c.begin_wait(1)
        try:
            return self.inbox.get()
        finally:
            c.end_wait()

    def put(self, c: Counters, channel: Channel, item: Any) -> None:
        timed_put(c, channel, item)

    def end_thread(self, c: Counters) -> None:
        """This thread saw END: pass it to siblings; the last thread out sends it downstream."""
        # The inbox has room: this thread just took END out of it and upstream is done.
        self.inbox.put(END)
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last and self.outbox is not None:
            self.put(c, self.outbox, END)


class MapStage(Stage):
    """A stage that handles one sample task at a time; failures are per sample."""

    def work(self, c: Counters) -> None:
        process = self.process
        failed = self.run.sample_failed
        while True:
            task = self.get(c)
            if task is END:
                self.end_thread(c)
                return
            try:
                process(task, c)
            except Closed:
                raise
            except Exception as exc:
                failed(self.name, task, exc, c)
            except BaseException as exc:
                # SystemExit or KeyboardInterrupt raised by user code: never
                # skippable, but the training loop still learns which sample.
                self.run.fail(self.run.sample_error(self.name, task, exc))
                return
            c.items += 1

    def process(self, task: Any, c: Counters) -> None:
        raise NotImplementedError
