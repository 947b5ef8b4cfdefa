"""What one pass has handled so far (:class:`Progress`), counted along its order
in a size that does not grow with the epoch, and when a pass has nothing left."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .epoch import num_batches, shard_size
from .sequence import Handled, Order

# Samples of the order looked up at once while counting progress along it.
_STEP = 4096


class Progress:
    """What one pass (of one epoch) has handled so far, in a size that does not
    grow with the epoch: a position in the pass's order (every sample before it
    delivered or skipped) and the few samples handled past it (those that
    finished out of order: at most the samples in flight), plus the skipped ones.

    Args:
        epoch: The pass's epoch.
        length: ``len(source)``.
        order: Returns the pass's order (an :class:`~feeder.order.sequence.Order`, the
            one the sampler dispatches from); called at the first need.
        start: What an earlier run of this epoch handled (a resume), or None.
        skipped: Samples an earlier run of this epoch skipped (source indices).
        batches: Batches that earlier run delivered.
    """

    def __init__(self, epoch: int, length: int, order: Callable[[], Order],
                 start: Handled | None = None, skipped: Sequence[int] = (), batches: int = 0) -> None:
        self.epoch = epoch
        self.length = length
        self._skips_seen = 0  # of the run's skipped_indices, taken into account
        self._skipped_now: list[int] = []
        self._order_fn = order
        self._order: Order | None = None
        self._block_start, self._block = 0, []  # see _at
        self.start = start or Handled(0)
        self.position = self.start.position
        self._after_positions = set(self.start.after)
        # Handled sample indices past ``position``, counted: an order may hold a
        # sample more than once (a mixture's small source repeats within an epoch).
        self._pending: Counter[int] = Counter()
        self.skipped_before = list(skipped)
        self.first_batch = batches  # the number of this run's first batch
        self.batches = batches
        self.ended = False  # the training loop has taken the end of the pass
        self.pass_: Any = None  # the Pass, for the samples it skipped
        self._lock = threading.Lock()  # threads sharing one iterator record concurrently

    @property
    def order(self) -> Order:
        if self._order is None:
            self._order = self._order_fn()
        return self._order

    def handled(self) -> Handled:
        """What a resumed pass must not dispatch again: delivered or skipped."""
        with self._lock:
            return self._handled(Counter(self._pending))

    def _at(self, position: int) -> int:
        """The sample at ``position`` (under the lock): the order is looked up a
        block at a time, and the block kept, as the position moves forward."""
        k = position - self._block_start
        if not 0 <= k < len(self._block):
            self._block_start = position
            self._block = self.order.take(position, position + _STEP).tolist()
            k = 0
        return self._block[k]

    def _advance(self, pending: Counter[int], position: int, after: set[int]) -> int:
        """Move ``position`` over handled samples (removing them from ``pending``
        and ``after``)."""
        n = len(self.order)
        while position < n and (pending or after):
            if position in after:
                after.discard(position)
            else:
                i = self._at(position)
                if not _take(pending, i):
                    break
            position += 1
        return position

    def _handled(self, pending: Counter[int]) -> Handled:
        # Under the lock (or on copies). The pending samples are past the
        # position: find their positions by walking the order from it (they were
        # dispatched, so they lie within the samples in flight).
        after = set(self._after_positions)
        position = self._advance(pending, self.position, after)
        at = position
        n = len(self.order)
        while pending and at < n:
            i = self._at(at)
            if _take(pending, i):
                after.add(at)
            at += 1
        if pending:
            raise RuntimeError(f"samples {sorted(pending)[:5]} were recorded as handled but are "
                               f"not in the pass's order")
        return Handled(position, tuple(sorted(after)), self.start.levels)

    def _take_skips(self) -> None:
        # Under the lock. Skipped samples are handled too: without them the
        # position would stop at the first skip and the pending set would grow.
        pass_ = self.pass_
        if pass_ is not None:
            skips = pass_.skipped_indices
            fresh = skips[self._skips_seen:]
            self._skips_seen += len(fresh)
            self._skipped_now.extend(fresh)
            self._pending.update(int(i) for i in fresh)

    def record(self, indices: Any) -> None:
        with self._lock:
            self.batches += 1
            self._take_skips()
            # Batches come nearly in order: the position follows them, and the
            # pending set holds only samples that came ahead of a straggler.
            if not self._pending and not self._after_positions and self._next_in_order(indices):
                return
            self._pending.update(int(i) for i in indices)
            self.position = self._advance(self._pending, self.position, self._after_positions)

    def _next_in_order(self, indices: Any) -> bool:
        """With nothing pending past the position (under the lock): if ``indices``
        are the order's next samples, move the position over them and say so,
        as :meth:`_advance` would, with one comparison instead of a call or
        two per sample (this runs in the training thread)."""
        got = indices.tolist() if isinstance(indices, np.ndarray) else [int(i) for i in indices]
        n = len(got)
        position = self.position
        k = position - self._block_start
        block = self._block
        if k < 0 or k + n > len(block):
            # The block _at would look up from here (at least n samples long).
            self._block_start, k = position, 0
            self._block = block = self.order.take(position, position + max(_STEP, n)).tolist()
        if block[k:k + n] != got:
            return False
        self.position = position + n
        return True

    def skipped(self) -> list[int]:
        """Every sample skipped in this epoch so far (source indices)."""
        with self._lock:
            self._take_skips()
            return sorted(set(self.skipped_before) | set(self._skipped_now))

    def compact(self) -> tuple[Handled, list[int], int]:
        """(handled, skipped, batches), consistent with each other; skipped
        samples count as handled."""
        with self._lock:
            self._take_skips()
            handled = self._handled(Counter(self._pending))
            skipped = sorted(set(self.skipped_before) | set(self._skipped_now))
            return handled, skipped, self.batches

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(delivered, skipped, batches) as bitmaps over the source (one bit per
        sample: the format-1 state, for sources up to LAZY_MIN samples)."""
        handled, skipped_list, batches = self.compact()
        order = self.order
        length = self.length
        delivered = np.zeros(length, bool)
        delivered[order.take(0, handled.position)] = True
        if handled.after:
            delivered[[order[p] for p in handled.after]] = True
        skipped = np.zeros(length, bool)
        skipped[skipped_list] = True
        return delivered & ~skipped, skipped, batches


def _take(pending: Counter[int], index: int) -> bool:
    """Count one handled ``index`` off ``pending``; False when none is pending."""
    left = pending.get(index, 0)
    if not left:
        return False
    if left == 1:
        del pending[index]
    else:
        pending[index] = left - 1
    return True


def pass_finished(handled: int, length: int, batch_size: int, drop_last: bool, skip: bool,
                  rank: int, world_size: int) -> bool:
    """Whether a pass that has delivered or skipped ``handled`` samples has no batch
    left to deliver, although its loop may not have asked for the end yet.

    Args:
        handled: Samples of the pass delivered or skipped (see :class:`Progress`).
        skip: ``on_error="skip"``: the pass also dispatches the would-be-dropped tail.
    """
    shard = shard_size(length, rank, world_size, drop_last)
    dispatched = min(shard, num_batches(shard, batch_size, drop_last and not skip) * batch_size)
    rest = dispatched - handled
    # With drop_last the collator drops a short remainder: fewer samples than a
    # batch can make no further batch.
    return rest <= 0 or (drop_last and rest < batch_size)
