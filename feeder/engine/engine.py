"""The engines: what runs a feeder's passes, behind one interface.

Two engines share :class:`EngineBase` (the lock, the passes, how a pass starts
and how the engine stops and closes, the live-engine registry that the exit
and fork hooks below walk):

* :class:`ThreadEngine`: the stages as threads of this process
  (``isolation="thread"``); the isolated engine's worker process runs one too.
* ``feeder.isolation.engine.ProcessEngine``: the training process's side of
  ``isolation="process"`` (the transfer stage here, the rest in a worker).

The :class:`~feeder.Feeder` holds one and calls only what :class:`Engine` lists.
Its threads never refer to the Feeder, so an unclosed Feeder can be
garbage-collected and its finalizer (:func:`close_when_collected`) stop them.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
import weakref
from typing import Any, Protocol

import torch

from . import reaper as _reaper
from ..ops.chain import Chain
from .filling import Scratch
from .pool import BufferPool
from .config import Config
from ..order.plan import EpochPlan
from .pipeline import Pass, PassBase, stage_threads
from .read import ReadWaits
from .stats import MemoryStats, Stats, StatsBook
from .threads import LibraryThreads, MeasuredReadThreads, measured_read_threads
from .cuda import SideStream
from .steps import SampleWork, source_files
from ..errors import FeederError

log = logging.getLogger(__name__)

# close() waits at most this long for threads (a transform stuck in user code
# cannot be interrupted; its thread is a daemon and exits when the call returns).
CLOSE_TIMEOUT_S = 1.0
# Interpreter exit waits at most this long for all feeders' threads together.
_EXIT_TIMEOUT_S = 0.5


class Engine(Protocol):
    """What the :class:`~feeder.Feeder` and its iterator use of an engine."""

    config: Config
    book: StatsBook
    closed: bool
    current: PassBase | None

    def start_pass(self, seed: int, epoch: int, rank: int, world_size: int,
                   done: Any = None) -> PassBase:
        """Stop the current pass, if any, and start a new one (its threads running)."""

    def stats(self) -> Stats:
        """A snapshot of the engine's stats."""

    def stop(self) -> list[PassBase]:
        """Mark the engine closed and stop every pass without waiting; return them."""

    def free(self) -> None:
        """Give back what a closed engine holds (memory, a worker process)."""

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """:meth:`stop`, wait up to ``timeout`` seconds for the threads, :meth:`free`."""

    def after_fork(self) -> None:
        """In a forked child: start over without the parent's threads."""

    def quiet_locks(self) -> list[tuple[threading.Thread, threading.Lock]]:
        """This engine's service threads and the lock each holds while at work
        (a fork waits until it can take them: ``feeder.isolation.start.quiet_threads``)."""


_live_engines: "weakref.WeakSet[EngineBase]" = weakref.WeakSet()


def live_engines() -> list["EngineBase"]:
    """The engines of this process not yet collected."""
    return list(_live_engines)


def _close_all_at_exit() -> None:
    # Stop every feeder first, then wait once for all of them: exit time must
    # not grow with the number of feeders that have a thread stuck in a read.
    engines = list(_live_engines)
    passes = [pass_ for engine in engines for pass_ in engine.stop()]
    deadline = time.monotonic() + _EXIT_TIMEOUT_S
    for pass_ in passes:
        if not pass_.join(max(0.0, deadline - time.monotonic())):
            break
    for engine in engines:
        engine.free()


atexit.register(_close_all_at_exit)


def _after_fork_in_child() -> None:
    LibraryThreads.after_fork()
    for engine in list(_live_engines):
        engine.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class EngineBase:
    """What both engines do alike: the passes under one lock, starting a pass,
    stopping and closing. A subclass builds its passes (:meth:`_new_pass`) and
    says what else a step involves through the hooks below; it calls
    :meth:`_go_live` once it is fully built."""

    # close(): the share of its timeout spent waiting for the passes' threads,
    # and whether threads still busy then are named in a warning.
    _join_share = 1.0
    _warn_stuck = True

    def __init__(self, config: Config) -> None:
        self.config = config
        self.book = StatsBook(stage_threads(config.threads))
        self.lock = threading.Lock()
        self.current: Any = None
        self.passes: list[Any] = []  # passes whose threads may still be alive
        self.closed = False
        # CUDA: the side stream(s), made once, and the device resolved per pass.
        device = config.output.device
        self.side = SideStream(device) if device.type == "cuda" else None

    def _go_live(self) -> None:
        """Join the live engines that interpreter exit and a fork look after."""
        _live_engines.add(self)

    # -- hooks -----------------------------------------------------------------
    def _admit(self) -> None:
        """Under the lock, before a pass starts: raise if none may."""

    def _prepare(self) -> None:
        """Under the lock, the previous pass stopped: ready the engine for the next."""

    def _device_resolved(self, device: torch.device) -> None:
        """The pass's CUDA device, resolved in the thread starting it."""

    def _new_pass(self, cfg: Config, seed: int, epoch: int, rank: int, world_size: int,
                  done: Any) -> Any:
        raise NotImplementedError

    def _started(self, pass_: Any, seed: int, epoch: int, rank: int, world_size: int,
                 done: Any) -> None:
        """The pass's threads here are running."""

    def _closing(self) -> None:
        """In the first :meth:`stop`, before the passes are stopped."""

    def _closed_now(self) -> None:
        """In the first :meth:`stop`, after the passes were stopped."""

    # -- the interface ---------------------------------------------------------
    def start_pass(self, seed: int, epoch: int, rank: int, world_size: int,
                   done: Any = None) -> Any:
        with self.lock:
            if self.closed:
                raise FeederError("the feeder is closed")
            self._admit()
            if self.current is not None:
                # Abandon the previous pass: no stale batch survives, and its
                # iterator tells the loop that this pass replaced it.
                self.current.replace()
                self.current.fold_output()
            self.passes = [p for p in self.passes if not p.finished.is_set()]
            self._prepare()
            self.book.start()
            cfg = self.config
            if self.side is not None:
                # "cuda" is this thread's current device now, not when the feeder was
                # built (test_cuda_device_resolved_when_the_pass_starts).
                device = self.side.begin_pass()
                self._device_resolved(device)
                cfg = dataclasses.replace(cfg, device=device)
            pass_ = self._new_pass(cfg, seed, epoch, rank, world_size, done)
            self.current = pass_
            self.passes.append(pass_)
            pass_.start()
            self._started(pass_, seed, epoch, rank, world_size, done)
            return pass_

    def stop(self) -> list[Any]:
        """Mark the engine closed and stop every pass without waiting; return them."""
        # A bounded wait for the lock: close() must return even if another
        # thread is stuck while holding it; stopping a pass is idempotent.
        locked = self.lock.acquire(timeout=CLOSE_TIMEOUT_S)
        try:
            first = not self.closed
            if first:
                self._closing()
            self.closed = True
            passes = list(self.passes)
            for pass_ in passes:
                pass_.stop()
            if self.current is not None:
                self.current.fold_output()
            if first:
                self._closed_now()
        finally:
            if locked:
                self.lock.release()
        if first:
            log.debug("feeder closed")
        return passes

    def free(self) -> None:
        raise NotImplementedError

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop every pass, wait up to ``timeout`` seconds for their threads, free the rest."""
        passes = self.stop()
        deadline = time.monotonic() + self._join_share * timeout
        me = threading.current_thread()
        for pass_ in passes:
            if me in pass_.threads():
                continue  # close() from a transform: that thread exits when it returns
            if not pass_.join(max(0.0, deadline - time.monotonic())) and self._warn_stuck:
                stuck = [t.name for t in pass_.threads() if t.is_alive()]
                log.warning("feeder closed with threads still busy in user code: %s "
                            "(daemon threads; they exit when that call returns)", ", ".join(stuck))
        self.free()

    def after_fork(self) -> None:
        """In a forked child: none of the parent's feeder threads exist here, and any
        lock one of them held at the fork stays held. Start over with a fresh lock;
        the inherited passes are orphaned (their iterators raise, close() returns at once)."""
        self.lock = threading.Lock()
        for pass_ in self.passes:
            pass_.orphan()
        self.passes = []

    def quiet_locks(self) -> list[tuple[threading.Thread, threading.Lock]]:
        return []


class ThreadEngine(EngineBase):
    """The stages as threads of this process (``isolation="thread"``).

    Args:
        config: The feeder's configuration.
        source: What samples are read from.
        chain: The CPU transforms.
        shared: Batch buffers in shared memory (the isolated engine's worker,
            whose batches the training process reads).
        tail: Builds each pass's last stage (see :class:`~feeder.engine.pipeline.Pass`);
            None: the transfer stage.
        plan: The feeder's epoch plan; None: one of its own, over ``source``
            (the isolated engine's worker process).
    """

    def __init__(self, config: Config, source: Any, chain: Chain, shared: bool = False,
                 tail: Any = None, plan: EpochPlan | None = None) -> None:
        # Where the pipeline is built: "auto" and "tune" become counts here.
        config = config.resolved(source)
        super().__init__(config)
        self.source = source
        self.chain = chain
        self.plan = plan if plan is not None else EpochPlan(source, config.order, chain)
        h, w = chain.image_size
        self.pool = BufferPool(config.num_buffers, config.order.batch_size, h, w,
                               pin=config.output.device.type == "cuda" and not shared, shared=shared)
        self.work = SampleWork.of(chain, config.decode, config.sizes.padding,
                                  files=source_files(source))
        self.scratch = Scratch(h, w)
        self._limits_held = False
        self.tail = tail
        # read_threads="auto" for a source that does not say whether its reads
        # wait: the read stage's reads are timed until the later passes' read
        # stage is decided from them (see _decide_read_stage).
        measured = isinstance(config.threads.read_threads, MeasuredReadThreads)
        self.read_waits = ReadWaits() if measured else None
        _reaper.ensure_running()
        self._go_live()

    def start_pass(self, seed: int, epoch: int, rank: int, world_size: int,
                   done: Any = None) -> Pass:
        _reaper.ensure_running()  # after a fork, the child's first pass restarts it
        return super().start_pass(seed, epoch, rank, world_size, done)

    def _prepare(self) -> None:
        if not self._limits_held:
            LibraryThreads.acquire()
            self._limits_held = True
        self.pool.set_consumer_waiting(False)  # the loop is here now, about to call next()
        if self.read_waits is not None:
            self._decide_read_stage(self.read_waits)

    def _decide_read_stage(self, waits: ReadWaits) -> None:
        """Once enough reads were timed, fix the read stage of this pass and the
        later ones (see :func:`~feeder.engine.threads.measured_read_threads`).
        The engine's own copy of the configuration changes; batches do not
        (they never depend on thread counts)."""
        decided = measured_read_threads(self.config.threads.read_threads, list(waits.waits))
        if decided is None:
            return  # too few reads yet: this pass keeps the read stage and times more
        threads, why = decided
        self.read_waits = None
        self.config = dataclasses.replace(self.config, read_threads=threads)
        self.book.restage(stage_threads(self.config.threads))
        log.info("read_threads='auto' for %s, which does not say whether its reads wait "
                 "(no reads_may_block): %s", type(self.source).__name__, why)

    def _device_resolved(self, device: torch.device) -> None:
        self.pool.pin_with(device)

    def _new_pass(self, cfg: Config, seed: int, epoch: int, rank: int, world_size: int,
                  done: Any) -> Pass:
        return Pass(cfg, self.plan, self.work, self.pool, self.book, self.scratch,
                    seed, epoch, rank, world_size, done, self.tail, self.side,
                    read_waits=self.read_waits)

    def stats(self) -> Stats:
        return self.book.snapshot(self.pool.allocated, self.memory())

    def memory(self) -> MemoryStats:
        """What the buffers, tables and indexes hold now (see :class:`MemoryStats`)."""
        verified = self.work.verified
        return MemoryStats(self.pool.nbytes(), self.scratch.nbytes(), self.work.buffers.nbytes(),
                           verified.table_bytes() if verified is not None else 0,
                           verified.indexes_bytes() if verified is not None else 0)

    def free(self) -> None:
        """Give back what a closed engine holds: buffer memory and the library thread limits."""
        self.pool.close()
        self.work.buffers.close()
        self.scratch.close()
        # The pinned buffers are unlocked only once no copy can read them: the side
        # stream is drained first (asleep) and takes no new copy after. If the
        # drain cannot start (a copy being queued holds it), they stay locked and
        # referenced: unlocking memory the DMA engine may still read is the hazard.
        # Nothing else in the process's pinned memory is touched (torch's host
        # cache is other code's). gpu-check: "teardown while the side stream is
        # busy", "exit mid-epoch". (test_pinned_blocks_unlocked_after_the_drain.)
        side = self.side
        drained = side.close() if side is not None else True
        if drained:
            self.pool.unpin()
        # Bounded, as in stop(): exit must not hang on a thread stuck holding it.
        locked = self.lock.acquire(timeout=CLOSE_TIMEOUT_S)
        try:
            if self._limits_held:
                LibraryThreads.release()
                self._limits_held = False
        finally:
            if locked:
                self.lock.release()

    def after_fork(self) -> None:
        super().after_fork()
        self.pool.after_fork()
        self.book.after_fork()
        self._limits_held = False


def stop_pass(ref: "weakref.ref[PassBase]") -> None:
    """Stop the pass ``ref`` refers to, if it is still alive (its iterator was dropped)."""
    pass_ = ref()
    if pass_ is not None:
        pass_.stop()


def close_when_collected(engine: EngineBase) -> None:
    """An unclosed Feeder was garbage-collected: stop its threads and free its memory
    (run by the reaper thread, which does not wait for the threads to exit)."""
    engine.stop()
    engine.free()
