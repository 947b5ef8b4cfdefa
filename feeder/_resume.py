"""Mid-epoch resume: what a pass has delivered, and the state dict that carries it.

A pass records the source indices of every batch the training loop has taken
(and of every sample it skipped under ``on_error="skip"``). A resumed pass of the
same epoch dispatches the rest of that epoch's order, in order, leaving those
out. With ``ordered=True`` and ``on_error="raise"`` the delivered samples are
exactly the first ``samples`` of the order and state is taken between batches,
so the rest is ``order[samples:]`` cut at the same batch boundaries: the
remaining batches are the uninterrupted run's, pixel for pixel (each sample's
randomness depends on (seed, epoch, index) alone). Otherwise batches are made
of whatever is left, and each sample not yet delivered comes exactly once.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from collections.abc import Callable, Sequence

import numpy as np

from ._order import Handled, Order
from ._sampler import num_batches, shard_size

FORMAT_VERSION = 1  # bitmaps of delivered and skipped samples
COMPACT_VERSION = 2  # a position in the order, the few handled past it, the skipped
# Sources longer than this write format 2 (format 1's two bitmaps would exceed
# 64 KiB each); shorter ones keep format 1, as before.
COMPACT_ABOVE = 1 << 19

# Default reprs of functions and objects carry a memory address that differs
# between processes; it says nothing about what the transform does.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


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
        order: Returns the pass's order (an :class:`~feeder._order.Order`, the
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
        self._pending: set[int] = set()  # handled sample indices past ``position``
        self.skipped_before = list(skipped)
        self.first_batch = batches  # the number of this run's first batch
        self.batches = batches
        self.ended = False  # the training loop has taken the end of the pass
        self.run: Any = None  # the Pass, for the samples it skipped
        self._lock = threading.Lock()  # threads sharing one iterator record concurrently

    @property
    def order(self) -> Order:
        if self._order is None:
            self._order = self._order_fn()
        return self._order

    def handled(self) -> Handled:
        """What a resumed pass must not dispatch again: delivered or skipped."""
        with self._lock:
            return self._handled(set(self._pending))

    def _at(self, position: int) -> int:
        """The sample at ``position`` (under the lock): the order is looked up a
        block at a time, and the block kept, as the position moves forward."""
        k = position - self._block_start
        if not 0 <= k < len(self._block):
            self._block_start = position
            self._block = self.order.take(position, position + _STEP).tolist()
            k = 0
        return self._block[k]

    def _advance(self, pending: set[int], position: int, after: set[int]) -> int:
        """Move ``position`` over handled samples (removing them from ``pending``
        and ``after``)."""
        n = len(self.order)
        while position < n and (pending or after):
            if position in after:
                after.discard(position)
            else:
                i = self._at(position)
                if i not in pending:
                    break
                pending.discard(i)
            position += 1
        return position

    def _handled(self, pending: set[int]) -> Handled:
        # Under the lock (or on copies). The pending samples are past the
        # position: find their positions by walking the order from it (they were
        # dispatched, so they lie within the samples in flight).
        after = set(self._after_positions)
        position = self._advance(pending, self.position, after)
        at = position
        n = len(self.order)
        while pending and at < n:
            i = self._at(at)
            if i in pending:
                pending.discard(i)
                after.add(at)
            at += 1
        if pending:
            raise RuntimeError(f"samples {sorted(pending)[:5]} were recorded as handled but are "
                               f"not in the pass's order")
        return Handled(position, tuple(sorted(after)))

    def _take_skips(self) -> None:
        # Under the lock. Skipped samples are handled too: without them the
        # position would stop at the first skip and the pending set would grow.
        run = self.run
        if run is not None:
            skips = run.skipped_indices
            fresh = skips[self._skips_seen:]
            self._skips_seen += len(fresh)
            self._skipped_now.extend(fresh)
            self._pending.update(int(i) for i in fresh)

    def record(self, indices: Any) -> None:
        with self._lock:
            self._pending.update(int(i) for i in indices)
            self.batches += 1
            self._take_skips()
            # Batches come nearly in order: the position follows them, and the
            # pending set holds only samples that came ahead of a straggler.
            self.position = self._advance(self._pending, self.position, self._after_positions)

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
            handled = self._handled(set(self._pending))
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


def describe_transforms(transforms: list[Any]) -> list[str]:
    """The transforms' reprs, without memory addresses."""
    return [_ADDRESS.sub("", repr(t)) for t in transforms]


def pack(bits: np.ndarray) -> bytes:
    return np.packbits(bits).tobytes()


def unpack(data: Any, length: int, field: str) -> np.ndarray:
    if not isinstance(data, (bytes, bytearray)) or len(data) != (length + 7) // 8:
        raise ValueError(f"state[{field!r}]: expected {(length + 7) // 8} bytes for "
                         f"{length} samples, got {type(data).__name__} "
                         f"of length {len(data) if hasattr(data, '__len__') else '?'}")
    bits = np.unpackbits(np.frombuffer(bytes(data), np.uint8)).astype(bool)
    if bits[length:].any():
        # np.packbits pads with zeros: a set bit past the last sample is damage.
        raise ValueError(f"state[{field!r}]: a bit is set past the last of the {length} samples "
                         f"(the padding of the last byte): the state is damaged")
    return bits[:length]


def _first(bits: np.ndarray) -> str:
    where = np.flatnonzero(bits)
    more = f" (and {where.size - 1} more)" if where.size > 1 else ""
    return f"sample {int(where[0])}{more}"


def check_progress(delivered: np.ndarray, skipped: np.ndarray, batches: int, order: list[int],
                   batch_size: int, skip: bool, epoch: int) -> None:
    """Refuse a saved pass that no pass could have left: samples marked that this
    rank's pass never hands out, skips under ``on_error="raise"``, a sample both
    delivered and skipped, or a batch count that does not fit the delivered samples.
    Such a state would lose samples (a marked sample is never dispatched again)
    or deliver some twice.

    Args:
        delivered, skipped: The state's bitmaps, one bit per source sample.
        batches: The state's delivered batch count.
        order: The samples the saving rank's pass of ``epoch`` dispatches.
        skip: ``on_error="skip"``.

    Raises:
        ValueError: naming the field and the first offending sample or count.
    """
    damaged = "the state is damaged or from other settings"
    if not skip and skipped.any():
        raise ValueError(f"state['skipped'] marks {_first(skipped)} as skipped, but under "
                         f"on_error='raise' no sample is ever skipped (a resume would never "
                         f"deliver it): {damaged}")
    both = delivered & skipped
    if both.any():
        raise ValueError(f"state['delivered'] and state['skipped'] both mark {_first(both)}: "
                         f"{damaged}")
    dispatched = np.zeros(len(delivered), bool)
    dispatched[np.asarray(order, dtype=np.intp)] = True
    for field, bits in (("delivered", delivered), ("skipped", skipped)):
        outside = bits & ~dispatched
        if outside.any():
            raise ValueError(f"state[{field!r}] marks {_first(outside)}, which this rank's pass of "
                             f"epoch {epoch} never hands out: {damaged}")
    n = int(delivered.sum())
    most = -(-len(order) // batch_size)
    if batches > most:
        raise ValueError(f"state['batches'] is {batches}, more than the {most} batches of "
                         f"epoch {epoch}'s pass: {damaged}")
    if skip:
        # Skipped samples leave holes the tail may not refill: a batch holds 1 to batch_size.
        if not batches <= n <= batches * batch_size:
            raise ValueError(f"state['delivered'] marks {n} samples, which {batches} batches of "
                             f"1 to {batch_size} samples cannot hold: {damaged}")
    elif n not in (batches * batch_size, len(order)):
        # Without skips every batch is full but the pass's last.
        raise ValueError(f"state['delivered'] marks {n} samples, but {batches} full batches of "
                         f"{batch_size} hold {batches * batch_size}: {damaged}")


def check_settings(saved: Any, current: dict[str, Any]) -> None:
    """Refuse a state whose output-determining settings differ from this feeder's.

    Raises:
        ValueError: naming the first differing field and both values.
    """
    if not isinstance(saved, dict):
        raise ValueError(f"state['settings'] must be a dict, got {type(saved).__name__}")
    for name, value in current.items():
        if name not in saved:
            raise ValueError(f"state['settings'] lacks {name!r}")
        if _normal(saved[name]) != _normal(value):
            raise ValueError(f"cannot resume: {name} differs (saved {saved[name]!r}, "
                             f"this feeder {value!r})")


def _normal(value: Any) -> Any:
    # A state through torch.save/load or JSON-like tools may turn tuples into lists.
    if isinstance(value, (list, tuple)):
        return tuple(_normal(v) for v in value)
    # True == 1 and 8.0 == 8 in Python: a bool or a float where the feeder has an
    # int (or the reverse) is another setting, or a damaged state.
    if isinstance(value, (bool, float)):
        return (type(value).__name__, value)
    return value


def handled_from_bitmaps(delivered: np.ndarray, skipped: np.ndarray, order: Order
                         ) -> tuple[Handled, list[int]]:
    """A format-1 state's bitmaps as (handled positions, skipped samples)."""
    marks = (delivered | skipped)[order.take(0, len(order))]
    position = int(np.argmin(marks)) if not marks.all() else len(marks)
    after = tuple((np.flatnonzero(marks[position:]) + position).tolist())
    return Handled(position, after), np.flatnonzero(skipped).tolist()


def _int_list(value: Any, field: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"state[{field!r}] must be a list of ints, got "
                         f"{type(value).__name__}")
    return list(value)


def load_compact(state: dict[str, Any], order: Order, length: int, batch_size: int, skip: bool,
                 epoch: int) -> tuple[Handled, list[int]]:
    """The handled positions and skipped samples of a format-2 state, checked as
    :func:`check_progress` checks format 1: a state that no pass could have left
    would lose samples or deliver some twice.

    Raises:
        ValueError: naming the field and what is wrong.
    """
    damaged = "the state is damaged or from other settings"
    position = state.get("position")
    n = len(order)
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= n:
        raise ValueError(f"state['position'] must be an int in [0, {n}] (this rank's pass of "
                         f"epoch {epoch} has {n} samples), got {position!r}: {damaged}")
    after = _int_list(state.get("after"), "after")
    if any(b <= a for a, b in zip(after, after[1:])) or (after and not position < after[0]) or (
            after and after[-1] >= n):
        raise ValueError(f"state['after'] must hold increasing positions in ({position}, {n}), "
                         f"got {after[:5]}{' ...' if len(after) > 5 else ''}: {damaged}")
    skipped = _int_list(state.get("skipped"), "skipped")
    if not skip and skipped:
        raise ValueError(f"state['skipped'] lists sample {skipped[0]} as skipped, but under "
                         f"on_error='raise' no sample is ever skipped: {damaged}")
    if len(set(skipped)) != len(skipped) or any(not 0 <= i < length for i in skipped):
        raise ValueError(f"state['skipped'] must hold distinct samples in [0, {length}): {damaged}")
    handled = Handled(position, tuple(after))
    delivered = handled.count() - len(skipped)
    batches = state["batches"]
    most = -(-n // batch_size)
    if batches > most:
        raise ValueError(f"state['batches'] is {batches}, more than the {most} batches of "
                         f"epoch {epoch}'s pass: {damaged}")
    if skip:
        if not batches <= delivered <= batches * batch_size:
            raise ValueError(f"state['position'] and state['after'] mark {delivered} samples "
                             f"delivered, which {batches} batches of 1 to {batch_size} samples "
                             f"cannot hold: {damaged}")
    elif delivered not in (batches * batch_size, n):
        raise ValueError(f"state['position'] and state['after'] mark {delivered} samples "
                         f"delivered, but {batches} full batches of {batch_size} hold "
                         f"{batches * batch_size}: {damaged}")
    return handled, skipped
