"""The worker process: a :class:`~feeder.engine.engine.ThreadEngine` whose buffers are in
shared memory, its passes ending in a :class:`Shipper`, and the loop serving the
control pipe (:func:`worker_main`)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
from collections.abc import Callable
from typing import Any

import cv2
import torch
import torch.multiprocessing  # noqa: F401 - registers the reductions that share tensors' memory

from ..ops.chain import Chain
from ..engine.buffers import BatchBuffer
from ..engine.collate import CollatingStage, Collator
from ..engine.config import Config
from ..engine.engine import ThreadEngine
from ..engine.queue import Channel, Closed
from ..sample import OBJECT
from ..engine.stage import Control, Counters
from ..errors import FeederError, FieldError, StageError, safe_text
from . import protocol as msg


class Shipper(CollatingStage):
    """The worker's last stage, in place of :class:`~feeder.engine.transfer.Transfer`: collates
    finished buffers (in order when asked) and announces each to the training process.

    Args:
        pass_id: The pass it ships for (every message names it).
        send: Sends a message to the training process.
        send_bytes: Sends a message already pickled.
        known: The keys of the shared arrays of a buffer (by serial) that the
            training process has already been sent; the set is updated here.
        schema: The samples' fields as they stand (``Schema.state``).
    """

    def __init__(self, control: Control, collator: Collator, pool: Any, inbox: Channel,
                 outbox: Channel, pass_id: int, send: Callable[[Any], None],
                 send_bytes: Callable[[bytes], None], known: Callable[[int], set[str]],
                 schema: Callable[[], tuple]) -> None:
        super().__init__(control, collator, pool, inbox, outbox)
        self.pass_id = pass_id
        self._send, self._send_bytes = send, send_bytes
        self._known, self._schema_now = known, schema
        self._skips = 0  # skipped indices already reported
        self._schema: tuple | None = None  # the schema as last reported

    def work(self, c: Counters) -> None:
        try:
            error = self.collate(c, self.ship)
            if error is None:
                self._send(msg.End(self.pass_id, self._new_skips()))
            else:
                self._send(msg.Error(self.pass_id, msg.portable(error)))
        except Closed:
            # Stopped: by the training process (nothing to say), or by a failure
            # of another stage, which the pass holds by now (fail() sets it first).
            error = getattr(self.control, "error", None)
            if error is not None:
                self._send(msg.Error(self.pass_id, msg.portable(error)))
            raise
        except (OSError, EOFError):
            raise Closed("control pipe") from None  # the training process is gone
        except Exception as exc:  # noqa: BLE001 - every failure must reach the loop
            err = StageError("transfer", f"{type(exc).__name__}: {exc}")
            err.__cause__ = exc
            self._send(msg.Error(self.pass_id, msg.portable(err)))
            raise Closed("failed") from None

    def _new_skips(self) -> list[int]:
        skipped = self.control.skipped_indices
        new = list(skipped[self._skips:])
        self._skips += len(new)
        return new

    def ship(self, buf: BatchBuffer, n: int, c: Counters) -> None:
        c.items += 1
        known = self._known(buf.serial)
        fresh = {key: tensor for key, tensor in buf.shared_tensors() if key not in known}
        lists = {name: values[:n] for name, values in buf.lists.items()}
        wide = buf.planes.wide[:n].copy() if buf.planes is not None else None
        schema = self._schema_now()
        if schema == self._schema:
            schema = None
        self.pool.lend(buf)  # until the training process sends it back
        message = msg.Shipped(self.pass_id, buf.serial, n, buf.indices[:n].copy(), fresh, lists,
                              wide, schema, self._new_skips())
        try:
            data = msg.dumps(message)
        except Exception as exc:
            self.pool.release(buf)
            raise StageError("transfer", f"a batch's per-sample fields could not be pickled to "
                             f"reach the training process ({type(exc).__name__}: {exc}); with "
                             f"isolation='process' every passed-through field must be "
                             f"picklable") from exc
        self._send_bytes(data)
        known.update(fresh)
        if schema is not None:
            self._schema = schema


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
        msg.dumps(value)  # what multiprocessing's own reductions can send (a socket...)
        return
    except Exception:  # noqa: BLE001 - reported with the first failure
        pass
    raise FieldError(name, f"holds {safe_text(type(value).__name__)}, which cannot be pickled to "
                           f"the training process ({type(first).__name__}: {first}); with "
                           f"isolation='process' every passed-through field crosses a process "
                           f"boundary: return a picklable value (str, numbers, lists, dicts, "
                           f"arrays), drop the field, or use isolation='thread'") from None


class Worker:
    """The worker process's side: an engine and the loop serving the control pipe."""

    def __init__(self, conn: Any, config: Config, source: Any, transforms: list[Any]) -> None:
        self.link = msg.Link(conn)
        sizes = config.sizes
        chain = Chain(list(transforms), sizes.image_size, config.decode.max_pixels,
                      sizes.max_image_size, sizes.size_divisibility)
        self.pass_id = 0
        self.announced: dict[int, set[str]] = {}  # buffer serial -> tensors the parent has
        self.engine = ThreadEngine(config, source, chain, shared=True, tail=self._tail)
        _check_fields_cross(self.engine.work)

    def _known(self, serial: int) -> set[str]:
        return self.announced.setdefault(serial, set())

    def _tail(self, control: Any, collator: Collator, pool: Any, inbox: Channel,
              outbox: Channel) -> Shipper:
        return Shipper(control, collator, pool, inbox, outbox, self.pass_id, self.link.send,
                       self.link.send_bytes, self._known, self.engine.work.schema.state)

    def serve(self) -> None:
        conn = self.link.conn
        engine = self.engine
        pool = engine.pool
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the training process closed the pipe or died
            if isinstance(message, (msg.Free, msg.Claim)):
                buf = pool.buffer(message.serial)
                if buf is not None:
                    (pool.release if isinstance(message, msg.Free) else pool.claim)(buf)
            elif isinstance(message, msg.Waiting):
                pool.set_consumer_waiting(message.waiting)
            elif isinstance(message, msg.Start):
                self.pass_id = message.pass_id
                try:
                    engine.start_pass(message.seed, message.epoch, message.rank,
                                      message.world_size, message.done)
                except BaseException as exc:  # noqa: BLE001 - the loop must learn it
                    self.link.send_error(self.pass_id, exc)
            elif isinstance(message, msg.Stop):
                pass_ = engine.current
                if pass_ is not None and self.pass_id == message.pass_id:
                    pass_.stop()
            elif isinstance(message, msg.StatsRequest):
                pass_ = engine.current
                rows = pass_.in_flight() if pass_ is not None else []
                self.link.send(msg.StatsReply(message.token, engine.stats(), rows))
            elif isinstance(message, msg.Close):
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
    ``feeder.engine.engine`` and ``feeder.engine.reaper``."""
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
    """The worker process's entry point. ``data``: None when the pickled
    :func:`~feeder.isolation.start.payload` comes first on ``conn`` (spawn,
    forkserver), or the objects themselves with the parent's end of the pipe as
    ``inherited`` (fork).
    ``watch_parent``: whether to be killed with the thread that started this
    process (see :func:`_die_with_parent`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent, watch_parent)
    if inherited is not None:
        _forget_parent(inherited)
    _one_thread_pools()
    try:
        if data is None:  # spawn, forkserver: the payload comes first on the pipe
            data = conn.recv_bytes()
        if isinstance(data, bytes):
            config, source, transforms = msg.loads(data)
            source = msg.loads(source)
            transforms = [msg.loads(t) for t in transforms]
        else:
            config, source, transforms = data
        worker = Worker(conn, config, source, transforms)
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
            conn.send_bytes(msg.dumps(msg.Fatal(err)))
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
