"""What runs inside a :class:`~feeder.Feeder`, for tests and debugging.

A feeder runs its passes in an *engine*: ``feeder.engine.engine.ThreadEngine``
(``isolation="thread"``) or ``feeder.isolation.engine.ProcessEngine``
(``isolation="process"``). The functions here are the one documented way to
reach the engine's parts (its batch buffer pool, the per-sample work, the
passes, the CUDA side stream, the worker process) and to start an iterator's
pass without waiting for a batch, so that a test asserting how the pipeline
behaves does not depend on where the feeder keeps them.

They return the live objects, not copies: the engine's own types, whose
attributes follow the engine and are not a stable API. A training script needs
none of this: what it may rely on is on the :class:`~feeder.Feeder`
(``stats()``, ``num_buffers``, ``worker_pid``, ``start_method``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._consumer import PassIterator
    from ._dataset import FeederDataset
    from ._feeder import Feeder
    from .engine.buffers import BatchBuffer
    from .engine.cuda import SideStream
    from .engine.engine import Engine
    from .engine.pipeline import PassBase
    from .engine.steps import SampleWork

__all__ = [
    "current_pass_of",
    "engine_of",
    "free_buffers_of",
    "pass_of",
    "passes_of",
    "pool_of",
    "side_stream_of",
    "start_pass",
    "work_of",
    "worker_process_of",
]


def engine_of(feeder: Feeder) -> Engine:
    """The engine that runs ``feeder``'s passes (one per feeder, made with it).

    Returns:
        A ``ThreadEngine`` or, with ``isolation="process"``, a ``ProcessEngine``.
    """
    return feeder._engine


def pool_of(feeder: Feeder) -> Any:
    """``feeder``'s batch buffer pool: a ``BufferPool`` (its ``capacity``,
    ``allocated``, ``pinned`` memory, the buffers a pass ``owned_by``); with
    ``isolation="process"``, the training process's handle on the worker's pool."""
    return feeder._engine.pool


def free_buffers_of(feeder: Feeder) -> list[BatchBuffer]:
    """The buffers of ``feeder``'s pool that are free now (neither filling, queued
    nor lent), most recently freed last; a new list each call."""
    pool = feeder._engine.pool
    with pool._cond:
        return list(pool._free)


def work_of(feeder: Feeder | FeederDataset) -> SampleWork:
    """The per-sample work (decode, transforms, the table of JPEGs read to their
    end, the chain's plan and field schema) of ``feeder``'s engine, or of a
    :class:`~feeder.FeederDataset` (``feeder.dataset``: shares the engine's table
    with threads, has its own with ``isolation="process"``).

    Raises:
        AttributeError: ``feeder`` has ``isolation="process"``: that work runs in
            the worker process.
    """
    own = getattr(feeder, "_work", None)
    if own is not None:
        return own
    return feeder._engine.work


def side_stream_of(feeder: Feeder) -> SideStream | None:
    """The CUDA side stream(s) ``feeder`` copies batches on (made once per engine);
    None when ``device`` is the CPU."""
    return feeder._engine.side


def current_pass_of(feeder: Feeder) -> PassBase | None:
    """``feeder``'s pass started last (running or ended), None before the first."""
    return feeder._engine.current


def passes_of(feeder: Feeder) -> list[PassBase]:
    """``feeder``'s passes whose threads may still be alive, oldest first (the
    current one last)."""
    return list(feeder._engine.passes)


def worker_process_of(feeder: Feeder) -> Any:
    """The ``multiprocessing`` process of ``feeder``'s worker with
    ``isolation="process"`` (kept after it exits, for its exit code; None once
    freed in a forked child); None with threads."""
    return getattr(feeder._engine, "process", None)


def start_pass(iterator: PassIterator) -> PassBase:
    """Start ``iterator``'s pass as its first ``next()`` would, without waiting
    for a batch, and return it; the pass already started, if any. Safe to repeat."""
    return iterator._start()


def pass_of(iterator: PassIterator) -> PassBase | None:
    """The pass ``iterator`` delivers, None until it starts (its first ``next()``
    or :func:`start_pass`)."""
    return iterator._pass
