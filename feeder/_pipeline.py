"""One pass over the data: the stages wired by bounded channels, and its lifecycle.

::

    sampler ─▶ [decode] ─▶ decode pool ─▶ [augment] ─▶ augment pool ─▶ [collate] ─▶ transfer ─▶ [output] ─▶ next()
       │ takes a free buffer per batch                     writes into the buffer slot       │ returns buffers
       └──────────────────────────────── BufferPool ◀──────────────────────────────────────────┘

Each ``Feeder.__iter__`` starts a new :class:`Pass` with fresh threads and
channels, so an abandoned pass (an early ``break``) can never leak a stale
batch into the next one. A pass owns the buffers it took until it delivers or
releases them; whatever it still owns when its last thread exits goes back to
the pool then, when no thread can write into it any more.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ._augment import Augmenter, Chain
from ._batch import BatchBuffer, BufferPool, Scratch
from ._decode import DecodeBuffers, Decoder, buffer_of
from ._queue import END, Channel
from ._sampler import Sampler, Task
from ._stage import Counters, Stage, timed_put
from ._stats import StatsBook
from ._transfer import Transfer
from .errors import ConfigError, FeederError, SampleError
from .sources import describe

if TYPE_CHECKING:
    from ._config import Config

log = logging.getLogger(__name__)


class Pass:
    """The threads, channels and buffers of one pass over one epoch."""

    def __init__(self, config: "Config", source, chain: Chain, pool: BufferPool, book: StatsBook,
                 decode_buffers: DecodeBuffers, scratch: Scratch, seed: int, epoch: int, rank: int,
                 world_size: int) -> None:
        self.config = config
        self.source = source
        self.chain = chain
        self.hint = chain.hint
        self.pool = pool
        self.book = book
        self.seed = seed
        self.epoch = epoch
        self.rank = rank
        self.world_size = world_size
        self.device = config.device
        self.max_pixels = config.max_pixels
        self.decode_buffers = decode_buffers
        self.scratch = scratch
        self.error: BaseException | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._owned: dict[int, BatchBuffer] = {}
        self._live_threads = 0
        self.finished = threading.Event()  # set when the last thread has exited
        # Set when a newer pass of the same feeder stopped this one before the
        # loop had everything: the iterator then says so instead of ending quietly.
        self.replaced = False
        # Set in a forked child: this pass's threads do not exist there.
        self.orphaned = False

        self.tasks = Channel("decode", config.decode_queue)
        self.ready = Channel("collate", config.num_buffers + 1)
        self.output = Channel("output", config.queue_size)
        if config.inline_augment:
            # No augment pool: the decode threads run the transforms and feed the collator.
            self.channels = (self.tasks, self.ready, self.output)
            self.decoded: Channel | None = None
            self.augmenter = Augmenter(self, 0, None, self.ready)
        else:
            self.decoded = Channel("augment", config.augment_queue)
            self.channels = (self.tasks, self.decoded, self.ready, self.output)
            self.augmenter = Augmenter(self, config.augment_threads, self.decoded, self.ready)
        self.stages: tuple[Stage, ...] = (
            Sampler(self, 1, None, self.tasks),
            Decoder(self, config.decode_threads, self.tasks, self.decoded or self.ready),
            self.augmenter,
            Transfer(self, 1, self.ready, self.output),
        )
        for ch in self.channels:
            book.attach_channel(ch)

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        log.debug("pass epoch=%d starting", self.epoch)
        # Count every thread before starting any: a fast stage (the sampler of a
        # tiny epoch) may exit before the next stage starts, and a count that
        # touched zero would hand the pass's buffers back while still in use.
        self._live_threads = sum(stage.num_threads for stage in self.stages)
        try:
            for stage in self.stages:
                stage.start()
        except BaseException:
            # The OS refused a thread: stop what runs and stop counting the rest.
            self.stop()
            never = sum(1 for s in self.stages for t in s.threads if t.ident is None)
            never += sum(s.num_threads - len(s.threads) for s in self.stages)
            self._gone(never)
            raise

    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> None:
        """Close every channel: each thread leaves at its next queue operation. Safe to repeat.

        Never call it from a finalizer (it takes locks): hand it to ``_reaper.defer``."""
        self._stopped = True
        if self.orphaned:
            return  # a forked child: no thread to stop, and the locks may be held by ghosts
        with self._lock:
            owned = list(self._owned.values())
        self.pool.retire(owned)
        for ch in self.channels:
            ch.close()

    def replace(self) -> None:
        """A newer pass of the same feeder starts: stop this one, and remember whether
        the training loop had not yet taken everything it would have delivered."""
        # Decided under the lock: a consumer in another thread, woken by the close,
        # reads ``replaced`` only after taking the lock (see ``was_replaced``).
        with self._lock:
            left = self.output.close()
            self.replaced = not self.output_ended and not (len(left) == 1 and left[0] is END)
        self.stop()

    def was_replaced(self) -> bool:
        with self._lock:
            return self.replaced

    # Set once the training loop has taken the end of the pass (see _PassIterator).
    output_ended = False

    def orphan(self) -> None:
        """In a forked child: this pass's threads are gone, and any lock they held
        at the fork stays held forever. Make every later call return at once."""
        self.orphaned = True
        self._stopped = True
        self._lock = threading.Lock()
        self._live_threads = 0
        self._owned.clear()
        self.finished = threading.Event()
        self.finished.set()

    def in_flight(self, older_than: float = 0.0) -> list[tuple[str, int, str, float]]:
        """Samples a thread of this pass has worked on for more than ``older_than``
        seconds: (phase, index, path, seconds), oldest first."""
        now = time.perf_counter()
        out = []
        for stage in self.stages:
            for c in stage.counters:
                cur = c.current
                if cur is None or c.ended is not None:
                    continue
                phase, index, since = cur
                if now - since > older_than:
                    out.append((phase, index, describe(self.source, index), now - since))
        out.sort(key=lambda row: -row[3])
        return out

    def fail(self, error: BaseException) -> None:
        """A stage broke outside any sample: remember the first error and stop."""
        with self._lock:
            if self.error is None:
                self.error = error
        self.stop()

    def thread_exited(self, stage: Stage, c: Counters) -> None:
        self.book.fold_thread(stage.name, c)
        self._gone(1)

    def _gone(self, threads: int) -> None:
        with self._lock:
            self._live_threads -= threads
            last = self._live_threads == 0
            owned = list(self._owned.values()) if last else []
            if last:
                self._owned.clear()
        if last:
            # No thread of this pass can touch these buffers any more.
            for buf in owned:
                self.pool.release(buf)
            for ch in self.channels[:-1]:
                self.book.fold_channel(ch)
            log.debug("pass epoch=%d: all threads exited", self.epoch)
            self.finished.set()

    def fold_output(self) -> None:
        """Add the output channel's counters to the feeder's totals (once)."""
        self.book.fold_channel(self.output)

    def join(self, timeout: float) -> bool:
        return self.finished.wait(timeout)

    def threads(self) -> list[threading.Thread]:
        return [t for s in self.stages for t in s.threads]

    # -- buffers -----------------------------------------------------------
    def own(self, buf: BatchBuffer) -> None:
        with self._lock:
            self._owned[buf.serial] = buf

    def release(self, buf: BatchBuffer) -> None:
        """The pass is done with ``buf``: back to the pool."""
        with self._lock:
            self._owned.pop(buf.serial, None)
        self.pool.release(buf)

    def lend(self, buf: BatchBuffer) -> None:
        """``buf`` now belongs to the training loop (a view of it was handed out)."""
        with self._lock:
            self._owned.pop(buf.serial, None)
        self.pool.lend(buf)

    # -- per-sample failures -----------------------------------------------
    def sample_error(self, stage: str, task: Task, exc: BaseException) -> SampleError:
        return SampleError(stage, task.index, describe(self.source, task.index), exc)

    def sample_failed(self, stage: str, task: Task, exc: Exception, c: Counters) -> None:
        """Record that ``task`` failed in ``stage``; the slot is done either way."""
        err = self.sample_error(stage, task, exc)
        path = err.path
        self.decode_buffers.give(buffer_of(task.image))
        task.image = None
        batch = task.batch
        cfg = self.config
        # A configuration mistake would fail every sample alike: never skipped.
        skip = cfg.on_error == "skip" and not isinstance(exc, ConfigError)
        if skip:
            count = self.book.skipped(path, err)
            if cfg.max_skipped is not None and count > cfg.max_skipped:
                skip = False
                budget = FeederError(f"more than max_skipped={cfg.max_skipped} samples skipped; "
                                     f"last: {err}")
                budget.__cause__ = err
                err = budget  # type: ignore[assignment]
        if skip:
            batch.holes.append(task.slot)
        else:
            batch.fail(task.slot, err)
        if batch.finish_slot():
            timed_put(c, self.ready, batch)
