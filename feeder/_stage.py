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
    """One thread's stats. Only its own thread writes them, so no lock is needed.

    A reader in another thread (``Feeder.stats()``) must see values that never
    go backwards, so the wait bookkeeping lives in one tuple that is replaced
    whole (one attribute store, atomic under the GIL): a reader can never see a
    finished wait both added to its total and still counted as ongoing.
    """

    __slots__ = ("items", "_state", "started", "ended", "inline_items", "current")

    # What the thread is doing, as kept in the state tuple.
    WORKING, WAIT_IN, WAIT_OUT, INLINE = 0, 1, 2, 3

    def __init__(self) -> None:
        self.items = 0
        # Samples of the next stage handled in this thread (decode threads running
        # the transforms when there is no augment pool): reported as that stage's.
        self.inline_items = 0
        # (seconds waiting for input, waiting to output, doing the next stage's
        # work inline, when the current one began, which one: a kind above)
        self._state: tuple[float, float, float, float, int] = (0.0, 0.0, 0.0, 0.0, 0)
        self.started = _now()
        self.ended: float | None = None
        # (phase, sample index, since): the sample this thread works on, for
        # naming samples stuck in a stage (``Feeder(timeout=...)``); None between samples.
        self.current: tuple[str, int, float] | None = None

    # A wait in progress counts too, so a snapshot of a stalled pipeline shows
    # its threads as waiting, not busy.
    def begin_wait(self, kind: int) -> None:
        wi, wo, inl, _, _ = self._state
        self._state = (wi, wo, inl, _now(), kind)

    def end_wait(self) -> None:
        wi, wo, inl, since, kind = self._state
        d = _now() - since
        if kind == 1:
            wi += d
        elif kind == 2:
            wo += d
        elif kind == 3:
            inl += d
        self._state = (wi, wo, inl, 0.0, 0)

    def totals(self) -> tuple[float, float, float, float]:
        """(busy, wait in, wait out, inline) seconds so far, ongoing waits included."""
        wi, wo, inl, since, kind = self._state
        end = self.ended
        now = _now() if end is None else end
        if kind and end is None:
            d = now - since
            if kind == 1:
                wi += d
            elif kind == 2:
                wo += d
            else:
                inl += d
        return max(0.0, now - self.started - wi - wo - inl), wi, wo, inl

    @property
    def waiting(self) -> int:
        """What the thread does now: ``WORKING``, ``WAIT_IN``, ``WAIT_OUT`` or ``INLINE``."""
        return 0 if self.ended is not None else self._state[4]

    @property
    def wait_in_s(self) -> float:
        return self.totals()[1]

    @property
    def wait_out_s(self) -> float:
        return self.totals()[2]

    @property
    def inline_s(self) -> float:
        return self.totals()[3]

    def busy_s(self) -> float:
        """Seconds alive minus seconds waiting on either queue and inline work of the next stage."""
        return self.totals()[0]


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
            self.run.book.attach_thread(self.name, c)
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

    # What ``Counters.current`` calls the first step of this stage's work on a sample.
    phase = "stage"

    def work(self, c: Counters) -> None:
        process = self.process
        failed = self.run.sample_failed
        phase = self.phase
        while True:
            task = self.get(c)
            if task is END:
                self.end_thread(c)
                return
            c.current = (phase, task.index, _now())
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
            c.current = None
            c.items += 1

    def process(self, task: Any, c: Counters) -> None:
        raise NotImplementedError
