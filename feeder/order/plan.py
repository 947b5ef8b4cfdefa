"""The epoch plan: the one place a feeder's epoch orders come from.

:class:`EpochPlan` is built once per feeder (and once in an isolated engine's
worker process) from the source, the :class:`OrderOptions` and the transforms;
:meth:`EpochPlan.order` gives the order of ``(epoch, rank, world_size, seed)``.
The pass dispatches that order, and resume counts progress along it and checks
saved states against it, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from .epoch import ShardLayout, own_pass_sequence, pass_sequence, shard_layout
from .group import group_sequence, index_count
from .sequence import ArrayOrder, Concat, Handled, Order, Remaining, Slice

# Grouped or resharded orders kept per plan: the pass's and the resume
# bookkeeping's of the same epoch, and the next epoch's while the previous one
# is still counted.
_KEPT = 4

# The world sizes a pass's order went through before the current one, and what
# each of their ranks had handled (see EpochPlan.order).
Levels = tuple[tuple[int, tuple[Handled, ...]], ...]


@dataclasses.dataclass(frozen=True)
class OrderOptions:
    """The feeder options that decide which samples a pass dispatches, in which
    order and batches (see ``Feeder``'s arguments of the same names).

    Two fields are decided by other options, not options of their own (their
    metadata says which): ``skip``, ``on_error="skip"``, under which a pass
    also dispatches the tail that ``drop_last`` would drop, to fill the places
    of skipped samples; ``exif_orientation``, the decoding's, which turns the
    sizes that grouping reads."""

    batch_size: int
    shuffle: bool | str = True
    shuffle_window: int = 8192
    shuffle_shards: int | None = None
    drop_last: bool = True
    skip: bool = dataclasses.field(default=False, metadata={"derived": "on_error"})
    group_by_aspect_ratio: int | None = None
    exif_orientation: bool = dataclasses.field(default=False,
                                               metadata={"derived": "exif_orientation"})
    ordered: bool = True
    seed: int | None = None
    rank: int | None = None
    world_size: int | None = None

    @classmethod
    def of(cls, config: "HasOrder") -> "OrderOptions":
        """The order options of a feeder's configuration (its ``order`` record)."""
        return config.order


class HasOrder(Protocol):
    """A configuration holding its order options (the feeder's ``Config``)."""

    @property
    def order(self) -> OrderOptions: ...


class EpochPlan:
    """Which samples each pass of a feeder dispatches, in which order.

    Args:
        source: The feeder's source (its length, its shard ranges for
            ``shuffle="shards"``, its image sizes for grouping).
        options: The order options.
        chain: The transforms (a :class:`~feeder.ops.chain.Chain`): under
            grouping, the planned output sizes batch similar sizes together.

    Raises:
        ValueError, TypeError: a source that cannot give the shard layout asked for.
    """

    def __init__(self, source: Any, options: OrderOptions, chain: Any = None) -> None:
        self.source = source
        self.options = options
        self.chain = chain
        # A source that orders its own epochs (feeder.Mixture): its epoch_order(seed,
        # epoch, shuffle) gives every rank's order, which the plan cuts.
        self.own_order = getattr(source, "epoch_order", None)
        if self.own_order is not None and options.shuffle == "shards":
            raise ValueError(f"shuffle='shards' does not apply to a {type(source).__name__}, "
                             f"which orders its own epochs (each source in passes of its own): "
                             f"use shuffle=True or False")
        count = getattr(source, "index_count", None)
        if self.own_order is not None and options.skip and count is not None and count > len(source):
            # A resume state lists the skipped samples, each below len(source).
            raise ValueError(f"on_error='skip' needs every sample index below len(source): this "
                             f"{type(source).__name__} has {count} samples in epochs of "
                             f"{len(source)}; use on_error='raise', or epochs of at least {count}")
        self.layout: ShardLayout | None = shard_layout(source, options.shuffle, options.shuffle_window,
                                                       options.shuffle_shards)
        self._grouped: dict[tuple[int, int, int, int], Order] = {}
        self._lock = threading.Lock()

    def order(self, epoch: int, rank: int, world_size: int, seed: int,
              stopped: Callable[[], bool] | None = None, levels: Levels = ()) -> Order:
        """Rank ``rank``'s order of ``epoch`` out of ``world_size``, shuffled from
        ``seed``: the sample indices its pass dispatches, in order, cut to
        whole batches when ``drop_last``, regrouped when grouping.

        ``levels``: the epoch was begun under other world sizes: for each, in
        turn, its size and what each of its ranks had handled along its own
        order at this level. The samples they left, rank after rank, are then
        cut into ``world_size`` contiguous parts (see :func:`elastic_sizes`), and
        this is rank ``rank``'s: every sample left exactly once over the ranks.

        ``stopped`` ends the header scan of a grouped order early (raising
        :class:`~feeder.order.group.ScanStopped`). A grouped or resharded order
        costs a scan or planned sizes, so the latest ones are kept."""
        if levels:
            return self._kept((epoch, rank, world_size, seed, levels),
                              lambda: self._resharded(epoch, rank, world_size, seed, stopped, levels))
        o = self.options
        # The length is asked each time, in the caller's thread (the sampler's:
        # a source failing there fails the pass as that stage's error).
        if self.own_order is not None:
            whole = self._own(seed, epoch, bool(o.shuffle))
            if len(whole) != len(self.source):
                raise ValueError(f"{type(self.source).__name__}.epoch_order() gave {len(whole)} "
                                 f"positions for a source of {len(self.source)}")
            order = own_pass_sequence(whole, o.batch_size, o.drop_last, o.skip, rank, world_size)
        else:
            order = pass_sequence(len(self.source), o.batch_size, o.shuffle, o.drop_last, o.skip,
                                  seed, epoch, rank, world_size, self.layout)
        if o.group_by_aspect_ratio is None:
            return order
        return self._kept((epoch, rank, world_size, seed, ()),
                          lambda: group_sequence(order, self.source, o, self.chain, seed, epoch, stopped))

    def _own(self, seed: int, epoch: int, shuffle: bool) -> Order:
        """The source's own order of ``epoch``: an :class:`Order` as it is (a
        ``Mixture``'s, computed on demand), or a list or int array of sample
        indices, checked to lie in ``[0, index_count)``."""
        whole = self.own_order(seed, epoch, shuffle)
        if isinstance(whole, Order):
            return whole
        name = type(self.source).__name__
        indices = np.asarray(whole)
        if indices.ndim != 1 or (len(indices) and indices.dtype.kind not in "iu"):
            raise TypeError(f"{name}.epoch_order() must give a list or 1-D int array of sample "
                            f"indices, got {type(whole).__name__}")
        count = index_count(self.source)
        if len(indices) and (indices.min() < 0 or indices.max() >= count):
            bad = int(indices[(indices < 0) | (indices >= count)][0])
            raise ValueError(f"{name}.epoch_order() gave sample index {bad}, outside [0, {count}) "
                             f"(index_count, else len(source))")
        return ArrayOrder(indices)

    def left(self, epoch: int, seed: int, levels: Levels,
             stopped: Callable[[], bool] | None = None) -> Order:
        """The samples of ``epoch`` that the ranks of ``levels[-1]`` had not
        handled, in their order, rank after rank."""
        world_size, handled = levels[-1]
        return Concat([Remaining(self.order(epoch, r, world_size, seed, stopped, levels[:-1]), h)
                       for r, h in enumerate(handled)])

    def _resharded(self, epoch: int, rank: int, world_size: int, seed: int,
                   stopped: Callable[[], bool] | None, levels: Levels) -> Order:
        rest = self.left(epoch, seed, levels, stopped)
        sizes = elastic_sizes(len(rest), world_size, self.options.batch_size)
        start = sum(sizes[:rank])
        return Slice(rest, start, start + sizes[rank])

    def _kept(self, key: tuple, make: Callable[[], Order]) -> Order:
        with self._lock:
            hit = self._grouped.get(key)
        if hit is not None:
            return hit
        made = make()
        with self._lock:
            self._grouped[key] = made
            while len(self._grouped) > _KEPT:
                self._grouped.pop(next(iter(self._grouped)))
        return made


def elastic_sizes(n: int, world_size: int, batch_size: int) -> list[int]:
    """How many of ``n`` samples left of an epoch each of ``world_size`` ranks
    takes after the world size changed: every one exactly once, and, wherever
    ``n`` allows it, the same number of batches on every rank (DDP steps the
    ranks together), each rank's last batch the only one that may be short.
    That needs at least one sample per rank in the last round of batches; when
    fewer are left (``n`` a few samples past a multiple of
    ``world_size * batch_size``), the parts differ by at most one sample and
    the first ranks take one batch more."""
    if n == 0:
        return [0] * world_size
    rounds = -(-n // (world_size * batch_size))
    full = (rounds - 1) * batch_size
    last = n - world_size * full  # samples of the last round, in (0, world_size * batch_size]
    if last >= world_size:
        q, r = divmod(last, world_size)
        return [full + q + (i < r) for i in range(world_size)]
    q, r = divmod(n, world_size)
    return [q + (i < r) for i in range(world_size)]
