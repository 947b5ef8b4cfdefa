"""The consumer's side of a pass: the iterator the training loop holds, what it
learns about each batch, and how long it waits.

The iterator knows the feeder only through :class:`PassHooks`: a callable that
starts the next pass, the stats book the waits are recorded in, and a callable
told which samples each delivered batch holds.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .engine import reaper as _reaper
from .engine.pipeline import Pass
from .engine.queue import END, Closed
from .order.progress import Progress
from .engine.stats import StatsBook
from .engine.cuda import wait_for
from .engine.delivery import Delivery, Failure
from .errors import FeederError, FeederTimeoutError, safe_text

log = logging.getLogger(__name__)

# While the training loop waits in next(), a sample one stage has worked on for
# longer than this is named in a warning (once per sample): a read that never
# returns (a hung network mount) otherwise looks like a silent hang.
STUCK_WARNING_S = 60.0
# How often a waiting next() looks for stuck samples (seconds).
_WATCH_S = 1.0


@dataclass(frozen=True)
class BatchInfo:
    """Which samples a delivered batch holds (``Feeder.last_batch``).

    Attributes:
        epoch: The epoch of the pass that delivered it.
        number: Its position among that pass's batches (0, 1, ...).
        indices: int64 CPU tensor ``[B]``: the source index of each sample, in the
            batch's order (so ``labels[i]`` is the label of ``source`` sample
            ``indices[i]``).
        sources: For a :class:`~feeder.Mixture`, int64 CPU tensor ``[B]``: the
            source number each sample came from; None for other sources.
    """

    epoch: int
    number: int
    indices: torch.Tensor
    sources: torch.Tensor | None = None


@dataclass(frozen=True)
class PassHooks:
    """What a pass's iterator needs from its feeder.

    Attributes:
        start: Starts the next pass (at the iterator's first ``next()``); returns
            the running pass and the :class:`~feeder.order.progress.Progress` that
            records what it delivers.
        book: The stats book that counts the loop's waits and delivered samples.
        delivered: Told about every batch ``next()`` returns (``Feeder.last_batch``).
        length: The number of batches of a pass (``len(feeder)``).
        cuda: Batches are on a CUDA device: the loop's stream waits for each copy.
        timeout: Seconds ``next()`` may wait for a batch (None: no limit).
    """

    start: Callable[[], tuple[Pass, Progress]]
    book: StatsBook
    delivered: Callable[[BatchInfo], None]
    length: Callable[[], int]
    cuda: bool
    timeout: float | None


class PassIterator:
    """The consumer's side of one pass.

    The pass starts at the first ``next()`` (see :meth:`Feeder.__iter__`); an
    iterator dropped before it leaves no trace. Several threads may share one
    iterator (a prefetching helper, a trainer's workers): exactly one pass
    starts, each batch goes to exactly one of them, and every one of them gets
    ``StopIteration`` at the end of the pass, or the pass's error.
    """

    def __init__(self, hooks: PassHooks) -> None:
        # The hooks' callables are the feeder's bound methods: they keep the
        # feeder alive while a pass is iterated.
        self._hooks = hooks
        self._pass: Pass | None = None  # set once, by the first next()
        self._progress: Progress | None = None  # what state_dict() says this pass has delivered
        self._start_lock = threading.Lock()  # threads sharing a fresh iterator start one pass
        self._book = hooks.book
        self._cuda = hooks.cuda
        self._timeout = hooks.timeout
        self._warned: set[int] = set()  # stuck samples already named in a warning
        # Threads that have been given the pass's error: each learns it once, and
        # a later next() ends the iterator (as after the error on one thread).
        self._told: set[int] = set()
        self._failure: BaseException | None = None
        self._failure_lock = threading.Lock()  # threads sharing this iterator move the error once

    def __iter__(self) -> "PassIterator":
        return self

    def _start(self) -> Pass:
        with self._start_lock:
            if self._pass is None:
                pass_, self._progress = self._hooks.start()
                # Like DataLoader's iterator: once the loop drops it (a break, an
                # exception), its pass stops and its threads and buffers are freed.
                # The collector may free it while this very thread holds a pass
                # lock, so the stop runs in the reaper thread (see _reaper). Only a
                # weak reference: a pass holding its error, whose traceback holds
                # the iterator's frame, must not be kept alive by the finalizer registry.
                _reaper.watch(self, _stop_pass, weakref.ref(pass_))
                self._pass = pass_
            return self._pass

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        pass_ = self._pass
        if pass_ is None:
            pass_ = self._start()
        if pass_.orphaned:
            raise FeederError(
                "this pass was started before the process forked; its threads do not exist in "
                "this process. Start a new pass (iter(feeder)) in the child.")
        if pass_.output_ended:
            raise StopIteration
        t0 = time.perf_counter()
        pool = pass_.pool
        book = self._book
        pool.set_consumer_waiting(True)
        book.consumer_waiting(t0)
        try:
            item = self._get(pass_, t0)
        except Closed:
            self._closed(pass_)
        except BaseException:
            # KeyboardInterrupt (or anything else) while waiting: stop the pass
            # so no thread keeps working for a loop that has gone.
            pass_.stop()
            raise
        finally:
            pool.set_consumer_waiting(False)  # before claim() below: see BufferPool.acquire
            book.consumer_waiting(None)
        progress = self._progress
        assert progress is not None
        if item is END:
            # Other threads sharing this iterator may wait in get(): closing the
            # output wakes them, and they see the end too.
            pass_.output_ended = True
            progress.ended = True
            pass_.output.close()
            self._say_if_short(pass_, progress)
            raise StopIteration
        if isinstance(item, Failure):
            pass_.fail(item.error)  # wakes the threads sharing this iterator: they raise it too
            err = self._take_error(pass_)
            self._told.add(threading.get_ident())
            raise err from err.__cause__
        assert isinstance(item, Delivery)
        images = item.images
        if item.lent is not None:
            pool.claim(item.lent)
        if self._cuda:
            wait_for(pass_.cfg.device, item.event, item.device_tensors())
        book.delivered(images.shape[0])
        progress.record(item.indices)
        self._hooks.delivered(BatchInfo(pass_.epoch, progress.first_batch + item.number,
                                        torch.from_numpy(item.indices)))
        return item.batch()

    def _get(self, pass_: Pass, t0: float) -> Any:
        """The next item of the pass's output; raises the timeout error past ``timeout``
        and names samples stuck for longer than ``STUCK_WARNING_S`` while it waits."""
        timeout = self._timeout
        while True:
            wait = _WATCH_S
            if timeout is not None:
                wait = min(wait, t0 + timeout - time.perf_counter())
            try:
                return pass_.output.get(timeout=max(wait, 0.0))
            except TimeoutError:
                pass
            waited = time.perf_counter() - t0
            if timeout is not None and waited >= timeout:
                # The pass's error: threads sharing this iterator raise it too.
                pass_.fail(FeederTimeoutError(_timeout_message(pass_, timeout, waited)))
                self._told.add(threading.get_ident())
                raise self._take_error(pass_) from None
            for phase, index, path, age in pass_.in_flight(STUCK_WARNING_S):
                if index not in self._warned:
                    self._warned.add(index)
                    log.warning("sample %d (%s) has been in stage %r for %.0f s; the training "
                                "loop is waiting for it (Feeder(timeout=...) turns this into an "
                                "error)", index, safe_text(path), phase, age)

    def _closed(self, pass_: Pass) -> None:
        """The pass's output was closed while (or before) this thread waited: say why."""
        me = threading.get_ident()
        err = self._take_error(pass_)
        if err is not None and me not in self._told:
            self._told.add(me)
            raise err from err.__cause__
        if pass_.was_replaced():
            raise FeederError(
                "this pass was stopped because a new pass of the same feeder started "
                "(iter(feeder) again, e.g. an evaluation loop or zip(feeder, feeder)) before "
                "it ended; use one pass at a time, or a second Feeder for the other loop")
        raise StopIteration from None

    def _take_error(self, pass_: Pass) -> BaseException | None:
        """The pass's error, moved into this iterator. Once raised, its traceback holds
        this iterator's frame; left in the pass (which the feeder's finalizer keeps
        reachable), it would keep the iterator and the feeder alive for good."""
        with self._failure_lock:
            err = self._failure
            if err is None:
                err = pass_.error
                if err is not None:
                    self._failure = err
                    pass_.error = None
            return err

    def __len__(self) -> int:
        return self._hooks.length()

    def _say_if_short(self, pass_: Pass, progress: Progress) -> None:
        """At the end of a pass that delivered fewer batches than ``len(feeder)``
        (samples skipped under ``on_error="skip"``): say so once, with the counts,
        for the progress bar that stopped short of its total."""
        planned = self._hooks.length()
        skipped = len(progress.skipped())
        if progress.batches >= planned or not skipped:
            return
        log.warning("epoch %d ended after %d of its %d batches (len(feeder) counts a pass that "
                    "skips nothing): %d sample(s) left out under on_error='skip', and the samples "
                    "after each filled its place", pass_.epoch, progress.batches, planned, skipped)


def _timeout_message(pass_: Pass, timeout: float, waited: float) -> str:
    # A sample in a stage for most of the wait is named: it may have started a
    # moment after the wait did (in the isolated engine, in the worker, after the
    # pass reached it), so "longer than the whole timeout" would miss it.
    stuck = sorted(pass_.in_flight(timeout / 2), key=lambda row: -row[3])
    msg = f"no batch within timeout={timeout:g} s (waited {waited:.1f} s)"
    if stuck:
        rows = "; ".join(f"sample {index} ({safe_text(path)}) in stage {phase!r} for {age:.1f} s"
                         for phase, index, path, age in stuck[:8])
        more = f" and {len(stuck) - 8} more" if len(stuck) > 8 else ""
        return f"{msg}: {rows}{more}"
    busy = sorted(pass_.in_flight(), key=lambda row: -row[3])
    oldest = "".join(f"; the oldest: sample {index} ({safe_text(path)}) in stage {phase!r} for {age:.1f} s"
                     for phase, index, path, age in busy[:1])
    return (f"{msg}; no sample has been in a stage for that long "
            f"({len(busy)} in flight): the pipeline is slower than the timeout allows{oldest}")


def _stop_pass(ref: "weakref.ref[Pass]") -> None:
    """The loop dropped the iterator of this pass (run by the reaper thread)."""
    pass_ = ref()
    if pass_ is not None:
        pass_.stop()
