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

import hashlib
import re
import threading
from typing import Any

from collections.abc import Callable, Sequence

import numpy as np

from .engine.group import group_sequence
from .engine.order import Handled, Order, Remaining
from .engine.ranks import Ranks
from .engine.sampler import LAZY_MIN, num_batches, pass_sequence, shard_size
from .sample import DEFAULT_MAX_PIXELS

FORMAT_VERSION = 1  # bitmaps of delivered and skipped samples
COMPACT_VERSION = 2  # a position in the order, the few handled past it, the skipped
# Sources longer than this write format 2 (format 1's two bitmaps would exceed
# 64 KiB each); shorter ones keep format 1, as before.
COMPACT_ABOVE = 1 << 19

# Default reprs of functions and objects carry a memory address that differs
# between processes; it says nothing about what the transform does.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


# Epochs are in [0, EPOCHS): the order's and the samples' keys take 64 bits of
# the epoch, so epoch 2**64 would repeat epoch 0.
EPOCHS = 1 << 64

# The end of every message refusing a state that no pass could have left.
_DAMAGED = "the state is damaged or from other settings"

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
        order: Returns the pass's order (an :class:`~feeder.engine.order.Order`, the
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
        pass_ = self.pass_
        if pass_ is not None:
            skips = pass_.skipped_indices
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
    if not skip and skipped.any():
        raise ValueError(f"state['skipped'] marks {_first(skipped)} as skipped, but under "
                         f"on_error='raise' no sample is ever skipped (a resume would never "
                         f"deliver it): {_DAMAGED}")
    both = delivered & skipped
    if both.any():
        raise ValueError(f"state['delivered'] and state['skipped'] both mark {_first(both)}: "
                         f"{_DAMAGED}")
    dispatched = np.zeros(len(delivered), bool)
    dispatched[np.asarray(order, dtype=np.intp)] = True
    for field, bits in (("delivered", delivered), ("skipped", skipped)):
        outside = bits & ~dispatched
        if outside.any():
            raise ValueError(f"state[{field!r}] marks {_first(outside)}, which this rank's pass of "
                             f"epoch {epoch} never hands out: {_DAMAGED}")
    _check_batches(int(delivered.sum()), batches, len(order), batch_size, skip, epoch,
                   "state['delivered'] marks {n} samples")


def _check_batches(n: int, batches: int, length: int, batch_size: int, skip: bool, epoch: int,
                   marks: str) -> None:
    """Refuse a batch count that does not fit ``n`` delivered samples of a pass of
    ``length`` samples (``marks``: the field that marks them, with ``{n}``)."""
    most = -(-length // batch_size)
    if batches > most:
        raise ValueError(f"state['batches'] is {batches}, more than the {most} batches of "
                         f"epoch {epoch}'s pass: {_DAMAGED}")
    if skip:
        # Skipped samples leave holes the tail may not refill: a batch holds 1 to batch_size.
        if not batches <= n <= batches * batch_size:
            raise ValueError(f"{marks.format(n=n)}, which {batches} batches of 1 to {batch_size} "
                             f"samples cannot hold: {_DAMAGED}")
    elif n not in (batches * batch_size, length):
        # Without skips every batch is full but the pass's last.
        raise ValueError(f"{marks.format(n=n)}, but {batches} full batches of {batch_size} hold "
                         f"{batches * batch_size}: {_DAMAGED}")


def check_settings(saved: Any, current: dict[str, Any]) -> None:
    """Refuse a state whose output-determining settings differ from this feeder's.

    A setting an earlier version saved only when it was set (see
    :data:`SAVED_WHEN_SET`) counts as its default when the state lacks it; any
    other missing setting, or one this feeder does not know, is refused.

    Raises:
        ValueError: naming the first differing field and both values.
    """
    if not isinstance(saved, dict):
        raise ValueError(f"state['settings'] must be a dict, got {type(saved).__name__}")
    unknown = sorted(str(name) for name in saved if name not in current)
    if unknown:
        raise ValueError(f"state['settings'] holds {unknown[0]!r}, which this feeder does not "
                         f"know: the state is from another version or damaged")
    for name, value in current.items():
        if name in saved:
            was = saved[name]
        elif name in SAVED_WHEN_SET:
            was = SAVED_WHEN_SET[name]
        elif name in UNRECORDED_BEFORE:
            continue  # an earlier version's state: it did not record this
        else:
            raise ValueError(f"state['settings'] lacks {name!r}")
        if _normal(was) != _normal(value):
            raise ValueError(f"cannot resume: {name} differs (saved {was!r}, "
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
    position = state.get("position")
    n = len(order)
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= n:
        raise ValueError(f"state['position'] must be an int in [0, {n}] (this rank's pass of "
                         f"epoch {epoch} has {n} samples), got {position!r}: {_DAMAGED}")
    after = _int_list(state.get("after"), "after")
    if any(b <= a for a, b in zip(after, after[1:])) or (after and not position < after[0]) or (
            after and after[-1] >= n):
        raise ValueError(f"state['after'] must hold increasing positions in ({position}, {n}), "
                         f"got {after[:5]}{' ...' if len(after) > 5 else ''}: {_DAMAGED}")
    skipped = _int_list(state.get("skipped"), "skipped")
    if not skip and skipped:
        raise ValueError(f"state['skipped'] lists sample {skipped[0]} as skipped, but under "
                         f"on_error='raise' no sample is ever skipped: {_DAMAGED}")
    if len(set(skipped)) != len(skipped) or any(not 0 <= i < length for i in skipped):
        raise ValueError(f"state['skipped'] must hold distinct samples in [0, {length}): {_DAMAGED}")
    handled = Handled(position, tuple(after))
    _check_batches(handled.count() - len(skipped), state["batches"], n, batch_size, skip, epoch,
                   "state['position'] and state['after'] mark {n} samples delivered")
    return handled, skipped


# Settings an earlier version saved only when they were set: a state without
# one was saved with its default. Every state saves them now.
SAVED_WHEN_SET: dict[str, Any] = {"shuffle_window": 8192, "shuffle_shards": None,
                                  "max_image_size": None, "size_divisibility": 1,
                                  "group_by_aspect_ratio": None,
                                  "max_pixels": DEFAULT_MAX_PIXELS}
# Facts an earlier version did not record at all: a state without one is not checked on it.
UNRECORDED_BEFORE = ("shard_layout",)


def layout_digest(layout: Any) -> str | None:
    """The shards' sample ranges, which ``shuffle="shards"`` orders by, in a short
    string (two sources of one length may cut it into other shards); None
    for the other orders, which do not depend on them."""
    if layout is None:
        return None
    ranges = np.asarray(layout.ranges, dtype=np.int64).reshape(-1, 2)
    digest = hashlib.blake2b(ranges.tobytes(), digest_size=8).hexdigest()
    return f"{len(ranges)} shards, blake2b {digest}"


class Cursor:
    """Where a feeder stands between passes: the epoch its next pass takes, what its
    latest pass has delivered, and a place inside an epoch to start the next pass
    from (a loaded state, or :meth:`skip`). Behind ``Feeder.set_epoch``,
    ``skip``, ``state_dict`` and ``load_state_dict``.

    Args:
        config: The feeder's :class:`~feeder.engine.config.Config`.
        source: The feeder's source.
        chain: Its transforms (for the image size and the transforms' descriptions).
        layout: The source's shard layout (see :func:`~feeder.engine.sampler.shard_layout`).
        ranks: The feeder's :class:`~feeder.engine.ranks.Ranks`: the seed and shard in use,
            read when they are needed (the seed is agreed on at the first pass).
    """

    def __init__(self, config: Any, source: Any, chain: Any, layout: Any, ranks: Ranks) -> None:
        self.config = config
        self.source = source
        self.chain = chain
        self.layout = layout
        self.layout_digest = layout_digest(layout)
        self.ranks = ranks
        self.next_epoch = 0
        self.progress: Progress | None = None  # the latest pass's
        # A loaded state's unfinished pass and the epoch to use after it (see load_state_dict).
        self.resume: tuple[Progress, int] | None = None

    def latest_epoch(self) -> int:
        """The epoch of the latest pass, else of the next one."""
        return self.progress.epoch if self.progress is not None else self.next_epoch

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < EPOCHS:
            raise ValueError(f"epoch must be an int in [0, 2**64), got {epoch!r}")
        self.next_epoch = epoch
        if self.resume is not None and self.resume[0].epoch != epoch:
            self.resume = None  # another epoch than the loaded state's unfinished one

    def start(self, begin: Callable[[int, Handled | None], Any]) -> tuple[Any, Progress]:
        """Start the next pass: ``begin(epoch, handled)`` starts its threads (``handled``:
        what a resumed pass must not dispatch again); returns the pass and its progress."""
        epoch = self.next_epoch
        if epoch >= EPOCHS:
            raise ValueError(f"epoch {epoch} is past the last epoch 2**64 - 1 (orders and "
                             f"randomness are keyed by 64 bits of it): set_epoch() another")
        resume = self.resume
        done = None
        if resume is not None and resume[0].epoch == epoch:
            progress, next_epoch = resume
            done = progress.handled()
        else:
            progress, next_epoch = self.new_progress(epoch), epoch + 1
        # The epoch and the resume are used up only once the pass is running: a
        # start that fails (a closed feeder, a rank contradiction) leaves them.
        pass_ = begin(epoch, done)
        self.next_epoch, self.resume = next_epoch, None
        progress.pass_ = pass_
        self.progress = progress
        return pass_, progress

    def skip(self, batches: int, total: int, agree: Callable[[], Any]) -> None:
        """``Feeder.skip``: ``total`` is ``len(feeder)``; ``agree`` agrees on the seed."""
        if isinstance(batches, bool) or not isinstance(batches, int) or not 0 <= batches < total:
            raise ValueError(f"batches must be an int in [0, len(feeder)) = [0, {total}) (to skip "
                             f"a whole epoch, set_epoch(epoch + 1)), got {batches!r}")
        if batches == 0:
            return
        epoch = self.next_epoch
        if self.resume is not None:
            raise ValueError(f"the state given to load_state_dict already positions the next pass "
                             f"inside epoch {epoch}; skip() would skip batches of the resumed pass")
        # The order is cut from rank 0's seed: agree on it now, as a first pass would.
        agree()
        # A resume of this epoch as if a pass had delivered those batches: the
        # same path as load_state_dict, so state_dict() before the pass keeps it.
        self.resume = (self.new_progress(epoch, Handled(batches * self.config.batch_size), (),
                                         batches), epoch + 1)

    def order(self, epoch: int, rank: int | None = None, seed: int | None = None) -> Any:
        """This rank's (or ``rank``'s) order of ``epoch``, as the sampler dispatches it."""
        c = self.config
        seed = self.ranks.seed if seed is None else seed
        this_rank, world_size = self.ranks.shard()
        order = pass_sequence(len(self.source), c.batch_size, c.shuffle, c.drop_last,
                              c.on_error == "skip", seed, epoch,
                              this_rank if rank is None else rank, world_size, self.layout)
        return group_sequence(order, self.source, c, self.chain, seed, epoch)

    def next_order(self) -> Any:
        """What the next pass dispatches on this rank, in order: its epoch's order,
        less what a loaded state's pass or :meth:`skip` has handled."""
        epoch = self.next_epoch
        if epoch >= EPOCHS:
            raise ValueError(f"epoch {epoch} is past the last epoch 2**64 - 1: set_epoch() another")
        order = self.order(epoch)
        resume = self.resume
        if resume is not None and resume[0].epoch == epoch:
            return Remaining(order, resume[0].handled())
        return order

    def new_progress(self, epoch: int, start: Handled | None = None, skipped: Any = (),
                     batches: int = 0) -> Progress:
        # The order is made at its first need, with the seed then agreed on.
        return Progress(epoch, len(self.source), lambda: self.order(epoch), start, skipped, batches)

    def settings(self) -> dict[str, Any]:
        """The settings that decide which samples a pass delivers, in which order and
        batches, and with which pixels: every one is saved and checked on load."""
        c = self.config
        rank, world_size = self.ranks.shard()
        return {"source_length": len(self.source), "shard_layout": self.layout_digest,
                "seed": self.ranks.seed, "batch_size": c.batch_size, "shuffle": c.shuffle,
                "shuffle_window": c.shuffle_window, "shuffle_shards": c.shuffle_shards,
                "drop_last": c.drop_last, "ordered": c.ordered, "on_error": c.on_error,
                "rank": rank, "world_size": world_size,
                "image_size": tuple(self.chain.image_size),
                "max_image_size": None if c.max_image_size is None else tuple(c.max_image_size),
                "size_divisibility": c.size_divisibility,
                "group_by_aspect_ratio": c.group_by_aspect_ratio,
                "exif_orientation": c.exif_orientation,
                # Which samples fail (and, under on_error="skip", which batches come).
                "max_pixels": c.max_pixels,
                "transforms": describe_transforms(self.chain.transforms)}

    def _finished(self, handled: int) -> bool:
        c = self.config
        rank, world_size = self.ranks.shard()
        return pass_finished(handled, len(self.source), c.batch_size, c.drop_last,
                             c.on_error == "skip", rank, world_size)

    def state_dict(self, skipped_total: Callable[[], int]) -> dict[str, Any]:
        """``Feeder.state_dict``; ``skipped_total()``: the samples skipped so far."""
        epoch: int | None = None
        delivered = skipped = None
        handled: Handled | None = None
        skipped_list: list[int] | None = None
        compact = len(self.source) > COMPACT_ABOVE
        batches = 0
        next_epoch = self.next_epoch
        if self.resume is not None:
            progress, next_epoch = self.resume
        else:
            progress = self.progress
            if progress is not None and progress.ended:
                progress = None
        if progress is not None:
            handled, skipped_list, batches = progress.compact()
            if progress.batches and self._finished(handled.count()):
                # Every batch is delivered but the loop has not asked for the end
                # (Lightning stops at len(feeder)): the uninterrupted run's next
                # pass is the next epoch, not an empty rest of this one.
                progress = None
                handled = skipped_list = None
            else:
                epoch = progress.epoch
                if not compact:
                    done, failed, _ = progress.snapshot()
                    delivered, skipped = pack(done), pack(failed)
        # A grouped order depends on the images' sizes, not on the settings alone:
        # the resumed pass checks that it regroups the same way.
        grouped = (self.grouped_digest(progress.order)
                   if progress is not None and self.config.group_by_aspect_ratio is not None
                   else None)
        if compact:
            return {"version": COMPACT_VERSION, "epoch": epoch, "next_epoch": next_epoch,
                    "batches": batches, "position": None if handled is None else handled.position,
                    "after": None if handled is None else list(handled.after),
                    "skipped": skipped_list, "skipped_total": skipped_total(),
                    "grouped_order": grouped, "settings": self.settings()}
        return {"version": FORMAT_VERSION, "epoch": epoch, "next_epoch": next_epoch,
                "batches": batches, "delivered": delivered, "skipped": skipped,
                "skipped_total": skipped_total(), "grouped_order": grouped,
                "settings": self.settings()}

    @staticmethod
    def grouped_digest(order: Order) -> str:
        """A digest of a grouped pass's order (an array: see ``group_sequence``)."""
        flat = np.ascontiguousarray(order.take(0, len(order)), dtype=np.int64)
        return hashlib.blake2b(flat.tobytes(), digest_size=16).hexdigest()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``Feeder.load_state_dict``."""
        version = state.get("version") if isinstance(state, dict) else None
        if version not in (FORMAT_VERSION, COMPACT_VERSION) or isinstance(version, bool):
            found = version if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a feeder state of format version {FORMAT_VERSION} or "
                             f"{COMPACT_VERSION} (got {found!r})")
        settings = state.get("settings")
        current = self._current_settings(settings)
        saved_rank = current["rank"]
        check_settings(settings, current)
        epoch, next_epoch = state.get("epoch"), state.get("next_epoch")
        _check_counts(state, epoch, version)
        resume = None
        if epoch is not None:
            resume = self._resumed_pass(state, version, epoch, next_epoch, saved_rank,
                                        current["seed"])
            if resume is None:
                epoch = None  # nothing left of that pass: continue with the next
        self.ranks.seed = current["seed"]
        self.resume = resume
        self.progress = None
        self.next_epoch = epoch if epoch is not None else next_epoch

    def _current_settings(self, saved: Any) -> dict[str, Any]:
        """This feeder's settings as a saved state's must be: with the saved seed
        when the feeder drew its own, and the saving rank's when batches are ordered."""
        current = self.settings()
        c = self.config
        if (c.seed is None and isinstance(saved, dict)
                and isinstance(saved.get("seed"), int) and not isinstance(saved["seed"], bool)
                and 0 <= saved["seed"] < 2**64):
            current["seed"] = saved["seed"]
        world_size = current["world_size"]
        if (isinstance(saved, dict) and c.ordered and c.on_error == "raise"
                and saved.get("world_size") == world_size
                and isinstance(saved.get("rank"), int) and 0 <= saved["rank"] < world_size):
            # Another rank's state (a trainer that checkpoints from rank 0 only):
            # with ordered batches, every rank's position is its batch count,
            # and the ranks step together, so this rank continues from there.
            current["rank"] = saved["rank"]
        return current

    def _resumed_pass(self, state: dict[str, Any], version: int, epoch: int, next_epoch: int,
                      saved_rank: int, seed: int) -> tuple[Progress, int] | None:
        """The unfinished pass of a state, checked; None when nothing is left of it."""
        c = self.config
        length = len(self.source)
        skip = c.on_error == "skip"
        order = self.order(epoch, saved_rank, seed)
        saved_grouped = state.get("grouped_order")
        if (saved_grouped is not None and c.group_by_aspect_ratio is not None
                and saved_grouped != self.grouped_digest(order)):
            # Same settings, other sizes: the images changed, or their headers
            # read otherwise (positions along another order would lose samples).
            raise ValueError(f"cannot resume: grouped_order of epoch {epoch} differs (saved "
                             f"{saved_grouped!r}, this feeder {self.grouped_digest(order)!r}): "
                             f"the image sizes that group_by_aspect_ratio reads are not those "
                             f"of the saving run")
        field = "delivered"
        if version == FORMAT_VERSION:
            if length > LAZY_MIN:
                raise ValueError(
                    f"state of format {FORMAT_VERSION} (bitmaps) for a source of {length} "
                    f"samples: sources of more than {LAZY_MIN} samples have had another "
                    f"order since format {COMPACT_VERSION}, so its unfinished pass cannot be "
                    f"resumed; start that epoch again (set_epoch({epoch})) or the next one")
            done = unpack(state.get("delivered"), length, "delivered")
            skipped = unpack(state.get("skipped"), length, "skipped")
            check_progress(done, skipped, state["batches"], order[:], c.batch_size, skip, epoch)
            handled, skipped_list = handled_from_bitmaps(done, skipped, order)
        else:
            field = "position"
            handled, skipped_list = load_compact(state, order, length, c.batch_size, skip, epoch)
        if c.ordered and c.on_error == "raise":
            # The delivered samples must be the head of the epoch's order,
            # else the rest would not be the uninterrupted run's batches.
            n = handled.count()
            whole = n in (state["batches"] * c.batch_size, len(order))
            if not whole or handled.after:
                raise ValueError(f"state[{field!r}] is not the start of epoch {epoch}'s "
                                 f"order ({n} samples in {state['batches']} batches): the "
                                 f"state is damaged or from other settings")
            rank = self.ranks.shard()[0]
            if saved_rank != rank:
                mine = self.order(epoch, rank, seed)
                handled = Handled(min(len(mine), state["batches"] * c.batch_size))
        resume = (self.new_progress(epoch, handled, skipped_list, state["batches"]), next_epoch)
        if state["batches"] and self._finished(handled.count()):
            return None
        return resume


def _check_counts(state: dict[str, Any], epoch: Any, version: int) -> None:
    """Refuse a state whose epochs and counts are not ints >= 0, or that holds an
    unfinished pass's fields without its epoch."""
    for name, value, most in (("epoch", epoch, EPOCHS - 1),
                              ("next_epoch", state.get("next_epoch"), EPOCHS),
                              ("batches", state.get("batches"), None)):
        if not (value is None and name == "epoch") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
                or (most is not None and value > most)):
            bound = "" if most is None else f" and <= {'2**64' if most == EPOCHS else '2**64 - 1'}"
            raise ValueError(f"state[{name!r}] must be an int >= 0{bound}, got {value!r}")
    total = state.get("skipped_total")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"state['skipped_total'] must be an int >= 0, got {total!r}")
    if epoch is None:
        for name in (("delivered", "skipped") if version == FORMAT_VERSION
                     else ("position", "after", "skipped")):
            if state.get(name) is not None:
                raise ValueError(f"state[{name!r}] must be None when state['epoch'] is None "
                                 f"(no unfinished pass), got {type(state[name]).__name__}")
