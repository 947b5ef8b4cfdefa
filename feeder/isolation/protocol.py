"""The control pipe between the training process and the worker: one frozen
dataclass per message kind, and how a message is written.

Training process to worker: :class:`Free`, :class:`Claim`, :class:`Waiting`,
:class:`Start`, :class:`Stop`, :class:`StatsRequest`, :class:`Close`.
Worker to training process: :class:`Shipped`, :class:`End`, :class:`Error`,
:class:`StatsReply`, :class:`Fatal`.

Messages are pickled with multiprocessing's pickler, whose reductions send a
shared tensor as a handle to its memory, not its bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from ..errors import FeederError, safe_text


def dumps(obj: Any) -> bytes:
    """``obj`` pickled as the pipe sends it (shared tensors by handle)."""
    return bytes(ForkingPickler.dumps(obj))


def loads(data: bytes) -> Any:
    return ForkingPickler.loads(data)


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (with its cause), else a :class:`FeederError`
    carrying its text (a cause raised by user code may not pickle)."""
    try:
        loads(dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        pass
    text = safe_text(f"{type(error).__name__}: {error}")
    cause = error.__cause__
    if cause is not None:
        text += safe_text(f" (caused by {type(cause).__name__}: {cause})")
    return FeederError(text)


# -- training process -> worker -------------------------------------------------
@dataclass(frozen=True, slots=True)
class Free:
    """The training process is done with buffer ``serial``: back to the pool."""

    serial: int


@dataclass(frozen=True, slots=True)
class Claim:
    """The training loop took the batch of buffer ``serial`` from the output queue.

    The worker's pool then counts it as lent (see ``BufferPool.claim``): its
    growth policy reads how many batches the loop holds.
    """

    serial: int


@dataclass(frozen=True, slots=True)
class Waiting:
    """A thread of the training loop entered (True) or left (False) ``next()``:
    the worker's pool grows only while the loop is busy elsewhere, and a tuned
    pool takes the loop leaving ``next()`` as its batch boundary."""

    waiting: bool


@dataclass(frozen=True, slots=True)
class Start:
    """Start pass ``pass_id`` (stopping the current one).

    ``done``: the positions of the order a resumed pass skips (a ``Handled``), or None.
    """

    pass_id: int
    seed: int
    epoch: int
    rank: int
    world_size: int
    done: Any = None


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop pass ``pass_id``: its stages' channels close and its threads leave.
    Ignored unless it is the worker's current pass."""

    pass_id: int


@dataclass(frozen=True, slots=True)
class StatsRequest:
    """Answer with a :class:`StatsReply` carrying ``token``."""

    token: int


@dataclass(frozen=True, slots=True)
class Close:
    """The feeder is closed: stop every pass and exit."""


# -- worker -> training process -------------------------------------------------
@dataclass(frozen=True, slots=True)
class Shipped:
    """A batch is ready in shared buffer ``serial``: its first ``n`` slots.

    Attributes:
        fresh: The buffer's shared arrays the training process has not seen yet
            (key -> tensor, see ``BatchBuffer.shared_tensors``).
        lists: The per-slot fields (boxes, passed-through values) of the batch.
        wide: Which mask slots are 16-bit, or None without masks.
        schema: The samples' fields (``Schema.state()``) when they changed, else None.
        skips: Source indices skipped since the last message of the pass.
    """

    pass_id: int
    serial: int
    n: int
    indices: np.ndarray
    fresh: dict[str, Any]
    lists: dict[str, list]
    wide: np.ndarray | None
    schema: tuple | None
    skips: list[int]


@dataclass(frozen=True, slots=True)
class End:
    """Pass ``pass_id`` delivered everything; ``skips`` as in :class:`Shipped`."""

    pass_id: int
    skips: list[int]


@dataclass(frozen=True, slots=True)
class Error:
    """Pass ``pass_id`` failed with ``error``."""

    pass_id: int
    error: BaseException


@dataclass(frozen=True, slots=True)
class StatsReply:
    """The answer to :class:`StatsRequest` ``token``: the worker's stats and its
    samples in flight (step, index, path, seconds)."""

    token: int
    stats: Any
    rows: list


@dataclass(frozen=True, slots=True)
class Fatal:
    """The worker could not set up: ``error`` says why; it exits."""

    error: BaseException


class Link:
    """One end of the control pipe, shared by several threads: one message at a time."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: Any) -> None:
        self.send_bytes(dumps(message))

    def send_bytes(self, data: bytes) -> None:
        with self.lock:
            self.conn.send_bytes(data)

    def send_error(self, pass_id: int, error: BaseException) -> None:
        self.send(Error(pass_id, portable(error)))
