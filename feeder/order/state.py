"""The saved state of a feeder's position: its two formats (bitmaps, and a
position with the few samples past it), packing and unpacking them, and every
check a loaded state passes before a pass resumes from it."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

from .sequence import Handled, Order
from ..sample import DEFAULT_MAX_PIXELS

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
    unknown = sorted(str(name) for name in saved if name not in current and name not in SAVED_IF_ANY)
    if unknown:
        raise ValueError(f"state['settings'] holds {unknown[0]!r}, which this feeder does not "
                         f"know: the state is from another version or damaged")
    for name in SAVED_IF_ANY:
        if name in saved and name not in current and saved[name] is not None:
            raise ValueError(f"cannot resume: {name} differs (saved {saved[name]!r}, this feeder None)")
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
                 epoch: int, resharded: bool = False) -> tuple[Handled, list[int]]:
    """The handled positions and skipped samples of a format-2 state, checked as
    :func:`check_progress` checks format 1: a state that no pass could have left
    would lose samples or deliver some twice. ``resharded``: the pass continued
    an epoch begun under another world size (its batches count from there).

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
    if resharded:
        return handled, skipped
    # A mixture may draw a sample more than once in an epoch, so a skipped sample
    # stands for 1 to (its draws among the handled positions) skipped draws.
    count = handled.count()
    delivered = count - len(skipped)
    if skipped and delivered > state["batches"] * batch_size:
        # Only then can repeated draws matter: the delivered count lies in
        # [count - draws, delivered]; take the value nearest the batches' range
        # (counting the draws is a pass over the order, so not for every state).
        delivered = min(delivered, max(count - _draws_of(order, handled, skipped),
                                       state["batches"]))
    _check_batches(delivered, state["batches"], n, batch_size, skip, epoch,
                   "state['position'] and state['after'] mark {n} samples delivered")
    return handled, skipped


# Positions of an order taken at a time when counting draws (bounds the memory).
_DRAW_CHUNK = 1 << 20


def _draws_of(order: Order, handled: Handled, samples: list[int]) -> int:
    """How many of ``handled``'s positions of ``order`` hold one of ``samples``."""
    wanted = np.asarray(sorted(samples), dtype=np.int64)
    count = 0
    for start in range(0, handled.position, _DRAW_CHUNK):
        taken = order.take(start, min(handled.position, start + _DRAW_CHUNK))
        count += int(np.isin(taken, wanted).sum())
    for p in handled.after:
        count += int(np.isin(order.take(p, p + 1), wanted).sum())
    return count


# Settings an earlier version saved only when they were set: a state without
# one was saved with its default. Every state saves them now.
SAVED_WHEN_SET: dict[str, Any] = {"shuffle_window": 8192, "shuffle_shards": None,
                                  "max_image_size": None, "size_divisibility": 1,
                                  "group_by_aspect_ratio": None,
                                  "max_pixels": DEFAULT_MAX_PIXELS}
# Facts an earlier version did not record at all: a state without one is not checked on it.
UNRECORDED_BEFORE = ("shard_layout", "source_order")
# Facts saved only where there is one (None otherwise: the name is left out).
SAVED_IF_ANY = ("source_order",)


def layout_digest(layout: Any) -> str | None:
    """The shards' sample ranges, which ``shuffle="shards"`` orders by, in a short
    string (two sources of one length may cut it into other shards); None
    for the other orders, which do not depend on them."""
    if layout is None:
        return None
    ranges = np.asarray(layout.ranges, dtype=np.int64).reshape(-1, 2)
    digest = hashlib.blake2b(ranges.tobytes(), digest_size=8).hexdigest()
    return f"{len(ranges)} shards, blake2b {digest}"


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


# The end of every message refusing a list of states that no run could have left.
DAMAGED_STATES = "the states are damaged, from other settings, or not one run's"


def check_version(state: Any, name: str) -> int:
    """The format version of ``state`` (``name`` in messages), one this version reads."""
    version = state.get("version") if isinstance(state, dict) else None
    if version not in (FORMAT_VERSION, COMPACT_VERSION) or isinstance(version, bool):
        found = version if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{name} is not a feeder state of format version {FORMAT_VERSION} or "
                         f"{COMPACT_VERSION} (got {found!r})")
    return version


def check_world(saved: Any, current: dict[str, Any]) -> None:
    """Refuse one rank's state saved under another world size, saying what to pass."""
    if not isinstance(saved, dict) or "world_size" not in saved:
        return  # check_settings says what is wrong
    was, now = saved["world_size"], current["world_size"]
    if _normal(was) != _normal(now):
        raise ValueError(f"cannot resume: world_size differs (saved {was!r}, this feeder {now!r}): "
                         f"one rank's state holds only that rank's progress; to continue under "
                         f"another number of ranks pass the list of every rank's state_dict() "
                         f"(gathered with torch.distributed.all_gather_object, or saved per rank)")


def every_rank(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``states`` by rank, checked to be one state per rank of one world size."""
    sizes = {repr(s.get("settings", {}).get("world_size")) for s in states
             if isinstance(s.get("settings"), dict)}
    if len(sizes) != 1 or any(not isinstance(s.get("settings"), dict) for s in states):
        raise ValueError(f"cannot resume: the states' world sizes are {sorted(sizes)}: "
                         f"{DAMAGED_STATES}")
    world = states[0]["settings"]["world_size"]
    ranks = [s["settings"].get("rank") for s in states]
    if (isinstance(world, bool) or not isinstance(world, int) or len(states) != world
            or sorted(r for r in ranks if isinstance(r, int)) != list(range(world))):
        raise ValueError(f"cannot resume: {len(states)} states of ranks {ranks} under "
                         f"world_size={world!r}: pass one state_dict() from every rank")
    return sorted(states, key=lambda s: s["settings"]["rank"])


def common_epoch(states: list[dict[str, Any]]) -> tuple[int | None, int]:
    """(the ranks' unfinished epoch or None, the epoch after it): every rank's state
    must hold the same unfinished epoch, or have finished it."""
    unfinished = {s["epoch"] for s in states if s.get("epoch") is not None}
    if len(unfinished) > 1:
        raise ValueError(f"cannot resume: the ranks' states are inside epochs {sorted(unfinished)}: "
                         f"{DAMAGED_STATES}")
    if not unfinished:
        nexts = {s["next_epoch"] for s in states}
        if len(nexts) != 1:
            raise ValueError(f"cannot resume: the ranks' states continue at epochs {sorted(nexts)}: "
                             f"{DAMAGED_STATES}")
        return None, nexts.pop()
    epoch = unfinished.pop()
    for s in states:
        if s.get("epoch") is None and s["next_epoch"] != epoch + 1:
            raise ValueError(f"cannot resume: rank {s['settings']['rank']}'s state continues at "
                             f"epoch {s['next_epoch']}, the others are inside epoch {epoch}: "
                             f"{DAMAGED_STATES}")
    nexts = {s["next_epoch"] for s in states if s.get("epoch") is not None}
    if len(nexts) != 1:
        raise ValueError(f"cannot resume: the ranks' states continue at epochs {sorted(nexts)} "
                         f"after epoch {epoch}: {DAMAGED_STATES}")
    return epoch, nexts.pop()


def encode_levels(levels: tuple) -> list:
    """The world sizes an epoch went through before the current one (see
    :class:`~feeder.order.sequence.Handled`) as plain lists for a state dict."""
    return [[world, [[h.position, list(h.after)] for h in handled]] for world, handled in levels]


def decode_levels(value: Any, epoch: Any) -> tuple:
    """:func:`encode_levels`'s lists back, their shape checked (the positions are
    checked against the orders they index when those are made)."""
    if value is None:
        return ()
    if epoch is None:
        raise ValueError(f"state['levels'] must be None when state['epoch'] is None, got "
                         f"{type(value).__name__}")
    bad = ValueError(f"state['levels'] must be a list of [world_size, [[position, [after, ...]], "
                     f"...]] (one entry per rank): {_DAMAGED}")

    def natural(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(value, (list, tuple)):
        raise bad
    levels = []
    for level in value:
        if not (isinstance(level, (list, tuple)) and len(level) == 2 and natural(level[0])
                and level[0] >= 1 and isinstance(level[1], (list, tuple)) and len(level[1]) == level[0]):
            raise bad
        handled = []
        for entry in level[1]:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and natural(entry[0])
                    and isinstance(entry[1], (list, tuple)) and all(natural(a) for a in entry[1])):
                raise bad
            after = tuple(entry[1])
            if any(b <= a for a, b in zip(after, after[1:])) or (after and after[0] <= entry[0]):
                raise bad
            handled.append(Handled(entry[0], after))
        levels.append((level[0], tuple(handled)))
    return tuple(levels)
