"""The fields every sample of one feeder must share (:class:`Schema`), and the
record one sample travels the stages in (:class:`Task`)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..errors import FieldError, SourceError
from .fields import BOXES, Spec, per_box
from .parse import spec_of


class Schema:
    """Every field's :class:`Spec`, fixed by the first sample read that has it, for
    one feeder.

    Thread-safe. A sample that disagrees with it fails with a :class:`FieldError`
    naming the field, the sample and both shapes (a fault of that sample's data:
    skipped under ``on_error="skip"``). The first sample also fixes whether
    batches are pairs or dicts (a source mixing both is a :class:`SourceError`)
    and the dict's keys.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.specs: dict[str, Spec] = {}
        self.first: dict[str, int] = {}  # field -> the sample that fixed its spec
        self.keys: tuple[str, ...] | None = None  # the dict samples' keys, image included
        self.is_dict: bool | None = None
        self.first_sample = -1
        #: True once pairs with int labels are known to be the samples: the read
        #: step then takes them without any of the checks above.
        self.classic = False
        #: Samples that agreed with the schema, counted up to 2: while it is 1,
        #: only the sample that fixed the schema has its fields. (The read step
        #: sets it to 2 for a classic pair, which skips :meth:`check`.)
        self.support = 0
        #: For each other set of fields samples disagreeing with the schema had,
        #: how many had it (kept while support is 1; see :meth:`_disagreed`).
        self._others: dict[tuple, list[int]] = {}

    def state(self) -> tuple:
        """What the first samples fixed, to be :meth:`adopt`-ed by another process's
        schema (the isolated engine's training process)."""
        return (dict(self.specs), self.keys, self.is_dict, self.classic)

    def adopt(self, state: tuple) -> None:
        """Take ``state`` (from :meth:`state`) as what the samples fixed."""
        self.specs, self.keys, self.is_dict, self.classic = state

    def check(self, index: int, is_dict: bool, keys: tuple[str, ...] | None,
              fields: dict[str, Any]) -> None:
        """Check a parsed sample against the schema, fixing what is not fixed yet.

        Raises:
            SourceError: pairs and dicts mixed.
            FieldError: naming the field, this sample, the first sample and both specs.
        """
        if self.is_dict is None:
            with self._lock:
                if self.is_dict is None:
                    self.keys, self.first_sample = keys, index
                    self.is_dict = is_dict
        if is_dict != self.is_dict:
            have = "a dict" if is_dict else "a (bytes, label) pair"
            want = "dicts" if self.is_dict else "(bytes, label) pairs"
            raise SourceError(f"sample {index} is {have} but sample {self.first_sample} was not: "
                              f"a source must return {want} for every sample")
        if is_dict and keys != self.keys and set(keys) != set(self.keys):
            missing = sorted(set(self.keys) - set(keys))
            extra = sorted(set(keys) - set(self.keys))
            name = (missing or extra)[0]
            self._disagreed(index, keys, fields)
            raise FieldError(name, f"is {'missing from' if missing else 'extra in'} sample {index}: "
                                   f"it has the fields {sorted(keys)}, sample {self.first_sample} (the "
                                   f"first read) had {sorted(self.keys)}; every sample must have the "
                                   f"same fields")
        self._check_fields(index, keys, fields)
        if self.support < 2:
            with self._lock:
                self.support += 1

    #: Samples read after the first that must agree with one another, and not
    #: with it, before the first is taken for the malformed one (see _disagreed):
    #: enough that a good first sample followed by as many bad ones in a row
    #: (a source with a share p of samples malformed alike: p^8) is all but
    #: impossible, few enough to stop early.
    OUTVOTED = 8

    def _disagreed(self, index: int, keys: tuple[str, ...] | None, fields: dict[str, Any]) -> None:
        """Note that sample ``index`` disagrees with the schema; raise a
        :class:`SourceError` (never skipped) once :attr:`OUTVOTED` samples have
        agreed with one another and not with the first sample, which no other
        sample has agreed with: that one sample is then far likelier the malformed
        one, and skipping every sample unlike it (``on_error="skip"``) would
        throw the good ones away."""
        if self.support != 1:
            return
        kind = (frozenset(keys or ()), tuple(sorted((n, spec_of(n, v)) for n, v in fields.items())))
        with self._lock:
            seen = self._others.setdefault(kind, [])
            seen.append(index)
            if len(seen) < self.OUTVOTED or self.support != 1:
                return
            seen = list(seen)
        raise SourceError(
            f"sample {self.first_sample}, the first sample read, fixed the batches' fields "
            f"({self._described()}), and no sample read since has agreed with it, while samples "
            f"{', '.join(map(str, seen))} agree with one another ({_described(keys, fields)}): "
            f"sample {self.first_sample} is probably malformed. Every sample must have the same "
            f"fields, shapes and dtypes; fix or remove that sample (not skipped: skipping every "
            f"sample unlike it would drop the good ones)")

    def _described(self) -> str:
        return ", ".join(f"{n}: {spec.describe()}" for n, spec in sorted(self.specs.items()))

    def _check_fields(self, index: int, keys: tuple[str, ...] | None, fields: dict[str, Any]) -> None:
        specs = self.specs
        for name, value in fields.items():
            spec = spec_of(name, value)
            known = specs.get(name)
            if known is None:
                with self._lock:
                    known = specs.setdefault(name, spec)
                    self.first.setdefault(name, index)
            if known != spec:
                hint = ""
                boxes = fields.get(BOXES)
                if boxes is not None and not per_box(name) and (
                        (isinstance(value, np.ndarray) and value.ndim and len(value) == len(boxes))
                        or (len(boxes) == 1 and np.ndim(value) == 0)):
                    hint = (f" (it has as many entries as the sample has boxes: a field of one "
                            f"entry per box is named 'box_{name}', or, from a DatasetSource, listed "
                            f"in per_box=[...], and is then filtered with the boxes)")
                self._disagreed(index, keys, fields)
                raise FieldError(name, f"of sample {index} is {spec.describe()}{_shown(value)}, but "
                                       f"sample {self.first[name]} gave {known.describe()}; every "
                                       f"sample's {name!r} must have one shape and dtype{hint}")


def _described(keys: tuple[str, ...] | None, fields: dict[str, Any]) -> str:
    return ", ".join(f"{n}: {spec_of(n, v).describe()}" for n, v in sorted(fields.items()))


def _shown(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return ""
    text = repr(value)
    return f" ({text if len(text) <= 40 else text[:37] + '...'})"


class Task:
    """One sample on its way through the stages (one object, reused by every stage).

    Attributes:
        batch: The ``engine.filling.FillingBatch`` it belongs to.
        slot: Its position in that batch.
        index: Its index in the source.
        data: The encoded bytes, or the pixels of a decoded image (an array
            from :func:`pixels`), between the read and the decode step.
        label: Its label, as the source gave it (pairs with an int label).
        fields: Every field but the image, checked (:func:`parse_sample`), or
            None for a pair with an int label: that common case takes no
            per-field work at all.
        key: Its randomness key, from (seed, epoch, index); None until known
            (the sampler keys whole batches, the decode step any task without one).
        image: The decoded image, between the decode and the transform step.
        ctx: The ``ops.SampleContext`` the decode step computed for the transforms.
    """

    __slots__ = ("batch", "slot", "index", "data", "label", "fields", "key", "image", "ctx")

    def __init__(self, batch: Any, slot: int, index: int, key: int | None = None) -> None:
        self.batch = batch
        self.slot = slot
        self.index = index
        self.data: Any = None
        self.label: Any = -1
        self.fields: dict[str, Any] | None = None
        self.key = key
        self.image: Any = None
        self.ctx: Any = None
