"""One pass over the data: the stages wired by bounded channels, and its lifecycle.

The topology is data: :func:`topology` lists the map stages as :class:`StageSpec`
entries (a name, a thread count, the steps each thread runs on a sample), and
:class:`Pass` builds one bounded channel in front of each and the sampler and
transfer stages around them. The default, ``augment_threads=0``:

::

    sampler ─▶ [read] ─▶ read: read ─▶ [decode] ─▶ decode: decode, augment ─▶ [collate] ─▶ transfer ─▶ [output] ─▶ next()
       │ takes a free buffer per batch   (bytes held: ReadBudget)   writes into the buffer slot   │ lends / returns buffers
       └─────────────────────────────────────── BufferPool ◀─────────────────────────────────────┘

Reads have threads of their own (``read_threads``, many: a thread waiting on
storage costs no CPU), so a slow read never idles a decode thread; what they
have read and the decode threads have not yet taken is capped in count (the
decode inbox) and in bytes (``read_ahead_bytes``, see ``read.py``).
``read_threads=0`` reads in the decode threads: ``decode: read, decode, augment``.
With ``augment_threads=N`` the augment step gets a stage of its own:
``decode: decode ─▶ [augment] ─▶ augment: augment ─▶ [collate]``.

Each ``Feeder.__iter__`` starts a new :class:`Pass` with fresh threads and
channels, so an abandoned pass (an early ``break``) can never leak a stale
batch into the next one. The buffers a pass holds are recorded in the pool's
ledger with the pass as their owner; whatever it still holds when its last
thread exits goes back to the pool then, when no thread can write into it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from .batch import BufferPool, Scratch
from .collate import Collator, pad_batch
from .config import Config
from .queue import END, Channel
from .read import BudgetedOutbox, ReadBudget, ReadWaits, releasing
from ..sample import Task
from ..sample.rng import epoch_key
from ..order.group import ScanStopped
from ..order.plan import EpochPlan
from ..order.sequence import Hinting, Order, Remaining
from .queue import Closed
from .sampler import Sampler
from .stage import Counters, ErrorOptions, MapStage, RunAt, Stage, Step, timed_put
from .stats import StatsBook
from .threads import ThreadOptions
from .transfer import Transfer
from .tune import Gate, TunedThreads, Tuning
from .steps import SampleWork, steps
from ..errors import ConfigError, FeederError, SampleError
from ..sources import describe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageSpec:
    """One map stage of the topology.

    Attributes:
        name: Stage name (stats, thread names ``feeder-<name>-i``, its inbox's name).
        threads: Threads running it.
        steps: What each thread runs on a sample, in order.
        queue: Capacity of its inbox.
        out_bytes: A byte budget its outputs hold until the next stage takes them.
    """

    name: str
    threads: int
    steps: tuple[Step, ...]
    queue: int
    # What the stage outputs holds these bytes until the next stage takes it.
    out_bytes: ReadBudget | None = None


def topology(threads: ThreadOptions, read: Step, decode: Step, augment: Step,
             budget: ReadBudget | None = None) -> list[StageSpec]:
    """The map stages between the sampler and the transfer stage, in order.

    ``budget`` bounds the bytes between the read and the decode stage (a new one
    per pass; None builds one from the settings)."""
    t = threads
    specs = []
    if t.read_threads:
        budget = budget or ReadBudget(t.read_ahead_bytes)
        specs.append(StageSpec("read", t.read_threads, (read,), t.read_queue, budget))
        decode_steps = (releasing(decode, budget),)
    else:
        decode_steps = (read, decode)
    if t.augment_threads == 0:
        # The decode threads run the transforms on what they have just decoded:
        # no hand-off (queue round trip, wake-up, image crossing cores) per sample.
        inline = dataclasses.replace(augment, inline=True)
        return [*specs, StageSpec("decode", t.decode_threads, (*decode_steps, inline), t.decode_queue)]
    return [*specs, StageSpec("decode", t.decode_threads, decode_steps, t.decode_queue),
            StageSpec("augment", t.augment_threads, (augment,), t.augment_queue)]


def task_run(threads: ThreadOptions, batch_size: int) -> int:
    """Samples per queue item from the sampler (see ``Sampler``'s ``run``): up to
    8 of a batch, and at least 4 items per batch for each decode thread, so
    that no thread waits while another holds the batch's last samples; 1 with
    a read stage, whose threads each wait on one read at a time."""
    if threads.read_threads:
        return 1
    return max(1, min(8, batch_size // (4 * max(1, threads.decode_threads))))


def unbuffered_samples(threads: ThreadOptions, batch_size: int) -> int:
    """Most samples of a batch dispatched before it has a buffer (``Sampler``'s
    ``unbuffered``, each one scratch array): the decode queue's capacity, and
    at least one run (:func:`task_run`) for each decode thread, so that every
    thread has work while the loop hands its batch back (one run alone keeps
    one thread busy and leaves the others idle at each batch's end)."""
    return max(threads.decode_queue, int(threads.decode_threads) * task_run(threads, batch_size))


def stage_threads(threads: ThreadOptions) -> dict[str, int]:
    """Every stage's name and thread count, in pipeline order; 0 for a stage whose
    step runs in another stage's threads (the stats show it as ``inline``)."""
    names = {"sampler": 1}
    for spec in topology(threads, Step("read", id), Step("decode", id), Step("augment", id)):
        names[spec.name] = spec.threads
        for step in spec.steps:
            if step.inline:
                names.setdefault(step.name, 0)
    names["transfer"] = 1
    return names


class PassBase:
    """The state and lifecycle both engines' passes share: :class:`Pass` (every
    stage, in this process) and the isolated engine's ``IsolatedPass`` (the
    training process's half: the transfer stage). The iterator and the engine
    use only what is declared here.

    A subclass sets ``output`` (the channel ``next()`` reads), ``channels``
    (every channel of the pass, ``output`` last) and ``stages``, and defines
    :meth:`start`, :meth:`stop`, :meth:`in_flight`, and the rest of the stages'
    :class:`~feeder.engine.stage.Control`: ``thread_exited`` and ``sample_failed``.
    """

    output: Channel
    channels: tuple[Channel, ...]
    stages: tuple[Stage, ...]

    def __init__(self, cfg: Config, pool: Any, book: StatsBook, epoch: int) -> None:
        self.cfg = cfg
        self.pool = pool
        self.book = book
        self.epoch = epoch
        self.error: BaseException | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self.finished = threading.Event()  # set when the last thread has exited
        # Set when a newer pass of the same feeder stopped this one before the
        # loop had everything: the iterator then says so instead of ending quietly.
        self.replaced = False
        # Set once the training loop has taken the end of the pass (see _PassIterator).
        self.output_ended = False
        # Set in a forked child: this pass's threads do not exist there.
        self.orphaned = False
        # Source indices skipped under on_error="skip" (a resumed pass does not retry them).
        self.skipped_indices: list[int] = []

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def in_flight(self, older_than: float = 0.0) -> list[tuple[str, int, str, float]]:
        """Samples a thread of this pass has worked on for more than ``older_than``
        seconds: (step, index, path, seconds), oldest first."""
        raise NotImplementedError

    def stopped(self) -> bool:
        return self._stopped

    def replace(self) -> None:
        """A newer pass of the same feeder starts: stop this one, and remember whether
        the training loop had not yet taken everything it would have delivered."""
        if self.orphaned:
            return  # a forked child: see orphan()
        # Decided under the lock: a consumer in another thread, woken by the close,
        # reads ``replaced`` only after taking the lock (see ``was_replaced``).
        with self._lock:
            left = self.output.close()
            self.replaced = not self.output_ended and not (len(left) == 1 and left[0] is END)
        self.stop()

    def was_replaced(self) -> bool:
        with self._lock:
            return self.replaced

    def orphan(self) -> None:
        """In a forked child: this pass's threads are gone, and any lock they held
        at the fork stays held forever. Make every later call return at once."""
        self.orphaned = True
        self._stopped = True
        self._lock = threading.Lock()
        for ch in self.channels:
            ch.abandon()  # batches queued for the loop: their buffers come back when freed
        self.finished = threading.Event()
        self.finished.set()

    def join(self, timeout: float) -> bool:
        return self.finished.wait(timeout)

    def threads(self) -> list[threading.Thread]:
        return [t for s in self.stages for t in s.threads]

    def fold_output(self) -> None:
        """Add the output channel's counters to the feeder's totals (once)."""
        self.book.fold_channel(self.output)

    # -- Control: what the stages call --------------------------------------
    def fail(self, error: BaseException) -> None:
        """A stage broke outside any sample: remember the first error and stop."""
        with self._lock:
            if self.error is None:
                self.error = error
        self.stop()

    def thread_started(self, stage: str, c: Counters) -> None:
        self.book.attach_thread(stage, c)


class Pass(PassBase):
    """The threads, channels and buffers of one pass over one epoch.

    It is the stages' :class:`~feeder.engine.stage.Control`: the stages call it to fail,
    report a failed sample, and say when a thread starts or exits.
    """

    def __init__(self, cfg: Config, plan: EpochPlan, work: SampleWork, pool: BufferPool,
                 book: StatsBook, scratch: Scratch, seed: int, epoch: int, rank: int,
                 world_size: int, done: Any = None, tail: Any = None, side: Any = None,
                 read_waits: ReadWaits | None = None) -> None:
        """``plan``: the feeder's epoch plan, which gives this pass's order (its
        source is the pass's). ``done``: what an earlier run of this epoch
        already handled (a :class:`~feeder.order.sequence.Handled`), or None.
        ``tail``: builds the pass's last stage from ``(control, collator, pool,
        inbox, outbox)``; None: the transfer stage (the isolated engine's worker
        process ships finished buffers to the training process instead).
        ``read_waits``: where the read stage's threads record how long each read
        waited off the CPU (None: reads are not timed)."""
        super().__init__(cfg, pool, book, epoch)
        source = plan.source
        self.source, self.work = source, work  # what failed samples are named and recycled with
        self._live_threads = 0

        threads, order_options = cfg.threads, cfg.order
        self.errors: ErrorOptions = cfg.errors
        read, decode, augment = steps(source, work, scratch, seed, epoch, inline=threads.augment_threads == 0,
                                      read_inline=threads.read_threads == 0)
        if read_waits is not None and threads.read_threads:
            read = read_waits.timed(read)
        specs = topology(threads, read, decode, augment)
        inboxes = [Channel(spec.name, spec.queue) for spec in specs]
        self.ready = Channel("collate", cfg.num_buffers + 1)
        self.output = Channel("output", threads.queue_size)
        self.channels: tuple[Channel, ...] = (*inboxes, self.ready, self.output)
        outboxes: list[Any] = [*inboxes[1:], self.ready]
        for i, spec in enumerate(specs):
            if spec.out_bytes is not None:
                outboxes[i] = BudgetedOutbox(outboxes[i], spec.out_bytes)

        def order() -> Order:
            try:
                full = plan.order(epoch, rank, world_size, seed, self.stopped,
                                  done.levels if done is not None else ())
            except ScanStopped:  # the pass stopped during a grouping's header scan
                raise Closed() from None
            order = full if done is None else Remaining(full, done)
            if hasattr(source, "will_read") or hasattr(source, "will_read_shards"):
                order = Hinting(order, source)  # lazy shard indices, window prefetch
            return order

        padding = cfg.sizes.padding
        # A pass continuing an epoch begun under another world size delivers every
        # sample left, its last batch short if need be (see EpochPlan.order).
        drop_last = order_options.drop_last and not (done is not None and done.levels)
        collator = Collator(order_options.batch_size, order_options.ordered, drop_last,
                            pool.release, pool.park,
                            functools.partial(pad_batch, padding) if padding is not None else None)
        maps = [MapStage(spec.name, spec.threads, spec.steps, self, inbox, outbox)
                for spec, inbox, outbox in zip(specs, inboxes, outboxes)]
        # "tune": each tuned stage's threads pass a gate, whose count changes where
        # the training loop takes a batch (see tune.py). The tuned pools' counts
        # are TunedThreads (an int whose type says so).
        self.gates: list[Gate] = []
        if threads.tune:
            for spec, stage in zip(specs, maps):
                if isinstance(spec.threads, TunedThreads):
                    # Where the previous pass ended (an epoch shorter than the tuner's
                    # windows would otherwise start from the "auto" count every time).
                    stage.gate = Gate(spec.name, stage.num_threads, stage.busy_s,
                                      book.record_active, start=book.last_active(spec.name))
                    self.gates.append(stage.gate)
        # The decode stage's gate (or the one tuned pool's).
        self.gate: Gate | None = next((g for g in self.gates if g.stage == "decode"),
                                      self.gates[0] if self.gates else None)
        self.tuning = Tuning(self.gates) if self.gates else None
        self.stages: tuple[Stage, ...] = (
            Sampler(self, order, order_options.batch_size, pool, self, scratch, inboxes[0],
                    self.ready, unbuffered=unbuffered_samples(threads, order_options.batch_size),
                    pass_key=epoch_key(seed, epoch), run=task_run(threads, order_options.batch_size)),
            *maps,
            tail(self, collator, pool, self.ready, self.output) if tail is not None else
            Transfer.for_pass(cfg.output, padding, self, collator, pool, self.ready, self.output,
                              seed, epoch, work.schema, side),
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
        if self.tuning is not None:
            self.pool.on_consumer = self.tuning.consumer  # batch boundaries, in both engines
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

    def stop(self) -> None:
        """Close every channel: each thread leaves at its next queue operation. Safe to repeat.

        Never call it from a finalizer (it takes locks): see ``reaper.py``."""
        self._stopped = True
        if self.orphaned:
            return  # a forked child: no thread to stop, and the locks may be held by ghosts
        if self.tuning is not None:
            for gate in self.gates:
                gate.open()  # parked threads leave now, not at their next poll
            if self.pool.on_consumer == self.tuning.consumer:
                self.pool.on_consumer = None
        self.pool.retire(self)
        for ch in self.channels:
            ch.close()

    def orphan(self) -> None:
        self._live_threads = 0
        super().orphan()

    def in_flight(self, older_than: float = 0.0) -> list[tuple[str, int, str, float]]:
        """Samples a thread of this pass has worked on for more than ``older_than``
        seconds: (step, index, path, seconds), oldest first."""
        now = time.perf_counter()
        out = []
        for stage in self.stages:
            for c in stage.counters:
                cur = c.current
                if cur is None or c.ended is not None:
                    continue
                step, index, since = cur
                if type(index) is RunAt:  # a run of tasks taken at once: the one in work
                    index = index.index
                    if index < 0:  # the run has just ended
                        continue
                if now - since > older_than:
                    out.append((step, index, describe(self.source, index), now - since))
        out.sort(key=lambda row: -row[3])
        return out

    # -- Control: what the stages call (and PassBase's) ----------------------
    def thread_exited(self, stage: str, c: Counters) -> None:
        self.book.fold_thread(stage, c)
        self._gone(1)

    def _gone(self, threads: int) -> None:
        with self._lock:
            self._live_threads -= threads
            last = self._live_threads == 0
        if last:
            # No thread of this pass can touch its buffers any more.
            self.pool.reclaim(self)
            for ch in self.channels[:-1]:
                self.book.fold_channel(ch)
            log.debug("pass epoch=%d: all threads exited", self.epoch)
            self.finished.set()

    def sample_failed(self, step: str, task: Task, exc: BaseException, c: Counters) -> None:
        """Record that ``task`` failed in ``step``; its slot is done either way."""
        err = SampleError(step, task.index, describe(self.source, task.index), exc)
        self.work.discard(task.image)
        task.image = task.data = None
        if not isinstance(exc, Exception):
            # SystemExit or KeyboardInterrupt raised by user code: never skippable,
            # but the training loop still learns which sample.
            self.fail(err)
            return
        batch = task.batch
        errors = self.errors
        # A configuration mistake would fail every sample alike: never skipped.
        skip = errors.skip and not isinstance(exc, ConfigError)
        if skip:
            count = self.book.skipped(err.path, err)
            if errors.max_skipped is not None and count > errors.max_skipped:
                skip = False
                budget = FeederError(f"more than max_skipped={errors.max_skipped} samples skipped; "
                                     f"last: {err}")
                budget.__cause__ = err
                err = budget  # type: ignore[assignment]
        if skip:
            self.skipped_indices.append(task.index)
            batch.holes.append(task.slot)
        else:
            batch.fail(task.slot, err)
        if batch.finish_slot():
            timed_put(c, self.ready, batch)

