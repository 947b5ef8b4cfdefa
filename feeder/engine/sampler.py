"""The sampler stage: takes a free buffer per batch and dispatches the batch's
samples, in the order the epoch plan gives (:mod:`feeder.order`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .batch import Batch, BufferPool, Scratch
from ..order.epoch import (LAZY_MIN, ShardLayout, check_epoch, epoch_indices, epoch_order, num_batches,
                           pass_order, pass_sequence, shard_layout, shard_order, shard_size, shard_sizes,
                           shard_stream_order)
from ..order.sequence import Order
from .queue import END, Channel
from ..sample import Task
from ..sample.rng import index_keys
from .stage import Control, Counters, Stage

# The order's functions lived here before the order package: still importable.
__all__ = ["LAZY_MIN", "Sampler", "ShardLayout", "check_epoch", "epoch_indices", "epoch_order",
           "num_batches", "pass_order", "pass_sequence", "shard_layout", "shard_order", "shard_size",
           "shard_sizes", "shard_stream_order"]


class Sampler(Stage):
    """Takes a free buffer per batch and dispatches the batch's samples as tasks.

    Args:
        control: The pipeline's control interface.
        order: Returns this pass's sample indices, in order (a list, or an
            :class:`~feeder.order.sequence.Order`: see :func:`pass_sequence`); called in
            the sampler's thread, so a failing source is this stage's error.
        batch_size: Samples per batch.
        pool: Where batch buffers come from; ``owner`` is recorded as their holder.
        scratch: One-sample arrays for samples finished before their batch has a buffer.
        outbox: Where the tasks go (the first map stage's inbox).
        collate: Where a batch goes when binding its buffer completes it (every
            sample dispatched before the binding already failed).
        unbuffered: Most samples of a batch dispatched before it has a buffer
            (each may need a scratch array); default: the outbox's capacity
            (in samples: its items times ``run``).
        pass_key: ``epoch_key(seed, epoch)`` of the pass: each task then carries
            its sample's key (:func:`~feeder.sample.rng.index_keys`, a batch at
            a time); None: the decode step keys each task.
        run: Samples per item on the outbox: above 1, lists of that many of
            a batch's tasks (the last shorter), each one queue item that a
            thread of the first map stage takes whole (one hand-off and wake-up
            for the run instead of one per sample).
    """

    def __init__(self, control: Control, order: Callable[[], Any], batch_size: int, pool: BufferPool,
                 owner: object, scratch: Scratch, outbox: Channel, collate: Channel,
                 unbuffered: int | None = None, pass_key: int | None = None, run: int = 1) -> None:
        super().__init__("sampler", 1, control, None, outbox)
        self.order = order
        self.batch_size = batch_size
        self.pool, self.owner = pool, owner  # buffers are taken on the owner's behalf
        self.scratch = scratch
        self.collate = collate
        self.unbuffered = outbox.maxsize * max(1, run) if unbuffered is None else unbuffered
        self.pass_key = pass_key
        self.run = run

    def work(self, c: Counters) -> None:
        B = self.batch_size
        order = self.order()
        pool, owner = self.pool, self.owner
        stopped = self.control.stopped
        tasks = self.outbox

        def starving() -> bool:  # the decode threads have taken every dispatched sample
            return tasks.depth() == 0
        # An Order yields its batches computed as they are reached (no list of
        # the epoch); a list is cut in place.
        chunks = (order.chunks(B) if isinstance(order, Order)
                  else (order[a:a + B] for a in range(0, len(order), B)))
        pass_key = self.pass_key
        for b, indices in enumerate(chunks):
            keys = [None] * len(indices) if pass_key is None else index_keys(pass_key, indices)
            buf = pool.try_acquire(owner)
            first = 0
            if buf is not None:
                batch = Batch(b, buf, len(indices))
            else:
                # No buffer yet: start the batch anyway; its first samples wait in
                # scratch arrays until the buffer is bound.
                batch = Batch(b, None, len(indices))
                # Enough to keep every decode thread busy while the training loop
                # hands its batch back (each may take a scratch array: bounded).
                first = min(self.unbuffered, tasks.maxsize * max(1, self.run), len(indices))
                self.put_tasks(c, self._items([Task(batch, slot, indices[slot], keys[slot])
                                               for slot in range(first)]))
                c.begin_wait(Counters.WAIT_OUT)  # waiting for a free buffer: downstream is behind
                try:
                    buf = pool.acquire(stopped, starving, owner)
                finally:
                    c.end_wait()
                if batch.bind(buf, self.scratch.give):  # every dispatched sample already failed
                    self.put(c, self.collate, batch)
            self.put_tasks(c, self._items([Task(batch, slot, indices[slot], keys[slot])
                                           for slot in range(first, len(indices))]))
            c.items += 1
        self.put(c, tasks, END)

    def _items(self, batch_tasks: list) -> list:
        """A batch's tasks as the outbox's items: runs of ``run`` of them (lists),
        or the tasks one by one."""
        run = self.run
        return batch_tasks if run <= 1 else [batch_tasks[a:a + run] for a in range(0, len(batch_tasks), run)]

    def put_tasks(self, c: Counters, batch_tasks: list) -> None:
        """Put a batch's tasks on the outbox in one call (``Channel.put_many``):
        no per-sample wait bookkeeping, the call counted as waiting on output."""
        c.begin_wait(Counters.WAIT_OUT)
        try:
            self.outbox.put_many(batch_tasks)
        finally:
            c.end_wait()
