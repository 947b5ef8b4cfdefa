"""The isolated engine's training-process side: :class:`ProcessEngine` (the
:class:`~feeder.engine.engine.Engine` interface over a worker process), its passes
(:class:`IsolatedPass`: the transfer stage and the output), and what it does
when the worker dies."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..engine import reaper as _reaper
from ..engine.buffers import BatchBuffer
from ..engine.config import Config
from ..engine.engine import EngineBase
from ..engine.pinned import PinnedHost
from ..engine.pipeline import PassBase
from ..engine.queue import END, Channel, Closed
from ..sample import Schema
from ..engine.stage import Counters
from ..engine.stats import Stats
from ..engine.transfer import Transfer
from ..errors import FeederError
from . import protocol as msg
from .start import start_worker

log = logging.getLogger(__name__)

# How long the training process waits for the worker to answer a stats request (s);
# a busy worker answers in milliseconds (its control thread does no pipeline work).
_QUERY_S = 0.5
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
    """The buffer pool as the training process sees it: each transition is a message.

    Args:
        send: Sends a message to the worker.
        remote: The worker's latest stats (None before the first).
    """

    def __init__(self, send: Callable[[Any], None], remote: Callable[[], Stats | None]) -> None:
        self._send, self._remote = send, remote

    @property
    def allocated(self) -> int:
        remote = self._remote()
        return remote.buffers if remote is not None else 0

    def release(self, buf: BatchBuffer) -> None:
        self._send(msg.Free(buf.serial))

    def lend(self, buf: BatchBuffer) -> None:
        pass  # the worker marked it lent when it shipped it

    def claim(self, buf: BatchBuffer) -> None:
        self._send(msg.Claim(buf.serial))

    def set_consumer_waiting(self, waiting: bool) -> None:
        self._send(msg.Waiting(waiting))


class IsolatedPass(PassBase):
    """The training process's half of one pass: the transfer stage and the output.

    It offers what :class:`~feeder.engine.pipeline.Pass` offers the iterator and the
    engine; the other stages run in the worker under the same pass number.

    Args:
        cfg: The engine's settings with the pass's resolved device.
        pool: The worker's pool, as seen from here.
        book: The engine's stats.
        pass_id: The pass's number, in every message about it.
        seed, epoch: The pass's.
        schema: The samples' fields, as the worker reported them.
        side: The engine's side streams (CUDA), or None.
        send: Sends a message to the worker.
        remote_in_flight: The worker's samples in flight (asks it).
    """

    def __init__(self, cfg: Config, pool: RemotePool, book: Any, pass_id: int, seed: int,
                 epoch: int, schema: Schema, side: Any, send: Callable[[Any], None],
                 remote_in_flight: Callable[[], list]) -> None:
        super().__init__(cfg, pool, book, epoch)
        self.pass_id, self.seed = pass_id, seed
        self._send = send
        self._remote_in_flight = remote_in_flight
        self.inbox = Channel("shipped", _SHIPPED_CAPACITY)
        self.output = Channel("output", cfg.threads.queue_size)
        self.channels = (self.inbox, self.output)
        self.book.attach_channel(self.output)
        self.stage = Transfer.for_pass(cfg.output, cfg.sizes.padding, self, _Passthrough(), pool,
                                       self.inbox, self.output, seed, epoch, schema, side)
        self.stages = (self.stage,)

    def start(self) -> None:
        self.stage.start()

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
            self._send(msg.Stop(self.pass_id))

    def in_flight(self, older_than: float = 0.0) -> list[tuple[str, int, str, float]]:
        return [row for row in self._remote_in_flight() if row[3] > older_than]

    def deliver(self, item: Any) -> None:
        """The receiving thread hands over a shipped batch, the end, or an error."""
        try:
            self.inbox.put(item)
        except Closed:
            if isinstance(item, _Shipped):
                self.pool.release(item.buf)

    def thread_exited(self, stage: str, c: Counters) -> None:
        self.book.fold_thread(stage, c)
        self.finished.set()

    def sample_failed(self, step: str, task: Any, exc: BaseException, c: Counters) -> None:
        raise AssertionError("no sample is processed in the training process")


class ProcessEngine(EngineBase):
    """The isolated engine's training-process side (``Feeder(isolation="process")``).

    Args:
        config: The feeder's configuration.
        source: What the worker reads samples from.
        transforms: The CPU transforms the worker runs.
    """

    # close() waits for the transfer threads briefly and quietly: most of its
    # time is the worker's (see free()).
    _join_share = 0.3
    _warn_stuck = False

    def __init__(self, config: Config, source: Any, transforms: list[Any]) -> None:
        super().__init__(config := config.resolved(source))  # "auto", "tune" resolved
        self.pool = RemotePool(self.send, lambda: self.remote)
        self.schema = Schema()
        self._by_id: dict[int, IsolatedPass] = {}
        self._ids = 0
        self.dead: BaseException | None = None  # why the worker is gone, once it is
        self.remote: Stats | None = None  # the worker's latest stats
        self._rows: list = []  # its samples in flight, as of then
        self._queries: dict[int, threading.Event] = {}
        self._mirrors: dict[int, BatchBuffer] = {}  # buffer serial -> this process's view
        # The shared arrays page-locked in place (with the pass's device current).
        self.pinned = PinnedHost()
        self._cuda = config.output.device.type == "cuda"
        self._send_lock = threading.Lock()
        # Held while the receiving thread handles a message (see quiet_threads).
        self.busy = threading.Lock()
        self.conn: Any = None
        self.process: Any = None
        self.conn, self.process, self.start_method = start_worker(config, source, transforms)
        self.receiver = threading.Thread(target=self._receive, name="feeder-receive", daemon=True)
        self.receiver.start()
        _reaper.ensure_running()
        self._go_live()

    def quiet_locks(self) -> list[tuple[threading.Thread, threading.Lock]]:
        return [(self.receiver, self.busy)]

    # -- messages ----------------------------------------------------------------
    def send(self, message: Any) -> None:
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
            message = msg.loads(data)
        except Exception as exc:  # noqa: BLE001 - a message that cannot be unpickled
            # A batch's shared arrays are fetched from the worker while unpickling:
            # a worker killed meanwhile is its death, not an unreadable message.
            self.process.join(_DEATH_CHECK_S)
            if self.process.exitcode is not None:
                return False
            self._fail_current(FeederError(f"a message from the feeder's worker process could "
                                           f"not be read: {type(exc).__name__}: {exc}"))
            return True
        if isinstance(message, msg.Shipped):
            self._on_batch(message)
        elif isinstance(message, (msg.End, msg.Error)):
            pass_ = self._by_id.get(message.pass_id)
            if pass_ is not None:
                if isinstance(message, msg.End):
                    pass_.skipped_indices.extend(message.skips)
                    pass_.deliver(END)
                else:
                    pass_.deliver(message.error)
        elif isinstance(message, msg.StatsReply):
            self.remote, self._rows = message.stats, message.rows
            event = self._queries.pop(message.token, None)
            if event is not None:
                event.set()
        elif isinstance(message, msg.Fatal):
            self.dead = message.error
        return True

    def _fail_current(self, error: BaseException) -> None:
        for pass_ in list(self.passes):
            pass_.fail(FeederError(str(error)) if pass_ is not self.current else error)

    def _on_batch(self, message: msg.Shipped) -> None:
        serial = message.serial
        buf = self._mirrors.get(serial)
        if buf is None:
            buf = self._mirrors[serial] = BatchBuffer.mirror(serial)
        for key, tensor in message.fresh.items():
            buf.attach(key, tensor)
            if self._cuda:
                self._register(tensor)
        buf.indices = message.indices
        buf.lists = message.lists
        if message.wide is not None:
            buf.planes.wide = message.wide
        if message.schema is not None:
            self.schema.adopt(message.schema)
        pass_ = self._by_id.get(message.pass_id)
        if pass_ is None or pass_.stopped():
            self.send(msg.Free(serial))
            return
        pass_.skipped_indices.extend(message.skips)
        pass_.deliver(_Shipped(buf, message.n))

    def _register(self, tensor: torch.Tensor) -> None:
        """Page-lock a shared array in place, so copies from it run asynchronously.

        Pageable memory would make every ``non_blocking`` copy wait for the host
        side (the driver stages it through a pinned bounce buffer). Registered
        "portable", it counts as pinned in every CUDA context, whichever device
        this thread has current. It is made with the pass's device current (for
        the context it needs): this thread's own would be GPU 0, a context there
        in every torchrun rank (test_side_stream_drained_before_unregister). The
        ledger keeps the array mapped until it is unregistered."""
        self.pinned.device = self.side.device
        self.pinned.register(tensor)

    def _query(self, timeout: float = _QUERY_S) -> None:
        """Ask the worker for its stats and samples in flight; wait up to ``timeout`` s."""
        if self.dead is not None or self.closed:
            return
        event = threading.Event()
        token = id(event)
        self._queries[token] = event
        self.send(msg.StatsRequest(token))
        event.wait(timeout)
        self._queries.pop(token, None)

    def in_flight(self) -> list:
        self._query()
        return list(self._rows)

    # -- the Engine interface (EngineBase's hooks) ------------------------------------
    def _admit(self) -> None:
        if self.dead is not None:
            raise FeederError(str(self.dead))

    def _prepare(self) -> None:
        self._by_id = {p.pass_id: p for p in self.passes}

    def _new_pass(self, cfg: Config, seed: int, epoch: int, rank: int, world_size: int,
                  done: Any) -> IsolatedPass:
        # The side stream's device is resolved by now: the worker is told to start
        # after it, so its first batch is registered with this device current.
        self._ids += 1
        pass_ = IsolatedPass(cfg, self.pool, self.book, self._ids, seed, epoch, self.schema,
                           self.side, self.send, self.in_flight)
        self._by_id[pass_.pass_id] = pass_
        return pass_

    def _started(self, pass_: IsolatedPass, seed: int, epoch: int, rank: int, world_size: int,
                 done: Any) -> None:
        dead = self.dead  # died since _admit: the receiver's failing may have missed this pass
        if dead is not None:
            return pass_.fail(dead)
        self.send(msg.Start(pass_.pass_id, seed, epoch, rank, world_size, done))

    def _closing(self) -> None:
        if self.dead is None:
            self._query(_LAST_STATS_S)  # the worker's last figures, for stats() after close()

    def _closed_now(self) -> None:
        self.send(msg.Close())

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
                     local.waiting_in_next, remote.active_threads, remote.memory)

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
        # No copy may read registered memory once it is unregistered: the transfer threads
        # wait for each copy's event before a buffer goes back, and were joined by close();
        # a collected feeder's are given a moment here. A transfer thread still running (or
        # stuck) may have copies in flight: the side streams are drained first and take no
        # new copy after (test_side_stream_drained_before_unregister; gpu-check "teardown
        # while the side stream is busy"). If the drain cannot start, the shared arrays stay
        # registered, and mapped (the ledger and the mirrors keep them), for the life of the
        # process (test_isolated_close_that_times_out_keeps_the_mirrors_registered).
        side = self.side
        if self.pinned.locked_bytes:
            deadline = time.monotonic() + 0.2
            for pass_ in self.passes:
                pass_.join(max(0.0, deadline - time.monotonic()))
            if side is None or side.close():
                self.pinned.unregister_all()
            else:
                return
        elif side is not None:
            side.close()
        self._mirrors = {}

    def after_fork(self) -> None:
        """In a forked child of the training process: the worker is the parent's.

        The child closes its copy of the pipe's end: while a copy is open, the
        worker would not see the pipe end when the training process dies."""
        super().after_fork()
        self._send_lock = threading.Lock()
        self.busy = threading.Lock()
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()
        self.process = None
        self.dead = FeederError("this feeder's worker process belongs to the process that forked")
        # The views of this feeder's shared batch buffers: kept, they would keep the
        # buffers mapped in the child (another feeder's worker, say) until it
        # exits, holding their /dev/shm memory after this feeder is closed.
        self._by_id = {}
        self.current = None
        self._mirrors = {}
        self.pinned.forget()  # page locks are the parent's, not inherited


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
