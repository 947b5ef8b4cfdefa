"""Sampler stage: each epoch's order, this rank's shard, and batch boundaries.

The order is a pure function of (seed, epoch, rank, world_size, dataset
length): a permutation from torch's CPU generator seeded with a hash of (seed,
epoch) when shuffling, else the identity. (torch's generator rather than
numpy.random: torch is loaded anyway, numpy.random would be loaded only for
this, 1.3 MiB of code pages and 5 ms.) Shards are
disjoint and of equal size, ``len // world_size`` each (the remainder is left
out for that epoch, as ``DistributedSampler(drop_last=True)`` does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ._batch import Batch
from ._queue import END
from ._rng import order_key
from ._stage import Counters, Stage

if TYPE_CHECKING:
    from ._pipeline import Pass


def shard_size(length: int, world_size: int) -> int:
    return length // world_size if world_size > 1 else length


def epoch_indices(length: int, shuffle: bool, seed: int, epoch: int,
                  rank: int = 0, world_size: int = 1) -> np.ndarray:
    """The sample indices this rank reads in ``epoch``, in order."""
    if shuffle:
        gen = torch.Generator()
        gen.manual_seed(order_key(seed, epoch))
        order = torch.randperm(length, generator=gen).numpy()
    else:
        order = np.arange(length)
    if world_size > 1:
        n = shard_size(length, world_size)
        order = order[rank:n * world_size:world_size]
    return order


def num_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else -(-samples // batch_size)


class Task:
    """One sample on its way through the stages (one object, reused by every stage)."""

    __slots__ = ("batch", "slot", "index", "label", "key", "image", "ctx")

    def __init__(self, batch: Batch, slot: int, index: int) -> None:
        self.batch = batch
        self.slot = slot
        self.index = index
        self.label = -1
        self.key = 0
        self.image = None
        self.ctx = None  # ops.SampleContext, set by the decoder


class Sampler(Stage):
    """Takes a free buffer per batch and dispatches the batch's samples to the decoders."""

    name = "sampler"

    def work(self, c: Counters) -> None:
        run: "Pass" = self.run
        cfg = run.config
        B = cfg.batch_size
        order = epoch_indices(len(run.source), cfg.shuffle, run.seed, run.epoch, run.rank, run.world_size)
        # Under on_error="skip" the would-be-dropped tail is dispatched too: its
        # samples refill the places of skipped ones (the collator still drops
        # whatever is left short at the end).
        total = num_batches(len(order), B, cfg.drop_last and cfg.on_error != "skip")
        order = order[:total * B].tolist()
        stopped = run.stopped
        tasks = self.outbox

        def starving() -> bool:  # the decode threads have taken every dispatched sample
            return tasks.depth() == 0
        # Samples dispatched before their batch has a buffer: enough to keep every
        # decode thread busy while the training loop hands its batch back.
        ahead = cfg.decode_queue
        for b in range(total):
            indices = order[b * B:(b + 1) * B]
            buf = run.pool.try_acquire()
            if buf is not None:
                run.own(buf)
                batch = Batch(b, buf, len(indices))
                first = 0
            else:
                # No buffer yet: start the batch anyway; its first samples wait in
                # scratch arrays until the buffer is bound.
                batch = Batch(b, None, len(indices))
                first = min(ahead, len(indices))
                for slot in range(first):
                    self.put(c, self.outbox, Task(batch, slot, indices[slot]))
                c.begin_wait(2)  # waiting for a free buffer: downstream is behind
                try:
                    buf = run.pool.acquire(stopped, starving)
                finally:
                    c.end_wait()
                run.own(buf)
                if batch.bind(buf, run.scratch.give):  # every dispatched sample already failed
                    self.put(c, run.ready, batch)
            for slot in range(first, len(indices)):
                self.put(c, self.outbox, Task(batch, slot, indices[slot]))
            c.items += 1
        self.put(c, self.outbox, END)
