"""The one stage abstraction: threads, queue waits, end propagation, error
wrapping and stats live here once; a concrete stage says what it does to an item.

A stage is given what it needs when the pipeline is built: its channels, its
work, and a small :class:`Control` interface (stop, fail, a sample failed, a
thread started or exited). It never reaches into the pass that runs it, so a
stage can be built and driven alone, with real channels and a stand-in control.

:class:`MapStage` runs a list of :class:`Step` functions on each item in turn:
the decode threads running the transforms (``augment_threads=0``) is the decode
stage with the augment step appended, not a special case. What a failed sample
does to its pass is the :class:`ErrorOptions`'.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .queue import EMPTY, END, Channel, Closed
from .threads import limit_torch_threads
from ..errors import StageError

log = logging.getLogger(__name__)
_now = time.perf_counter


@dataclass(frozen=True)
class ErrorOptions:
    """The feeder options that decide what a failing sample or a stalled pass does
    (see ``Feeder``'s arguments of the same names)."""

    on_error: str = "raise"
    max_skipped: int | None = None
    timeout: float | None = None

    @property
    def skip(self) -> bool:
        """``on_error="skip"``: a failed sample is left out (within ``max_skipped``)."""
        return self.on_error == "skip"


# Counters' states as module names: the hot path reads them without a class lookup.
_WORKING, _WAIT_IN, _WAIT_OUT, _INLINE = 0, 1, 2, 3


def _with_wait(wait_in: float, wait_out: float, inline: float, kind: int,
               seconds: float) -> tuple[float, float, float]:
    """The wait totals with ``seconds`` of a wait of ``kind`` (a ``Counters`` state) added."""
    if kind == Counters.WAIT_IN:
        return wait_in + seconds, wait_out, inline
    if kind == Counters.WAIT_OUT:
        return wait_in, wait_out + seconds, inline
    if kind == Counters.INLINE:
        return wait_in, wait_out, inline + seconds
    return wait_in, wait_out, inline


# Readers of Counters.totals keep what they reported under this lock (held for
# a few comparisons; a forked child starts with a fresh one).
_SHOWN_LOCK = threading.Lock()


def _fresh_lock_in_child() -> None:
    global _SHOWN_LOCK
    _SHOWN_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


class Counters:
    """One thread's stats. Only its own thread writes them, so no lock is needed.

    A reader in another thread (``Feeder.stats()``) must see values that never
    go backwards, so the wait bookkeeping lives in one tuple that is replaced
    whole (one attribute store, atomic under the GIL): a reader can never see a
    finished wait both added to its total and still counted as ongoing.
    """

    __slots__ = ("items", "_state", "started", "ended", "inline_items", "current", "cpu_s", "_shown")

    # What the thread is doing, as kept in the state tuple.
    WORKING, WAIT_IN, WAIT_OUT, INLINE = _WORKING, _WAIT_IN, _WAIT_OUT, _INLINE

    def __init__(self) -> None:
        self.items = 0
        # Samples of the next stage handled in this thread (decode threads running
        # the transforms when there is no augment pool): reported as that stage's.
        self.inline_items = 0
        # (seconds waiting for input, waiting to output, doing the next stage's
        # work inline, when the current one began, which one: a kind above)
        self._state: tuple[float, float, float, float, int] = (0.0, 0.0, 0.0, 0.0, Counters.WORKING)
        self.started = _now()
        self.ended: float | None = None
        # (phase, sample index, since): the sample this thread works on, for
        # naming samples stuck in a stage (``Feeder(timeout=...)``); None between samples.
        self.current: tuple[str, int, float] | None = None
        # CPU seconds the thread has used (kept by the transfer stage only; 0 elsewhere).
        self.cpu_s = 0.0
        # The waits and busy time :meth:`totals` last reported (see there).
        self._shown = (0.0, 0.0, 0.0, 0.0)

    # A wait in progress counts too, so a snapshot of a stalled pipeline shows
    # its threads as waiting, not busy. Both return the clock they read, so the
    # stage loop stamps the sample it starts without reading it again.
    def begin_wait(self, kind: int) -> float:
        wi, wo, inl, _, _ = self._state
        t = _now()
        self._state = (wi, wo, inl, t, kind)
        return t

    def end_wait(self) -> float:
        wi, wo, inl, since, kind = self._state
        t = _now()
        d = t - since
        # Inline, not _with_wait: this runs at every queue wait of every sample.
        if kind == _WAIT_IN:
            wi += d
        elif kind == _WAIT_OUT:
            wo += d
        elif kind == _INLINE:
            inl += d
        self._state = (wi, wo, inl, 0.0, _WORKING)
        return t

    def totals(self) -> tuple[float, float, float, float]:
        """(busy, wait in, wait out, inline) seconds so far, ongoing waits included.

        Never less than an earlier call reported: a wait that ends between this
        reader's look at the state and its clock read was counted up to the
        later clock, and the thread records it up to its own earlier one; the
        difference stays counted as waiting (the busy time grows by no less
        for it)."""
        # The end first: once it is set the state is final, so a state read
        # after it is too (read the other way round, a wait that ended in
        # between would be missing from this reading and present in the next,
        # and the busy time would go back by its length).
        end = self.ended
        wi, wo, inl, since, kind = self._state
        now = _now() if end is None else end
        if kind != Counters.WORKING and end is None:
            wi, wo, inl = _with_wait(wi, wo, inl, kind, now - since)
        with _SHOWN_LOCK:
            swi, swo, sinl, sbusy = self._shown
            wi, wo, inl = max(wi, swi), max(wo, swo), max(inl, sinl)
            # A thread that ends between the two reads above was read a moment
            # past its end: the next reading's busy time stays at this one.
            busy = max(0.0, now - self.started - wi - wo - inl, sbusy)
            self._shown = (wi, wo, inl, busy)
        return busy, wi, wo, inl

    @property
    def waiting(self) -> int:
        """What the thread does now: ``WORKING``, ``WAIT_IN``, ``WAIT_OUT`` or ``INLINE``."""
        return 0 if self.ended is not None else self._state[4]

    @property
    def inline_s(self) -> float:
        return self.totals()[3]

    def busy_s(self) -> float:
        """Seconds alive minus seconds waiting on either queue and inline work of the next stage."""
        return self.totals()[0]


def timed_put(c: Counters, channel: Channel, item: Any) -> None:
    """``channel.put(item)``, its blocked time counted as ``c``'s wait on output."""
    c.begin_wait(_WAIT_OUT)
    try:
        channel.put(item)
    finally:
        c.end_wait()


class Control(Protocol):
    """What a stage may ask of the pipeline that runs it."""

    def stopped(self) -> bool:
        """True once the pipeline is shutting down."""

    def fail(self, error: BaseException) -> None:
        """The pipeline cannot go on: remember ``error`` for the consumer and stop."""

    def sample_failed(self, step: str, task: Any, exc: BaseException, c: "Counters") -> None:
        """``step`` raised ``exc`` on ``task``: skip it or fail its batch, per the policy.
        A ``BaseException`` that is not an ``Exception`` (SystemExit...) is never skipped."""

    def thread_started(self, stage: str, c: "Counters") -> None:
        """A thread of ``stage`` is about to start; ``c`` are its counters."""

    def thread_exited(self, stage: str, c: "Counters") -> None:
        """A thread of ``stage`` has left its loop (normally, on close, or failing)."""


# Each stage thread's pass control, for of_ended_pass (a thread that is gone drops
# out). The value is a weak reference too: the pass holds its threads, so a strong
# one would keep every pass (and its decode memory) alive through its own key.
_controls: "weakref.WeakKeyDictionary[threading.Thread, weakref.ref[Control]]" = weakref.WeakKeyDictionary()


def of_ended_pass(thread: threading.Thread) -> bool:
    """True if ``thread`` is a stage thread of a pass that has ended: stopped, or
    its end taken by the training loop. Such a thread has left its loop or
    leaves it at its next queue operation; it is only finishing its exit.

    The isolated engine waits a moment for these before deciding whether it may
    fork (see ``feeder.isolation.start.quiet_threads``)."""
    ref = _controls.get(thread)
    control = None if ref is None else ref()
    return control is not None and (control.stopped() or getattr(control, "output_ended", False))


@dataclass(frozen=True)
class Step:
    """One function of the per-sample work: ``fn(item) -> item``, or None when the
    item goes no further (a batch slot was filled but the batch is not complete).

    Attributes:
        name: What errors and stats call it (``"read"``, ``"decode"``, ``"augment"``).
        fn: The function.
        inline: Work of a stage that has no threads of its own: its time is
            counted as that stage's (``name``), not as the running stage's.
        busy: What a sample in this step is said to be in, for the samples in
            flight (a timeout's message, the stuck-sample warning); None: ``name``.
    """

    name: str
    fn: Callable[[Any], Any]
    inline: bool = False
    busy: str | None = None
    #: The first step only: takes a whole run of tasks at once, before the
    #: steps take each: ``run(tasks, at) -> (left, done, batch)``; the tasks
    #: ``left`` then take every step in turn (this one sees what ``run`` left
    #: in them), ``done`` tasks went through every step, and ``batch`` (or
    #: None) is what the last step would have returned. ``at`` is the
    #: thread's :class:`RunAt`, to point at the task in work.
    run: Callable[[list, "RunAt"], tuple[list, int, Any]] | None = None


class RunAt:
    """Where a thread is in a run of tasks that :attr:`Step.run` takes at once:
    ``tasks[at[0]]``, ``at`` written by the code working on them (the
    extension, without the GIL), for naming a sample stuck there."""

    __slots__ = ("tasks", "at")

    def __init__(self) -> None:
        self.tasks: Sequence[Any] = ()
        self.at = np.zeros(1, np.int64)

    @property
    def index(self) -> int:
        """The source index of the task in work (-1: none)."""
        tasks = self.tasks
        if not tasks:
            return -1
        return tasks[min(max(int(self.at[0]), 0), len(tasks) - 1)].index


class Stage:
    """A named group of threads that take items from ``inbox`` and give to ``outbox``.

    Subclasses implement :meth:`work` (a whole thread loop); :class:`MapStage`
    handles one item at a time. The base gives every thread timed ``get``/``put``
    helpers, turns an unexpected exception into a failure of the pipeline, and
    exits quietly when its channels are closed.
    """

    def __init__(self, name: str, threads: int, control: Control, inbox: Channel | None,
                 outbox: Channel | None) -> None:
        self.name = name
        self.control = control
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
            self.control.thread_started(self.name, c)
            name = f"feeder-{self.name}" if self.num_threads == 1 else f"feeder-{self.name}-{i}"
            t = threading.Thread(target=self._main, args=(c,), name=name, daemon=True)
            _controls[t] = weakref.ref(self.control)
            self.threads.append(t)
            t.start()

    def _main(self, c: Counters) -> None:
        try:
            limit_torch_threads()  # N workers each fanning out over all cores would oversubscribe
            self.work(c)
        except Closed:
            pass  # the pipeline is shutting down
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the consumer
            err = StageError(self.name, f"{type(exc).__name__}: {exc}")
            err.__cause__ = exc
            self.control.fail(err)
        finally:
            c.ended = _now()
            self.control.thread_exited(self.name, c)

    def work(self, c: Counters) -> None:
        raise NotImplementedError

    # Timed queue access: waiting time is what the stats call wait_in / wait_out.
    def get(self, c: Counters) -> Any:
        c.begin_wait(_WAIT_IN)
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
    """Runs ``steps`` on each sample task in turn; what the last one returns goes to
    ``outbox`` (None: nothing to send). A failure is the sample's, named by its step."""

    def __init__(self, name: str, threads: int, steps: Sequence[Step], control: Control,
                 inbox: Channel, outbox: Channel) -> None:
        super().__init__(name, threads, control, inbox, outbox)
        if not steps or steps[0].inline:
            raise ValueError(f"stage {name!r}: the first step must be the stage's own")
        self.steps = tuple(steps)
        self.run = steps[0].run
        self.run_busy = steps[0].busy or steps[0].name
        # decode_threads="tune": threads numbered at or above the gate's count park
        # before taking their next sample (set by the pass; see tune.Gate).
        self.gate: Any = None

    def busy_s(self) -> float:
        """Thread-seconds this stage's threads have worked so far (their inline work included)."""
        total = 0.0
        for c in list(self.counters):
            busy, _, _, inline = c.totals()
            total += busy + inline
        return total

    def _one(self, c: Counters, task: Any, t: float) -> bool:
        """Run the steps on ``task`` (taken at ``t``) and hand on what the last
        returns; False when the thread must end (SystemExit or
        KeyboardInterrupt from user code: the pass learns which sample)."""
        steps = self.steps
        control = self.control
        begin_wait = c.begin_wait
        item = task
        step = steps[0]
        inline = False
        try:
            for step in steps:
                if step.inline and not inline:
                    inline = True
                    t = begin_wait(_INLINE)
                elif step is not steps[0]:
                    t = _now()
                # What this thread works on, for naming samples stuck in a step.
                c.current = (step.busy or step.name, task.index, t)
                item = step.fn(item)
                if item is None:
                    break
        except Closed:
            raise
        except Exception as exc:
            if inline:
                c.end_wait()
            c.current = None
            c.items += 1  # handled: its failure is counted where the policy says
            control.sample_failed(step.name, task, exc, c)
            return True
        except BaseException as exc:
            # SystemExit or KeyboardInterrupt raised by user code: never
            # skippable, but the training loop still learns which sample.
            if inline:
                c.end_wait()
            control.sample_failed(step.name, task, exc, c)
            return False
        if inline:
            c.end_wait()
            c.inline_items += 1
        c.current = None
        c.items += 1
        if item is not None:
            timed_put(c, self.outbox, item)
        return True

    def _run(self, c: Counters, tasks: list, t: float, at: RunAt) -> list:
        """The first step's :attr:`Step.run` on a run of ``tasks`` (taken at
        ``t``); returns the tasks left for :meth:`_one`."""
        at.tasks = tasks
        at.at[0] = 0
        c.current = (self.run_busy, at, t)  # type: ignore[assignment]
        try:
            left, done, batch = self.run(tasks, at)  # type: ignore[misc]
        finally:
            c.current = None
            at.tasks = ()
        if done:
            c.items += done
            c.inline_items += done
        if batch is not None:
            timed_put(c, self.outbox, batch)
        return left

    def work(self, c: Counters) -> None:
        # This loop runs once per item (a sample, or a run of a batch's samples)
        # in every worker thread, holding the GIL for all of it: each clock read,
        # tuple and call here is paid per item, and every moment of it can delay
        # the training thread's next torch call. So a ready item is taken
        # without the wait bookkeeping, and only a get that waits is timed
        # (inline: Stage.get's bookkeeping, without the call); the clock read
        # that ends it stamps the first step.
        control = self.control
        get, poll = self.inbox.get, self.inbox.poll
        begin_wait, end_wait = c.begin_wait, c.end_wait
        gate = self.gate
        index = self.counters.index(c)
        run = self.run
        at = RunAt()
        while True:
            if gate is not None and index >= gate.active:
                # Parked time counts as waiting on output: the loop downstream
                # needs fewer threads than this stage has.
                gate.admit(index, control.stopped, lambda: begin_wait(_WAIT_OUT), end_wait)
            task = poll()
            if task is EMPTY:
                begin_wait(_WAIT_IN)
                try:
                    task = get()
                finally:
                    t = end_wait()
            else:
                t = _now()
            if task is END:
                if gate is not None:
                    gate.open()  # every parked sibling must take the end too
                self.end_thread(c)
                return
            # A run of a batch's samples (the sampler's list) or one sample.
            if type(task) is list:
                if run is not None:
                    task = self._run(c, task, t, at)
                    t = _now()
            else:
                task = (task,)
            for task in task:
                if not self._one(c, task, t):
                    return
                t = _now()
