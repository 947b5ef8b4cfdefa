"""Each epoch's order and this rank's shard of it.

The order is a pure function of (seed, epoch, rank, world_size, dataset
length); every rank cuts a disjoint shard from it (equal shards with
``drop_last``, every sample once without). ``shuffle="shards"`` is the order for
streaming storage; sources longer than :data:`LAZY_MIN` samples, and
``shuffle_shards``, get the lazy orders of :mod:`feeder.order.sequence`. The
rules and their reasons: docs/design/orders.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .sequence import ArrayOrder, BlockOrder, GlobalOrder, Order, Slice, subkey
from ..sample.rng import order_key



def shard_size(length: int, rank: int, world_size: int, even: bool) -> int:
    """Samples ``rank`` reads per epoch: ``length // world_size`` when ``even``,
    else its share of all of them (the first ``length % world_size`` ranks one more)."""
    if even:
        return length // world_size
    return length // world_size + (rank < length % world_size)


def shard_sizes(length: int, world_size: int, even: bool) -> list[int]:
    """Samples each rank reads per epoch, by rank (see :func:`shard_size`)."""
    return [shard_size(length, rank, world_size, even) for rank in range(world_size)]


def check_epoch(length: int, batch_size: int, drop_last: bool, world_size: int) -> None:
    """Refuse a configuration in which some rank would get no batch at all.

    Every rank finds the same answer (it depends on no rank's own numbers), so
    a distributed job fails on all of its ranks, not on a few while the others
    wait for them in a collective.

    Raises:
        ValueError: naming the numbers and what to change.
    """
    if length == 0:
        raise ValueError("the source is empty (len(source) == 0): every epoch would have 0 batches; "
                         "check the dataset's path or file list")
    sizes = shard_sizes(length, world_size, even=drop_last)
    empty = [rank for rank, n in enumerate(sizes) if num_batches(n, batch_size, drop_last) == 0]
    if not empty:
        return
    ranks = (f"rank {empty[0]}" if len(empty) == 1 else "every rank" if len(empty) == world_size
             else f"ranks {empty[0]}-{empty[-1]}")
    numbers = (f"len(source)={length}, world_size={world_size}, {sizes[empty[0]]} samples per epoch "
               f"for {ranks}, batch_size={batch_size}, drop_last={drop_last}")
    if sizes[empty[0]] == 0:
        advice = "use fewer ranks than samples"
    else:
        advice = (f"use batch_size <= {sizes[empty[0]]}, or drop_last=False to keep the short batch")
    raise ValueError(f"0 batches per epoch on {ranks} ({numbers}): {advice}")


# Sources longer than this get the lazy orders of feeder.order.sequence (no array per
# epoch); shorter ones keep torch.randperm's order, as before. 2^24 samples: a
# randperm of int64 is 128 MiB there, its memory and time growing linearly beyond.
LAZY_MIN = 1 << 24


def epoch_order(length: int, shuffle: bool, seed: int, epoch: int, rank: int = 0,
                world_size: int = 1, even: bool = True) -> Order:
    """:func:`epoch_indices` as an :class:`~feeder.order.sequence.Order`: an array up to
    :data:`LAZY_MIN` samples, a lazy permutation beyond."""
    if length <= LAZY_MIN:
        return ArrayOrder(epoch_indices(length, shuffle, seed, epoch, rank, world_size, even))
    return GlobalOrder(length, order_key(seed, epoch) if shuffle else None, rank, world_size,
                       shard_size(length, rank, world_size, even))


def epoch_indices(length: int, shuffle: bool, seed: int, epoch: int,
                  rank: int = 0, world_size: int = 1, even: bool = True) -> np.ndarray:
    """The sample indices this rank reads in ``epoch``, in order: its shard (see
    :func:`shard_size`) of the epoch's permutation."""
    if shuffle:
        gen = torch.Generator()
        gen.manual_seed(order_key(seed, epoch))
        order = torch.randperm(length, generator=gen).numpy()
    else:
        order = np.arange(length)
    if world_size > 1:
        stop = length // world_size * world_size if even else length
        order = order[rank:stop:world_size]
    return order


@dataclass(frozen=True)
class ShardLayout:
    """The shards of a source, for ``shuffle="shards"``: ``[start, stop)`` sample
    ranges in source order, and the shuffle window (samples)."""

    ranges: tuple[tuple[int, int], ...]
    window: int
    shards: int | None = None  # shuffle_shards: a window of this many whole shards


def shard_layout(source: Any, shuffle: Any, window: int, shards: int | None = None
                 ) -> ShardLayout | None:
    """The :class:`ShardLayout` ``shuffle="shards"`` needs (None for other orders).

    Raises:
        ValueError: the source has no ``shard_ranges()``, or its ranges do not
            cover ``[0, len(source))`` in order.
    """
    if shuffle != "shards":
        return None
    fn = getattr(source, "shard_ranges", None)
    if fn is None:
        raise ValueError(f"shuffle='shards' needs a source made of shards (with shard_ranges(), "
                         f"such as feeder.TarShards); {type(source).__name__} has none: use "
                         f"shuffle=True")
    ranges = tuple((int(a), int(b)) for a, b in fn())
    at = 0
    for a, b in ranges:
        if a != at or b < a:
            raise ValueError(f"shuffle='shards': {type(source).__name__}.shard_ranges() must cover "
                             f"[0, len) in order, got {a}-{b} after {at}")
        at = b
    if at != len(source):
        raise ValueError(f"shuffle='shards': shard_ranges() ends at {at}, len(source) is {len(source)}")
    return ShardLayout(ranges, window, shards)


def shard_order(layout: ShardLayout, seed: int, epoch: int, rank: int = 0, world_size: int = 1,
                even: bool = True) -> np.ndarray:
    """This rank's samples of ``epoch`` in the shard-local order (see the module docstring)."""
    gen = torch.Generator()
    gen.manual_seed(order_key(seed, epoch))
    ranges = layout.ranges
    perm = torch.randperm(len(ranges), generator=gen).tolist()
    parts = [np.arange(*ranges[k], dtype=np.int64) for k in perm]
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    length = len(stream)
    if world_size > 1:
        sizes = shard_sizes(length, world_size, even)
        start = sum(sizes[:rank])
        stream = stream[start:start + sizes[rank]]
    # Window shuffle: a random key per position, sorted within its window; each
    # rank draws from a generator of its own (seeded from seed, epoch and rank).
    gen.manual_seed(order_key(seed, epoch) ^ (0x9E3779B97F4A7C15 * (rank + 1) & ((1 << 63) - 1)))
    keys = torch.rand(len(stream), generator=gen, dtype=torch.float64).numpy()
    keys += np.arange(len(stream)) // layout.window
    return stream[np.argsort(keys, kind="stable")]


def shard_stream_order(layout: ShardLayout, seed: int, epoch: int, rank: int = 0,
                       world_size: int = 1, even: bool = True) -> Order:
    """:func:`shard_order` as an :class:`~feeder.order.sequence.Order`: the array order up to
    :data:`LAZY_MIN` samples (without ``shuffle_shards``), else a lazy
    :class:`~feeder.order.sequence.BlockOrder` over the same permutation of the shards."""
    ranges = layout.ranges
    length = ranges[-1][1] if ranges else 0
    if layout.shards is None and length <= LAZY_MIN:
        return ArrayOrder(shard_order(layout, seed, epoch, rank, world_size, even))
    gen = torch.Generator()
    gen.manual_seed(order_key(seed, epoch))
    perm = torch.randperm(len(ranges), generator=gen).numpy()
    sizes = shard_sizes(length, world_size, even)
    begin = sum(sizes[:rank])
    key = subkey(order_key(seed, epoch), rank)
    return BlockOrder(ranges, perm, begin, begin + sizes[rank], key, window_shards=layout.shards,
                      window_samples=None if layout.shards is not None else layout.window)


def pass_sequence(length: int, batch_size: int, shuffle: bool | str, drop_last: bool, skip: bool,
                  seed: int, epoch: int, rank: int = 0, world_size: int = 1,
                  layout: ShardLayout | None = None) -> Order:
    """:func:`pass_order` as an :class:`~feeder.order.sequence.Order` (no list of every
    sample): what the sampler dispatches and a pass's progress is counted along."""
    if shuffle == "shards":
        if layout is None:
            raise ValueError("shuffle='shards' needs the source's shard layout")
        order = shard_stream_order(layout, seed, epoch, rank, world_size, even=drop_last)
    else:
        order = epoch_order(length, shuffle, seed, epoch, rank, world_size, even=drop_last)
    total = num_batches(len(order), batch_size, drop_last and not skip)
    return order.head(total * batch_size)


def own_pass_sequence(order: Order, batch_size: int, drop_last: bool, skip: bool, rank: int = 0,
                      world_size: int = 1) -> Order:
    """A pass of a source that gives its own epoch ``order`` (every rank's, see
    :class:`~feeder.order.plan.EpochPlan`): rank ``r`` takes the ``r``-th
    contiguous share of it (the sizes of :func:`shard_sizes`), cut to whole
    batches as :func:`pass_sequence` cuts. Contiguous, not strided: a share of
    an interleave of sources keeps its proportions, every ``world_size``-th
    position of it need not."""
    sizes = shard_sizes(len(order), world_size, drop_last)
    begin = sum(sizes[:rank])
    mine = Slice(order, begin, begin + sizes[rank])
    total = num_batches(len(mine), batch_size, drop_last and not skip)
    return mine.head(total * batch_size)


def num_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else -(-samples // batch_size)


def pass_order(length: int, batch_size: int, shuffle: bool | str, drop_last: bool, skip: bool, seed: int,
               epoch: int, rank: int = 0, world_size: int = 1,
               layout: ShardLayout | None = None) -> list[int]:
    """The sample indices one pass dispatches: this rank's shard of the epoch's
    order (equal-size shards when ``drop_last``, covering shards otherwise), cut
    to whole batches when ``drop_last``. Under ``skip`` (on_error="skip")
    the would-be-dropped tail is dispatched too: its samples refill the places of
    skipped ones (the collator still drops whatever is left short at the end).
    ``shuffle="shards"`` takes the order from ``layout`` (see :func:`shard_order`).
    A list of every index: for large sources use :func:`pass_sequence`."""
    return pass_sequence(length, batch_size, shuffle, drop_last, skip, seed, epoch, rank,
                         world_size, layout)[:]
