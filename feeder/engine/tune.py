"""``"tune"`` thread counts: use the fewest threads that keep the training loop fed.

``decode_threads``, ``augment_threads`` and ``read_threads`` accept ``"tune"``
(each pool that exists). At every batch boundary (the training loop leaving
``next()`` with a batch) :class:`Tuner` looks at what the last batches cost, and
:class:`Gate` parks or wakes threads to match (never killing one); with several
tuned pools, :class:`Tuning` lets at most one change at a boundary. The rule,
whose thresholds and windows are the constants below, is described in
docs/guides/doctor.md ("Use only the threads the model needs").
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# The wait share to hold (fraction of the loop's time between batches).
TARGET_WAIT = 0.01
# Grow when the share over the last GROW_WINDOW batches is above this.
GROW_WAIT = TARGET_WAIT
GROW_WINDOW = 3
# Shrink after this many batches since the last change with a share <= TARGET_WAIT / 2.
SHRINK_WINDOW = 16
MAX_SHRINK_WINDOW = 256
# One thread fewer must be at most this busy, judged from the work measured.
HEADROOM = 0.6
# Grow when the active threads have been busier than this over the last GROW_WINDOW batches.
SATURATED = 0.9
# Batches at the start of a pass that are not judged (the pipeline fills up).
WARMUP = 2
# How long a parked thread sleeps before it re-checks (the pass's stop also wakes it).
_POLL_S = 0.1

_now = time.perf_counter


class TunedThreads(int):
    """The thread count a ``"tune"`` option (``decode_threads``, ``augment_threads``,
    ``read_threads``) resolves to: the most threads the pool may run, an ``int`` in
    every use, whose type tells the pass to tune it. (A marker on the value rather
    than another configuration field: the fields are the options.)"""

    def __repr__(self) -> str:
        return f"'tune' ({int(self)})"


class Tuner:
    """The decision: how many threads, given what each batch cost. No threads, no clock
    of its own: fed by :meth:`batch`, so tests drive it with made-up figures.

    Args:
        maximum: The most threads (the ``"auto"`` count).
        minimum: The fewest.
        start: The count to start at (default ``maximum``).
    """

    def __init__(self, maximum: int, minimum: int = 1, start: int | None = None) -> None:
        self.maximum = max(1, maximum)
        self.minimum = max(1, min(minimum, self.maximum))
        self.active = self.maximum if start is None else max(self.minimum, min(start, self.maximum))
        self.batches = 0
        # (wait s, cycle s, busy thread-s) of the batches since the last change.
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=MAX_SHRINK_WINDOW)
        self._since_change = 0
        self._shrink_window = SHRINK_WINDOW
        self._last_shrink_at: int | None = None

    @staticmethod
    def _share(rows: list[tuple[float, float, float]]) -> float:
        cycle = sum(r[1] for r in rows)
        return sum(r[0] for r in rows) / cycle if cycle > 0 else 0.0

    def batch(self, wait_s: float, cycle_s: float, busy_s: float) -> int:
        """One batch was delivered: the loop waited ``wait_s`` for it, ``cycle_s`` passed
        since the previous one, and the tuned stage's threads worked ``busy_s``
        thread-seconds meanwhile. Returns the active thread count to use from now."""
        want = self.propose(wait_s, cycle_s, busy_s)
        if want != self.active:
            self.commit(want)
        return self.active

    def propose(self, wait_s: float, cycle_s: float, busy_s: float) -> int:
        """Record one batch (as :meth:`batch`) and return the count the rules want,
        without changing to it: :class:`Tuning` decides which pool changes."""
        self.batches += 1
        if self.batches <= WARMUP or cycle_s <= 0:
            return self.active
        self._recent.append((max(0.0, wait_s), cycle_s, max(0.0, busy_s)))
        self._since_change += 1
        recent = list(self._recent)
        if self._since_change >= GROW_WINDOW and self.active < self.maximum:
            last = recent[-GROW_WINDOW:]
            share = self._share(last)
            busy = sum(r[2] for r in last) / sum(r[1] for r in last)  # threads' worth of work
            if share > GROW_WAIT or busy > SATURATED * self.active:
                want = math.ceil(self.active / max(1e-3, 1.0 - share)) if share > GROW_WAIT else 0
                return min(self.maximum, max(self.active + 1, want))
        if self._since_change >= self._shrink_window and self.active > self.minimum:
            rows = recent[-self._shrink_window:]
            if self._share(rows) <= TARGET_WAIT / 2:
                cycle = sum(r[1] for r in rows)
                demand = sum(r[2] for r in rows) / cycle  # threads' worth of work needed
                # A large pool (read threads: up to 128) sheds an eighth at a time, or
                # it would take a hundred windows to settle; a small one, a thread.
                for fewer in (max(1, self.active // 8), 1):
                    target = max(self.minimum, self.active - fewer)
                    if demand <= target * HEADROOM:
                        return target
        return self.active

    def commit(self, active: int) -> None:
        """Change to ``active`` threads (what :meth:`propose` returned)."""
        if active > self.active:
            if (self._last_shrink_at is not None
                    and self.batches - self._last_shrink_at <= 2 * self._shrink_window):
                # The last shrink starved the loop: be slower to shrink again.
                self._shrink_window = min(MAX_SHRINK_WINDOW, 2 * self._shrink_window)
        elif active < self.active:
            self._last_shrink_at = self.batches
        self._change(active)

    def restart(self) -> None:
        """Another pool's count changed: the batches so far were measured with the old
        counts, so this pool's windows start again."""
        self._recent.clear()
        self._since_change = 0

    def utilization(self) -> float:
        """The share of its active threads' time this stage worked over the last
        ``GROW_WINDOW`` batches (0 before any was recorded)."""
        last = list(self._recent)[-GROW_WINDOW:]
        cycle = sum(r[1] for r in last)
        return sum(r[2] for r in last) / (cycle * self.active) if cycle > 0 else 0.0

    def _change(self, active: int) -> None:
        self.active = active
        self._recent.clear()
        self._since_change = 0


class Tuning:
    """The batch boundaries of one pass, and which tuned pool changes at each.

    Told by :meth:`consumer` when the training loop enters and leaves ``next()``;
    measures each batch's wait and cycle once, and each gate's work since the
    last boundary. One gate: its tuner decides alone. Several: see the module
    docstring (only the busiest may grow, the least busy shrinks, one change at a
    time, and a change restarts every pool's windows).

    Args:
        gates: The tuned stages' gates.
        clock: Seconds, monotonic; None reads this module's ``_now`` at each call.
    """

    def __init__(self, gates: "list[Gate]", clock: Callable[[], float] | None = None) -> None:
        self.gates = list(gates)
        self._clock = clock if clock is not None else (lambda: _now())
        self._entered: float | None = None
        self._left: float | None = None
        self._busy_at = [0.0] * len(self.gates)

    def consumer(self, waiting: bool) -> None:
        """The training loop entered (True) or left (False) ``next()``; leaving it with
        a batch is a batch boundary, where the active counts may change."""
        now = self._clock()
        if waiting:
            self._entered = now
            return
        entered, left = self._entered, self._left
        self._entered = None
        busy = [g.busy_s() for g in self.gates]
        busy_before, self._busy_at = self._busy_at, busy
        self._left = now
        if entered is None or left is None:
            return  # the first next() of a pass: no cycle to judge yet
        wait_s, cycle_s = now - entered, now - left
        work = [b - b0 for b, b0 in zip(busy, busy_before)]
        if len(self.gates) == 1:
            gate = self.gates[0]
            active = gate.tuner.batch(wait_s, cycle_s, work[0])
            if active != gate.active:
                gate.set_active(active)
            return
        wants = [g.tuner.propose(wait_s, cycle_s, w) for g, w in zip(self.gates, work)]
        chosen, want = choose(self.gates, wants)
        if chosen is None:
            return
        chosen.tuner.commit(want)
        for g in self.gates:
            if g is not chosen:
                g.tuner.restart()
        chosen.set_active(chosen.tuner.active)


def choose(gates: "list[Gate]", wants: list[int]) -> "tuple[Gate | None, int]":
    """Which one pool changes, given what each pool's tuner wants (see the module
    docstring): the busiest tuned stage, when it wants to grow; else, among those
    that want to shrink, the least busy; else none."""
    busiest = max(range(len(gates)), key=lambda i: gates[i].tuner.utilization())
    if wants[busiest] > gates[busiest].active:
        return gates[busiest], wants[busiest]
    shrinking = [i for i, g in enumerate(gates) if wants[i] < g.active]
    if not shrinking:
        return None, 0
    least = min(shrinking, key=lambda i: gates[i].tuner.utilization())
    return gates[least], wants[least]


class Gate:
    """Parks the threads of one stage whose number is at or above the active count.

    Threads check :meth:`admit` before taking their next item (a cheap attribute
    read while they may run). :meth:`open` lets every thread run for good (the
    stage saw its end, or the pass stops), so that every thread takes the end
    marker and exits.

    Args:
        stage: The stage's name (for the stats).
        threads: The stage's threads.
        busy: Returns the stage's busy thread-seconds so far.
        record: Called with (stage, active count) at the start and at each change.
        clock: Seconds, monotonic; None reads this module's ``_now`` at each call
            (tests replace it with a fake clock).
        start: Threads active at first (default all): where the previous pass ended.
    """

    def __init__(self, stage: str, threads: int, busy: Callable[[], float],
                 record: Callable[[str, int], None] | None = None,
                 clock: Callable[[], float] | None = None, start: int | None = None) -> None:
        self.stage = stage
        threads = int(threads)  # a TunedThreads: its repr is for the configuration
        self.tuner = Tuner(threads, start=start)
        self.active = self.tuner.active
        self.busy_s = busy
        self._record = record
        self._clock = clock
        self._cond = threading.Condition()
        self.parks = 0  # times a thread has parked (for tests and the stats)
        self._open = False
        self._solo: Tuning | None = None
        if record is not None:
            record(stage, self.active)

    # -- the training loop's side (through BufferPool.set_consumer_waiting) ----------
    def consumer(self, waiting: bool) -> None:
        """This gate tuned alone: as :meth:`Tuning.consumer` with this gate only."""
        if self._solo is None:
            self._solo = Tuning([self], self._clock)
        self._solo.consumer(waiting)

    def set_active(self, active: int) -> None:
        with self._cond:
            self.active = active
            self._cond.notify_all()
        if self._record is not None:
            self._record(self.stage, active)

    # -- the stage threads' side ------------------------------------------------
    def admit(self, index: int, stopped: Callable[[], bool],
              on_park: Callable[[], Any] | None = None,
              on_wake: Callable[[], Any] | None = None) -> None:
        """Return when thread ``index`` may take its next item (at once while it is
        among the active ones)."""
        if index < self.active or self._open:
            return
        self.parks += 1
        if on_park is not None:
            on_park()
        try:
            with self._cond:
                while index >= self.active and not self._open and not stopped():
                    self._cond.wait(_POLL_S)
        finally:
            if on_wake is not None:
                on_wake()

    def open(self) -> None:
        """Every thread runs from now on (the end of the stage's input, or a stop)."""
        with self._cond:
            self._open = True
            self._cond.notify_all()
