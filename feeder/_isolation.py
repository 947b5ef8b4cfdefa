"""The isolated engine (``Feeder(isolation="process")``): the threaded pipeline in one
worker process, batches in shared memory, the transfer stage in the training process.

::

    training process                                  worker process (forked or spawned)
    ProcessEngine ──── control pipe ────────────────▶ _Worker: an _Engine whose buffer
      │  start/stop pass, free/claim buffer,             pool is in shared memory; its
      │  consumer waiting, stats request, close          passes end in a Shipper stage
      receiver thread ◀──── batch ready / end / error / stats ──── Shipper
      └▶ [shipped] ─▶ transfer thread (the same Transfer stage) ─▶ [output] ─▶ next()

The design note ``docs/design/isolated-engine.md`` ("The isolated engine" in
the docs site) explains why it exists, how buffers are shared, how the start
method is chosen (what makes a fork unsafe, and what the fork does about
OpenCV's pool, the reaper and the receiving threads), what a forked worker
drops, and its lifetime; the measured start-up times are on the site's
results page (from ``bench/results/isolation_ab.txt``). Comments below give
the local reasons.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import cv2
import numpy as np
import torch
import torch.multiprocessing  # noqa: F401 - registers the reductions that share tensors' memory

from ._augment import Chain
from . import _reaper
from ._batch import BatchBuffer, BufferPool, MaskPlanes
from ._pipeline import PassEnding, settings, stage_threads
from ._queue import END, Channel, Closed
from ._sample import OBJECT, Schema
from ._stage import Counters, Stage, of_ended_pass
from ._stats import Stats, StatsBook
from ._threads import LibraryThreads
from ._transfer import BatchTransforms, Converter, SideStream, Transfer
from .errors import ConfigError, FeederError, FieldError, StageError, safe_text

log = logging.getLogger(__name__)

# How long the training process waits for the worker to answer a stats request
# (seconds); a busy worker answers in milliseconds (its control thread does no
# pipeline work), a dead one never.
_QUERY_S = 0.5
# How long the fork check waits, in all, for the threads of ended passes to exit
# (see quiet_threads); they have left their loops, so it is milliseconds.
_SETTLE_S = 0.5
# close() must return within about a second, whatever the worker is doing: it
# waits this long for the worker to exit on its own (it does within milliseconds
# unless a thread holds its GIL in C code), then kills it.
_EXIT_GRACE_S = 0.3
# A message that cannot be read: how long to wait to see whether the worker died.
_DEATH_CHECK_S = 0.2
# close(): the worker's last figures (for stats() after close) are worth this long.
_LAST_STATS_S = 0.1
# The channel between the receiving thread and the transfer thread. The worker
# cannot ship more batches than it has buffers, so this is never full in
# practice; it only must not be the reason the receiver blocks.
_SHIPPED_CAPACITY = 1 << 12
# cudaHostRegisterPortable: the registration holds in every CUDA context.
_CUDA_HOST_REGISTER_PORTABLE = 1


def _dumps(obj: Any) -> bytes:
    return bytes(ForkingPickler.dumps(obj))


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (with its cause), else a :class:`FeederError`
    carrying its text (a cause raised by user code may not pickle)."""
    try:
        ForkingPickler.loads(_dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        pass
    text = safe_text(f"{type(error).__name__}: {error}")
    cause = error.__cause__
    if cause is not None:
        text += safe_text(f" (caused by {type(cause).__name__}: {cause})")
    return FeederError(text)


def worker_config(config: Any) -> Any:
    """The worker's configuration: the CPU stages only (dtype, normalization and
    batch transforms run in the training process's transfer stage)."""
    return dataclasses.replace(config, device=torch.device("cpu"), dtype=None, normalize=None,
                               batch_transforms=(), isolation="thread", start_method="auto")


def payload(config: Any, source: Any, transforms: list[Any], engine: type,
            method: str = "spawn", chosen: str = "") -> bytes:
    """What the worker is built from, pickled; an object that cannot be sent is a
    :class:`~feeder.errors.ConfigError` naming it and how to fix it. ``chosen``:
    why ``start_method="auto"`` chose ``method`` (empty when it was given)."""
    config = worker_config(config)
    parts = [("source", source)] + [(f"transforms[{i}]", t) for i, t in enumerate(transforms)]
    pickled = []
    for what, obj in parts:
        try:
            pickled.append(_dumps(obj))
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
    return _dumps((engine, config, pickled[0], pickled[1:]))


# -- the worker process --------------------------------------------------------
class _Link:
    """One end of the control pipe, shared by several threads: one message at a time."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: tuple) -> None:
        data = _dumps(message)
        with self.lock:
            self.conn.send_bytes(data)

    def send_error(self, kind: str, pass_id: int, error: BaseException) -> None:
        self.send((kind, pass_id, portable(error)))


class Shipper(Stage):
    """The worker's last stage, in place of :class:`~feeder._transfer.Transfer`: collates
    finished buffers (in order when asked) and announces each to the training process."""

    def __init__(self, control: Any, collator: Any, pool: Any, inbox: Channel, outbox: Channel,
                 worker: "_Worker", pass_id: int) -> None:
        super().__init__("transfer", 1, control, inbox, outbox)
        self.collator = collator
        self.pool = pool
        self.worker = worker
        self.pass_id = pass_id
        self._skips = 0  # skipped indices already reported
        self._schema: tuple | None = None  # the schema as last reported

    def work(self, c: Counters) -> None:
        link = self.worker.link
        try:
            while True:
                batch = self.get(c)
                if batch is END:
                    for buf, n in self.collator.finish():
                        self.ship(buf, n, c)
                    link.send(("end", self.pass_id, self._new_skips()))
                    return
                try:
                    for buf, n in self.collator.add(batch):
                        self.ship(buf, n, c)
                except FeederError as err:
                    link.send_error("error", self.pass_id, err)
                    return
        except Closed:
            # Stopped: by the training process (nothing to say), or by a failure
            # of another stage, which the pass holds by now (fail() sets it first).
            error = getattr(self.control, "error", None)
            if error is not None:
                link.send_error("error", self.pass_id, error)
            raise
        except (OSError, EOFError):
            raise Closed("control pipe") from None  # the training process is gone
        except Exception as exc:  # noqa: BLE001 - every failure must reach the loop
            err = StageError("transfer", f"{type(exc).__name__}: {exc}")
            err.__cause__ = exc
            link.send_error("error", self.pass_id, err)
            raise Closed("failed") from None

    def _new_skips(self) -> list[int]:
        skipped = self.control.skipped_indices
        new = list(skipped[self._skips:])
        self._skips += len(new)
        return new

    def ship(self, buf: BatchBuffer, n: int, c: Counters) -> None:
        c.items += 1
        fresh = {}
        known = self.worker.announced.setdefault(buf.serial, set())
        for key, tensor in _shared_tensors(buf):
            if key not in known:
                fresh[key] = tensor
        lists = {name: values[:n] for name, values in buf.lists.items()}
        wide = buf.planes.wide[:n].copy() if buf.planes is not None else None
        schema = self.worker.schema_state()
        if schema == self._schema:
            schema = None
        self.pool.lend(buf)  # until the training process sends it back
        message = ("batch", self.pass_id, buf.serial, n, buf.indices[:n].copy(), fresh, lists, wide,
                   schema, self._new_skips())
        try:
            data = _dumps(message)
        except Exception as exc:
            self.pool.release(buf)
            raise StageError("transfer", f"a batch's per-sample fields could not be pickled to "
                             f"reach the training process ({type(exc).__name__}: {exc}); with "
                             f"isolation='process' every passed-through field must be "
                             f"picklable") from exc
        with self.worker.link.lock:
            self.worker.link.conn.send_bytes(data)
        known.update(fresh)
        if schema is not None:
            self._schema = schema


def _shared_tensors(buf: BatchBuffer) -> Iterator[tuple[str, torch.Tensor]]:
    yield "images", buf.images_t
    yield "labels", buf.labels_t
    for name, (tensor, _) in list(buf.arrays.items()):
        yield f"array:{name}", tensor
    planes = buf.planes
    if planes is not None:
        yield "low", planes.low_t
        if planes.high_t is not None:
            yield "high", planes.high_t


def _check_fields_cross(work: Any) -> None:
    """Make ``work``'s per-sample step check that each passed-through field value
    can be pickled to the training process.

    Checked per sample, in the worker's augment step: a value that cannot cross
    (a lock, a lambda a custom source put in a dict) is then that sample's
    :class:`~feeder.errors.FieldError`, naming the field, and the engine names
    the sample and follows ``on_error`` (skipped and counted under ``"skip"``).
    Found only when the whole batch is pickled, it could name neither and would
    fail the pass. Only passed-through values are checked: arrays, masks and
    boxes always pickle.
    """
    transform_sample = work.transform_sample

    def checked(*args: Any, **kwargs: Any) -> list[tuple[str, str, Any]]:
        record = transform_sample(*args, **kwargs)
        for name, kind, value in record:
            if kind == OBJECT:
                _check_picklable(name, value)
        return record

    work.transform_sample = checked


def _check_picklable(name: str, value: Any) -> None:
    """Raise :class:`FieldError` naming ``name`` when ``value`` cannot be sent."""
    try:
        # Plain pickle: multiprocessing's pickler would move a tensor's memory
        # into a shared segment just to check it.
        pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
        return
    except Exception as exc:  # noqa: BLE001 - pickle raises many types
        first = exc
    try:
        _dumps(value)  # what multiprocessing's own reductions can send (a socket...)
        return
    except Exception:  # noqa: BLE001 - reported with the first failure
        pass
    raise FieldError(name, f"holds {safe_text(type(value).__name__)}, which cannot be pickled to "
                           f"the training process ({type(first).__name__}: {first}); with "
                           f"isolation='process' every passed-through field crosses a process "
                           f"boundary: return a picklable value (str, numbers, lists, dicts, "
                           f"arrays), drop the field, or use isolation='thread'") from None


class _Worker:
    """The worker process's side: an engine and the loop serving the control pipe."""

    def __init__(self, conn: Any, engine_class: type, config: Any, source: Any,
                 transforms: list[Any]) -> None:
        self.link = _Link(conn)
        chain = Chain(list(transforms), config.image_size, config.max_pixels,
                      config.max_image_size, config.size_divisibility)
        self.engine = engine = engine_class(config, source, chain)
        h, w = chain.image_size
        engine.pool = BufferPool(config.num_buffers, config.batch_size, h, w, pin=False, shared=True)
        engine.sink = self._sink
        self.pass_id = 0
        self.announced: dict[int, set[str]] = {}  # buffer serial -> tensors the parent has
        _check_fields_cross(engine.work)

    def schema_state(self) -> tuple:
        schema = self.engine.work.schema
        return (dict(schema.specs), schema.keys, schema.is_dict, schema.classic)

    def _sink(self, control: Any, collator: Any, pool: Any, inbox: Channel, outbox: Channel) -> Shipper:
        return Shipper(control, collator, pool, inbox, outbox, self, self.pass_id)

    def serve(self) -> None:
        conn = self.link.conn
        engine = self.engine
        pool = engine.pool
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the training process closed the pipe or died
            kind = message[0]
            if kind == "free" or kind == "claim":
                buf = pool.buffer(message[1])
                if buf is not None:
                    (pool.release if kind == "free" else pool.claim)(buf)
            elif kind == "waiting":
                pool.set_consumer_waiting(message[1])
            elif kind == "start":
                self.pass_id = message[1]
                try:
                    engine.start_pass(*message[2:])
                except BaseException as exc:  # noqa: BLE001 - the loop must learn it
                    self.link.send_error("error", self.pass_id, exc)
            elif kind == "stop":
                run = engine.current
                if run is not None and self.pass_id == message[1]:
                    run.stop()
            elif kind == "stats":
                run = engine.current
                rows = run.in_flight() if run is not None else []
                self.link.send(("stats", message[1], engine.stats(), rows))
            elif kind == "close":
                return


def _die_with_parent(parent: int | None, watch: bool) -> None:
    """Have the kernel kill this process when its parent dies (Linux): the training
    process, or with ``forkserver`` (``parent`` None) the fork server, which exits
    when the training process is gone.

    The kernel's "parent" is the thread that started the process, not its
    process: a worker started from a thread other than the main one would be
    killed when that thread ends (a set-up thread, a pool building loaders), so
    then ``watch`` is False and the end of the control pipe alone ends the
    worker when the training process dies."""
    if not watch:
        return
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:  # it died before the call above
        os._exit(1)


def _forget_parent(inherited: Any) -> None:
    """In a forked worker: drop what it inherited from the training process and must
    not keep or run. The parent's end of the control pipe: while the worker holds
    a copy, the pipe never ends when the training process closes it or dies. The
    parent's Python signal handlers (a trainer's SIGTERM checkpoint handler must
    not run here) and its wakeup fd (an event loop's socket). The other feeders'
    engines, threads and pipe ends are dealt with by the at-fork hooks of
    ``_feeder`` and ``_reaper``."""
    inherited.close()
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)


def _one_thread_pools() -> None:
    """Library pools of one thread: the worker's decode threads are its parallelism.

    In a forked worker this must come before any torch op: the parent's OpenMP
    pool does not exist here, and a parallel region would wait for it forever.
    With one thread torch never enters one (what DataLoader's workers do)."""
    torch.set_num_threads(1)
    cv2.setNumThreads(1)  # the parent parked its pool for the fork (LibraryThreads.parked)


def worker_main(conn: Any, data: Any, parent: int | None, inherited: Any = None,
                watch_parent: bool = True) -> None:
    """The worker process's entry point. ``data``: the pickled :func:`payload`
    (spawn, forkserver), or the objects themselves with the parent's end of the
    pipe as ``inherited`` (fork). ``watch_parent``: whether to be killed with the
    thread that started this process (see :func:`_die_with_parent`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent, watch_parent)
    if inherited is not None:
        _forget_parent(inherited)
    _one_thread_pools()
    try:
        if isinstance(data, bytes):
            engine_class, config, source, transforms = ForkingPickler.loads(data)
            source = ForkingPickler.loads(source)
            transforms = [ForkingPickler.loads(t) for t in transforms]
        else:
            engine_class, config, source, transforms = data
        worker = _Worker(conn, engine_class, config, source, transforms)
    except BaseException as exc:  # noqa: BLE001 - the training process must learn why
        if isinstance(data, bytes):
            text = (f"the feeder's worker process could not load the source and transforms: "
                    f"{type(exc).__name__}: {exc}. Classes and functions defined in an interactive "
                    f"session, a notebook or 'python -c' live in a __main__ the worker cannot "
                    f"import: move them to a module, use start_method='fork' (Linux), or use "
                    f"isolation='thread'")
        else:
            text = (f"the feeder's worker process could not set up its engine: "
                    f"{type(exc).__name__}: {exc}")
        err = FeederError(safe_text(text))
        with contextlib.suppress(Exception):
            conn.send_bytes(_dumps(("fatal", 0, err)))
        os._exit(1)
    worker.serve()
    worker.engine.stop()
    # Daemon threads may be inside user code; nothing here needs an orderly exit
    # (the shared memory is released by the kernel with the mappings). os._exit
    # runs no atexit handler (a forked worker has the parent's); what the
    # worker's own code printed is flushed (the parent flushed before a fork).
    _flush_stdio()
    os._exit(0)


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


# -- starting the worker -------------------------------------------------------
# The isolated engines of this process: their receiving threads are held still for a fork.
_engines: "weakref.WeakSet[ProcessEngine]" = weakref.WeakSet()


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
    reaper = _reaper._thread
    if reaper is not None:
        quiet[reaper] = _reaper.busy
    for engine in list(_engines):
        receiver = getattr(engine, "receiver", None)
        if receiver is not None:
            quiet[receiver] = engine.busy
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


# -- the training process ------------------------------------------------------
class _Shipped:
    """A batch the worker announced: its buffer's view in this process and how many samples."""

    __slots__ = ("buf", "n")

    def __init__(self, buf: BatchBuffer, n: int) -> None:
        self.buf, self.n = buf, n


class _Passthrough:
    """The transfer stage's collator here: the worker already sequenced the batches."""

    def add(self, item: Any) -> Iterator[tuple[BatchBuffer, int]]:
        if isinstance(item, BaseException):
            raise item if isinstance(item, FeederError) else FeederError(str(item))
        yield item.buf, item.n

    def finish(self) -> Iterator[tuple[BatchBuffer, int]]:
        return iter(())


class RemotePool:
    """The buffer pool as the training process sees it: each transition is a message."""

    def __init__(self, engine: "ProcessEngine") -> None:
        self._engine = engine

    @property
    def allocated(self) -> int:
        remote = self._engine.remote
        return remote.buffers if remote is not None else 0

    def release(self, buf: BatchBuffer) -> None:
        self._engine.send(("free", buf.serial))

    def lend(self, buf: BatchBuffer) -> None:
        pass  # the worker marked it lent when it shipped it

    def claim(self, buf: BatchBuffer) -> None:
        self._engine.send(("claim", buf.serial))

    def set_consumer_waiting(self, waiting: bool) -> None:
        self._engine.send(("waiting", waiting))


class RemotePass(PassEnding):
    """The training process's side of one pass: the transfer stage and the output.

    It offers what :class:`~feeder._pipeline.Pass` offers the iterator and the
    engine; the other stages run in the worker under the same pass number."""

    def __init__(self, engine: "ProcessEngine", pass_id: int, epoch: int, cfg: Any) -> None:
        """``cfg``: the engine's settings with the pass's resolved device."""
        self.engine = engine
        self.pass_id = pass_id
        self.cfg = cfg
        self.pool = engine.pool
        self.book = engine.book
        self.epoch = epoch
        self.error: BaseException | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self.finished = threading.Event()
        self.replaced = False
        self.output_ended = False
        self.orphaned = False
        self.skipped_indices: list[int] = []
        self.inbox = Channel("shipped", _SHIPPED_CAPACITY)
        self.output = Channel("output", cfg.queue_size)
        self.channels = (self.inbox, self.output)
        self.book.attach_channel(self.output)
        self.seed = engine.seed_of_pass
        self.stage = Transfer(self, _Passthrough(), engine.pool, cfg.device,
                              Converter(cfg.dtype, cfg.normalize, cfg.device, cfg.memory_format),
                              self.inbox, self.output,
                              BatchTransforms(cfg.batch_transforms, self.seed, epoch, cfg.device)
                              if cfg.batch_transforms else None, engine.schema, engine.side,
                              cfg.size_divisibility if cfg.max_image_size is not None else None)
        self.stages = (self.stage,)

    def start(self) -> None:
        self.stage.start()

    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> None:
        first = not self._stopped
        self._stopped = True
        if self.orphaned:
            return
        for item in self.inbox.close():
            if isinstance(item, _Shipped):
                self.pool.release(item.buf)
        self.output.close()
        if first:
            self.engine.send(("stop", self.pass_id))

    def in_flight(self, older_than: float = 0.0) -> list[tuple[str, int, str, float]]:
        rows = self.engine.in_flight()
        return [row for row in rows if row[3] > older_than]

    def join(self, timeout: float) -> bool:
        return self.finished.wait(timeout)

    def threads(self) -> list[threading.Thread]:
        return list(self.stage.threads)

    def fold_output(self) -> None:
        self.book.fold_channel(self.output)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
        self.stop()

    def deliver(self, item: Any) -> None:
        """The receiving thread hands over a shipped batch, the end, or an error."""
        try:
            self.inbox.put(item)
        except Closed:
            if isinstance(item, _Shipped):
                self.pool.release(item.buf)

    def thread_started(self, stage: str, c: Counters) -> None:
        self.book.attach_thread(stage, c)

    def thread_exited(self, stage: str, c: Counters) -> None:
        self.book.fold_thread(stage, c)
        self.finished.set()

    def sample_failed(self, step: str, task: Any, exc: BaseException, c: Counters) -> None:
        raise AssertionError("no sample is processed in the training process")


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


class ProcessEngine:
    """The isolated engine's training-process side; the interface of ``_feeder._Engine``."""

    def __init__(self, config: Any, source: Any, chain: Any, transforms: list[Any],
                 engine: type) -> None:
        """``engine``: the thread engine's class, which the worker runs (passed in, as
        it lives in the module that builds this one)."""
        self.config = config
        self.settings = settings(config)
        self.book = StatsBook(stage_threads(self.settings))
        self.pool = RemotePool(self)
        self.schema = Schema()
        self.lock = threading.Lock()
        self.current: RemotePass | None = None
        self.passes: list[RemotePass] = []
        self._by_id: dict[int, RemotePass] = {}
        self._ids = 0
        self.seed_of_pass = 0
        self.closed = False
        self.dead: BaseException | None = None  # why the worker is gone, once it is
        self.remote: Stats | None = None  # the worker's latest stats
        self._rows: list = []  # its samples in flight, as of then
        self._queries: dict[int, threading.Event] = {}
        self._mirrors: dict[int, BatchBuffer] = {}  # buffer serial -> this process's view
        self._registered: list[int] = []  # addresses page-locked with cudaHostRegister
        self._cuda = config.device.type == "cuda"
        # CUDA: the side stream(s), made once, and the device resolved per pass.
        self.side = SideStream(config.device) if self._cuda else None
        self.conn: Any = None
        self.process: Any = None
        self.start_method = ""
        self._send_lock = threading.Lock()
        # Held while the receiving thread handles a message (see quiet_threads).
        self.busy = threading.Lock()
        self._start_worker(config, source, transforms, engine)
        self.receiver = threading.Thread(target=self._receive, name="feeder-receive", daemon=True)
        self.receiver.start()
        _engines.add(self)

    def _start_worker(self, config: Any, source: Any, transforms: list[Any], engine: type) -> None:
        """Start the worker by the start-method rule (the module's docstring)."""
        requested = config.start_method
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
                    self._launch("fork", (engine, worker_config(config), source, list(transforms)),
                                 why)
                    return
                why = (f"other threads are running ({', '.join(others)}): a lock one of them "
                       f"holds would stay held in a forked child")
                method = "spawn"
        chosen = why.removeprefix("auto: ") if requested == "auto" else ""
        self._launch(method, payload(config, source, transforms, engine, method, chosen), why)

    def _launch(self, method: str, data: Any, why: str) -> None:
        ctx = multiprocessing.get_context(method)
        mine, theirs = ctx.Pipe()
        # A forked worker closes its copy of this process's end first thing.
        parent = None if method == "forkserver" else os.getpid()
        # The fork server's worker is its child, whichever thread asked for it.
        watch = method == "forkserver" or threading.current_thread() is threading.main_thread()
        args = (theirs, data, parent, mine if method == "fork" else None, watch)
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
        self.conn, self.process, self.start_method = mine, process, method
        log.info("feeder worker process %d started with %s (%s)", process.pid, method, why)

    # -- messages ----------------------------------------------------------------
    def send(self, message: tuple) -> None:
        """Send ``message`` to the worker; nothing happens once it is gone (the
        receiving thread reports that)."""
        conn = self.conn
        if conn is None:
            return
        with self._send_lock:
            with contextlib.suppress(OSError, ValueError):
                conn.send(message)

    def _receive(self) -> None:
        conn = self.conn
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break
            with self.busy:
                if not self._handle(data):
                    break
        if self.closed:
            return
        # Held as for a message: failing the passes takes their locks, which a
        # fork must not copy held (see quiet_threads).
        with self.busy:
            self.dead = self.dead or _death_error(self.process)
            log.error("%s", self.dead)
            if self.process is not None and self.process.exitcode is not None:
                reclaim_segments(self.process.pid)
            self._fail_current(self.dead)
            for event in list(self._queries.values()):
                event.set()

    def _handle(self, data: bytes) -> bool:
        """Act on one message; False when the worker is gone."""
        try:
            message = ForkingPickler.loads(data)
        except Exception as exc:  # noqa: BLE001 - a message that cannot be unpickled
            # A batch's shared arrays are fetched from the worker while unpickling:
            # a worker killed meanwhile is its death, not an unreadable message.
            self.process.join(_DEATH_CHECK_S)
            if self.process.exitcode is not None:
                return False
            self._fail_current(FeederError(f"a message from the feeder's worker process could "
                                           f"not be read: {type(exc).__name__}: {exc}"))
            return True
        kind = message[0]
        if kind == "batch":
            self._on_batch(message)
        elif kind == "end" or kind == "error":
            run = self._by_id.get(message[1])
            if run is not None:
                if kind == "end":
                    run.skipped_indices.extend(message[2])
                    run.deliver(END)
                else:
                    run.deliver(message[2])
        elif kind == "stats":
            self.remote, self._rows = message[2], message[3]
            event = self._queries.pop(message[1], None)
            if event is not None:
                event.set()
        elif kind == "fatal":
            self.dead = message[2]
        return True

    def _fail_current(self, error: BaseException) -> None:
        for run in list(self.passes):
            run.fail(FeederError(str(error)) if run is not self.current else error)

    def _on_batch(self, message: tuple) -> None:
        _, pass_id, serial, n, indices, fresh, lists, wide, schema, skips = message
        buf = self._mirrors.get(serial)
        if buf is None:
            buf = self._mirrors[serial] = _mirror(serial)
        for key, tensor in fresh.items():
            _attach(buf, key, tensor)
            if self._cuda:
                self._register(tensor)
        buf.indices = indices
        buf.lists = lists
        if wide is not None:
            buf.planes.wide = wide
        if schema is not None:
            s = self.schema
            s.specs, s.keys, s.is_dict, s.classic = schema
        run = self._by_id.get(pass_id)
        if run is None or run.stopped():
            self.send(("free", serial))
            return
        run.skipped_indices.extend(skips)
        run.deliver(_Shipped(buf, n))

    def _register(self, tensor: torch.Tensor) -> None:
        """Page-lock a shared array in place, so copies from it run asynchronously.

        Pageable memory would make every ``non_blocking`` copy wait for the host
        side (the driver stages it through a pinned bounce buffer). Registered
        "portable", it counts as pinned in every CUDA context, whichever device
        this thread has current. It is made with the pass's device current (for
        the context it needs): this thread's own would be GPU 0, a context there
        in every torchrun rank (test_side_stream_drained_before_unregister)."""
        ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if size == 0:
            return
        with self.side.current():
            code = torch.cuda.cudart().cudaHostRegister(ptr, size, _CUDA_HOST_REGISTER_PORTABLE)
        if int(code) != 0:
            log.warning("cudaHostRegister of a %d-byte shared batch array failed (%s): copies "
                        "from it will not overlap the training step", size, code)
            return
        self._registered.append(ptr)

    def _query(self, timeout: float = _QUERY_S) -> None:
        """Ask the worker for its stats and samples in flight; wait up to ``timeout`` s."""
        if self.dead is not None or self.closed:
            return
        event = threading.Event()
        token = id(event)
        self._queries[token] = event
        self.send(("stats", token))
        event.wait(timeout)
        self._queries.pop(token, None)

    def in_flight(self) -> list:
        self._query()
        return list(self._rows)

    # -- the _Engine interface -----------------------------------------------------
    def start_pass(self, seed: int, epoch: int, rank: int, world_size: int,
                   done: Any = None) -> RemotePass:
        with self.lock:
            if self.closed:
                raise FeederError("the feeder is closed")
            if self.dead is not None:
                raise FeederError(str(self.dead))
            if self.current is not None:
                self.current.replace()
                self.current.fold_output()
            self.passes = [p for p in self.passes if not p.finished.is_set()]
            self._by_id = {p.pass_id: p for p in self.passes}
            self.book.start()
            self._ids += 1
            self.seed_of_pass = seed
            cfg = self.settings
            if self.side is not None:
                # Before the worker is told to start: its first batch is registered
                # with this device current (see _register).
                cfg = dataclasses.replace(cfg, device=self.side.begin_pass())
            run = RemotePass(self, self._ids, epoch, cfg)
            self.current = run
            self.passes.append(run)
            self._by_id[run.pass_id] = run
            run.start()
            self.send(("start", run.pass_id, seed, epoch, rank, world_size, done))
            return run

    def stats(self) -> Stats:
        self._query()
        local = self.book.snapshot(0)
        remote = self.remote
        if remote is None:
            return local
        stages = tuple(local.stage("transfer") if s.name == "transfer" else s
                       for s in remote.stages)
        queues = (tuple(q for q in remote.queues if q.name != "output")
                  + tuple(q for q in local.queues if q.name == "output"))
        return Stats(stages, queues, local.samples, local.batches, remote.skipped,
                     local.consumer_wait_s, local.elapsed_s, remote.buffers, remote.skipped_paths,
                     local.waiting_in_next, remote.active_threads)

    def stop(self) -> list[RemotePass]:
        locked = self.lock.acquire(timeout=1.0)
        try:
            first = not self.closed
            if first and self.dead is None:
                self._query(_LAST_STATS_S)  # the worker's last figures, for stats() after close()
            self.closed = True
            passes = list(self.passes)
            for run in passes:
                run.stop()
            if self.current is not None:
                self.current.fold_output()
            if first:
                self.send(("close",))
        finally:
            if locked:
                self.lock.release()
        return passes

    def free(self) -> None:
        process = self.process
        if process is not None and self.conn is not None:
            process.join(_EXIT_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join(0.2)
        if process is not None and process.exitcode is not None:
            reclaim_segments(process.pid)  # killed above, or by a signal during the run
        conn, self.conn = self.conn, None
        if conn is not None:
            with self._send_lock:
                conn.close()
        # No copy may read registered memory once it is unregistered: the transfer
        # threads wait for each copy's event before a buffer goes back, and were
        # joined by close(); a collected feeder's are given a moment here. A
        # transfer thread still running (or stuck) may have copies in flight: the
        # side streams are drained first and take no new copy after
        # (test_side_stream_drained_before_unregister; gpu-check "teardown while
        # the side stream is busy").
        if self._registered:
            deadline = time.monotonic() + 0.2
            for run in self.passes:
                run.join(max(0.0, deadline - time.monotonic()))
            side = self.side
            if side is not None and side.close():
                cudart = torch.cuda.cudart()
                with side.current():  # this thread's own device may have no context
                    for ptr in self._registered:
                        cudart.cudaHostUnregister(ptr)
                self._registered = []
        elif self.side is not None:
            self.side.close()
        self._mirrors = {}

    def close(self, timeout: float = 1.0) -> None:
        passes = self.stop()
        deadline = time.monotonic() + 0.3 * timeout
        me = threading.current_thread()
        for run in passes:
            if me not in run.threads():
                run.join(max(0.0, deadline - time.monotonic()))
        self.free()

    def after_fork(self) -> None:
        """In a forked child of the training process: the worker is the parent's.

        The child closes its copy of the pipe's end: while a copy is open, the
        worker would not see the pipe end when the training process dies."""
        self.lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.busy = threading.Lock()
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()
        self.process = None
        self.dead = FeederError("this feeder's worker process belongs to the process that forked")
        for run in self.passes:
            run.orphan()
        # The views of this feeder's shared batch buffers: kept, they would keep the
        # buffers mapped in the child (another feeder's worker, say) until it
        # exits, holding their /dev/shm memory after this feeder is closed.
        self.passes = []
        self._by_id = {}
        self.current = None
        self._mirrors = {}


def _mirror(serial: int) -> BatchBuffer:
    buf = BatchBuffer.__new__(BatchBuffer)
    buf.serial = serial
    buf.pin = False
    buf.shared = True
    buf.arrays = {}
    buf.lists = {}
    buf.planes = None
    return buf


def _attach(buf: BatchBuffer, key: str, tensor: torch.Tensor) -> None:
    if key == "images":
        buf.images_t, buf.images = tensor, tensor.numpy()
    elif key == "labels":
        buf.labels_t, buf.labels = tensor, tensor.numpy()
    elif key.startswith("array:"):
        buf.arrays[key[6:]] = (tensor, tensor.numpy())
    else:
        planes = buf.planes
        if planes is None:
            planes = buf.planes = MaskPlanes.__new__(MaskPlanes)
            planes.high_t = planes.high = None
            planes._pin = False
            planes._shared = True
            planes.wide = np.zeros(tensor.shape[0], np.bool_)
        if key == "low":
            planes.low_t, planes.low = tensor, tensor.numpy()
        else:
            planes.high_t, planes.high = tensor, tensor.numpy()


# Where torch's shared-memory segments have names (Linux), and how it names them:
# torch_<pid of the allocating process>_<random>_<counter>.
_SHM_DIR = "/dev/shm"


def reclaim_segments(pid: int) -> list[str]:
    """Unlink the shared-memory segments that the exited worker ``pid`` left named.

    The worker's batch buffers are torch shared memory: torch creates each under
    a name made from the worker's pid, maps it and unlinks the name at once, so
    the memory lives as long as a mapping does. A worker killed (SIGKILL: the OOM
    killer, or close() after its grace) between the creation and the unlink
    leaves the name, and its memory, in ``/dev/shm`` until reboot. Once the
    worker has exited no name with its pid can still be in use (the training
    process maps its buffers through descriptors, not names), so every one of
    ours is removed. Called only after the worker has exited: a live worker's
    name may be between its creation and its unlink.

    Returns:
        The names removed (logged at WARNING).
    """
    prefix = f"torch_{pid}_"
    try:
        names = [n for n in os.listdir(_SHM_DIR) if n.startswith(prefix)]
    except OSError:  # no /dev/shm (not Linux): torch's segments have no names there
        return []
    uid = os.getuid()
    removed = []
    for name in names:
        path = os.path.join(_SHM_DIR, name)
        try:
            if os.lstat(path).st_uid != uid:
                continue  # another user's: a reused pid, never this feeder's
            os.unlink(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(name)
    if removed:
        log.warning("removed %d shared-memory segment(s) the exited worker process (pid %d) "
                    "left in %s: %s", len(removed), pid, _SHM_DIR, ", ".join(removed))
    return removed


def _death_error(process: Any) -> FeederError:
    """What the training loop is told when the worker process is gone."""
    process.join(1.0)
    code = process.exitcode
    what = f"the feeder's worker process (pid {process.pid})"
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        text = f"{what} was killed by {name}"
        if -code == signal.SIGKILL:
            text += (" (the kernel's OOM killer is a common cause: look for 'Out of memory' in "
                     "dmesg or the system log; fewer decode_threads, a smaller queue_size or "
                     "lighter samples need less memory)")
        elif -code == signal.SIGBUS:
            text += (" (a SIGBUS usually means /dev/shm, where the batch buffers live, is full: "
                     "containers often give it 64 MB; raise it, e.g. docker run --shm-size=2g, "
                     "or use isolation='thread')")
        return FeederError(text)
    if code is None:
        return FeederError(f"{what} closed its control pipe and did not exit")
    return FeederError(f"{what} exited unexpectedly with exit code {code}")
