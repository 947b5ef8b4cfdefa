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

import numpy as np

from ._sampler import num_batches, shard_size

FORMAT_VERSION = 1

# Default reprs of functions and objects carry a memory address that differs
# between processes; it says nothing about what the transform does.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Progress:
    """What one pass (of one epoch) has handled so far.

    Args:
        epoch: The pass's epoch.
        length: ``len(source)``.
        done: Delivered samples from an earlier run of this epoch (a resume), or None.
        skipped: Samples an earlier run of this epoch skipped, or None.
        batches: Batches that earlier run delivered.
    """

    def __init__(self, epoch: int, length: int, done: np.ndarray | None = None,
                 skipped: np.ndarray | None = None, batches: int = 0) -> None:
        self.epoch = epoch
        self.delivered = np.zeros(length, bool) if done is None else done.copy()
        self.skipped = np.zeros(length, bool) if skipped is None else skipped.copy()
        self.first_batch = batches  # the number of this run's first batch
        self.batches = batches
        self.ended = False  # the training loop has taken the end of the pass
        self.run: Any = None  # the Pass, for the samples it skipped
        self._lock = threading.Lock()  # threads sharing one iterator record concurrently

    def handled(self) -> np.ndarray:
        """Samples a resumed pass must not dispatch again: delivered or skipped."""
        return self.delivered | self.skipped

    def record(self, indices: np.ndarray) -> None:
        with self._lock:
            self.delivered[indices] = True
            self.batches += 1

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(delivered, skipped, batches), consistent with each other."""
        with self._lock:
            delivered, batches = self.delivered.copy(), self.batches
        skipped = self.skipped.copy()
        run = self.run
        if run is not None:
            skipped[list(run.skipped_indices)] = True
        return delivered, skipped & ~delivered, batches


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
