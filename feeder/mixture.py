"""Weighted mixtures of sources: :class:`Mixture`."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from .order.mixture import MixtureOrder, apportion
from .order.sequence import MAX_LENGTH, Order
from .sources import describe as _describe

__all__ = ["Mixture"]

log = logging.getLogger(__name__)


class Mixture:
    """A source that draws each position of an epoch from one of several sources,
    source ``k`` in proportion ``weights[k]``.

        web = feeder.TarShards("web/{00000..00999}.tar")
        curated = feeder.ImageFolder("curated/train")
        mix = feeder.Mixture([curated, web], weights=[0.3, 0.7])
        loader = feeder.Feeder(mix, batch_size=256, transforms=[...])

    The sources are any feeder sources (folders, lists, tar shards local or
    remote, decoded arrays, dict samples), all giving the same kind of sample:
    ``(image, label)`` pairs, or dicts with the same fields.

    Source ``k``'s sample ``i`` is the mixture's sample ``offsets[k] + i``
    (:meth:`describe` and :meth:`source_of` name the source; so does
    ``Feeder.last_batch.sources``). An epoch has ``samples_per_epoch``
    positions, source ``k`` taking ``weights[k]`` of them in every prefix of the
    epoch to within a sample or two, each source in passes of its own; all of it
    a pure function of (seed, epoch) that resumes as any source does (see
    [Mixtures of datasets](../guides/mixtures.md)).

    Args:
        sources: The sources, two or more (one is allowed: it is that source).
        weights: One positive finite weight per source, normalised to sum to 1;
            None: proportional to the sources' lengths.
        samples_per_epoch: Positions per epoch; None: the sources' total length.
            Shorter epochs suit sources too large for one (a web set: checkpoints
            and evaluations every ``samples_per_epoch``), with
            ``on_error="raise"``: a resume state names skipped samples only below
            ``len(source)``.
        names: A name per source for error messages (default ``"source k"``).

    Attributes:
        sources, names, lengths: The sources, their names and lengths.
        weights: The normalised weights.
        counts: Each source's positions per epoch.
        offsets: Each source's first sample index.
        index_count: The number of sample indices (the sources' total length).
        samples_per_epoch: ``len(mixture)``.

    Raises:
        TypeError, ValueError: a source that is not one, an empty source, a bad
            weight, option or name, a source that the epoch would never draw
            from, or sources whose first samples could not share a batch
            (pairs and dicts, or dicts of other fields), naming them.
    """

    def __init__(self, sources: Sequence[Any], weights: Sequence[float] | None = None, *,
                 samples_per_epoch: int | None = None, names: Sequence[str] | None = None) -> None:
        self.sources = _check_sources(sources)
        self.names = _check_names(names, len(self.sources))
        self.lengths = tuple(len(s) for s in self.sources)
        for k, n in enumerate(self.lengths):
            if n == 0:
                raise ValueError(f"Mixture: {self.names[k]!r} ({_kind(self.sources[k])}) is empty")
        self.offsets = tuple(int(x) for x in np.cumsum((0,) + self.lengths[:-1]))
        total = sum(self.lengths)
        exact = _check_weights(weights, self.lengths, self.names)
        self.weights = tuple(float(w) for w in exact)
        if samples_per_epoch is None:
            samples_per_epoch = total
        elif isinstance(samples_per_epoch, bool) or not isinstance(samples_per_epoch, numbers.Integral):
            raise TypeError(f"Mixture: samples_per_epoch must be an int or None, got "
                            f"{type(samples_per_epoch).__name__}")
        elif not 1 <= samples_per_epoch <= MAX_LENGTH:
            raise ValueError(f"Mixture: samples_per_epoch={samples_per_epoch} must be in [1, 2^62]")
        self.samples_per_epoch = int(samples_per_epoch)
        #: The number of sample indices, ``[0, index_count)``: the sources' total length.
        self.index_count = total
        self.counts = tuple(apportion(exact, self.samples_per_epoch))
        never = [k for k, c in enumerate(self.counts) if c == 0]
        if never:
            k = never[0]
            raise ValueError(f"Mixture: {self.names[k]!r} gets weight {self.weights[k]:.3g}, 0 of the "
                             f"{self.samples_per_epoch} positions of an epoch: raise its weight "
                             f"or samples_per_epoch")
        _check_fields(self.sources, self.names)

    def __len__(self) -> int:
        return self.samples_per_epoch

    def order_settings(self) -> tuple:
        """What :meth:`epoch_order` depends on besides (seed, epoch, shuffle): the
        sources' lengths, in order, and their positions per epoch (from the
        weights). A feeder saves it in its resume state and refuses a state of a
        mixture built otherwise."""
        return ("Mixture", self.lengths, self.counts)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {len_} x {w:.3g}" for n, len_, w
                          in zip(self.names, self.lengths, self.weights))
        return f"Mixture({parts}; {self.samples_per_epoch} per epoch)"

    def locate(self, index: int) -> tuple[int, int]:
        """``(source number, its own index)`` of the mixture's sample ``index``.

        Raises:
            IndexError: ``index`` is not one of the sources' samples.
        """
        i = int(index)
        if not 0 <= i < self.index_count:
            raise IndexError(f"Mixture sample {index} is out of range: the sources hold "
                             f"{self.index_count} samples")
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return k, i - self.offsets[k]

    def source_of(self, indices: Any) -> np.ndarray:
        """The source number of each of the mixture's sample ``indices`` (int64)."""
        at = np.asarray(indices, dtype=np.int64)
        return np.searchsorted(np.asarray(self.offsets, np.int64), at, side="right") - 1

    def read(self, index: int) -> Any:
        """Sample ``index``: its source's sample ``index - offsets[k]``."""
        k, i = self.locate(index)
        return self.sources[k].read(i)

    def describe(self, index: int) -> str:
        """The source's name and its own description of the sample."""
        k, i = self.locate(index)
        return f"{self.names[k]}: {_describe(self.sources[k], i)}"

    @property
    def reads_may_block(self) -> bool | None:
        """True when some source's reads may wait on storage, False when none's may,
        None when some source does not say (see ``Feeder``'s ``read_threads``)."""
        said = [getattr(s, "reads_may_block", None) for s in self.sources]
        if any(v is True for v in said):
            return True
        return False if all(v is False for v in said) else None

    def image_sizes(self) -> np.ndarray | None:
        """(height, width) of every sample as stored (``[index_count, 2]``), when
        every source gives them."""
        return self._sizes("image_sizes")

    def oriented_image_sizes(self) -> np.ndarray | None:
        """As :meth:`image_sizes`, as oriented by EXIF, when every source gives them."""
        return self._sizes("oriented_image_sizes")

    def _sizes(self, name: str) -> np.ndarray | None:
        parts = []
        for s in self.sources:
            fn = getattr(s, name, None)
            given = fn() if callable(fn) else None
            if given is None:
                return None
            parts.append(np.asarray(given, dtype=np.int64).reshape(len(s), 2))
        return np.concatenate(parts)

    def will_read(self, indices: Sequence[int]) -> None:
        """Tell each source which of its samples come next (a hint, see ``TarShards``)."""
        at = np.asarray(indices, dtype=np.int64)
        if not len(at):
            return
        which = self.source_of(at)
        for k in np.unique(which).tolist():
            hint = getattr(self.sources[k], "will_read", None)
            if hint is not None:
                hint((at[which == k] - self.offsets[k]).tolist())

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> Order:
        """The order of ``epoch``: ``len(self)`` sample indices, every rank's
        together (the feeder's epoch plan cuts each rank's share and its batches)."""
        return MixtureOrder(self.counts, self.lengths, self.offsets, seed, epoch, bool(shuffle))


def _kind(source: Any) -> str:
    return type(source).__name__


def _check_sources(sources: Any) -> tuple[Any, ...]:
    if isinstance(sources, (str, bytes, dict)) or not isinstance(sources, Sequence):
        raise TypeError(f"Mixture: sources must be a list of sources, got {type(sources).__name__}")
    if not sources:
        raise ValueError("Mixture: sources is empty; give at least one source")
    for k, s in enumerate(sources):
        if not (hasattr(s, "__len__") and callable(getattr(s, "read", None))):
            raise TypeError(f"Mixture: sources[{k}] ({_kind(s)}) is not a source: a source has "
                            f"__len__ and read(index)")
        if callable(getattr(s, "epoch_order", None)) or getattr(s, "index_count", None) is not None:
            # Its samples are not [0, len(s)) in one pass per epoch: drawn as a
            # plain source, its own order and weights would be ignored and the
            # indices past len(s) never read.
            raise TypeError(f"Mixture: sources[{k}] ({_kind(s)}) orders its own epochs (it has "
                            f"epoch_order or index_count, as a Mixture has), which a mixture "
                            f"cannot draw from: list its sources in this mixture instead, each "
                            f"with its weight times the inner mixture's")
    return tuple(sources)


def _check_names(names: Any, count: int) -> tuple[str, ...]:
    if names is None:
        return tuple(f"source {k}" for k in range(count))
    if isinstance(names, str) or not isinstance(names, Sequence) or len(names) != count:
        raise ValueError(f"Mixture: names must be a list of {count} strings, one per source, "
                         f"got {names!r}")
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != count:
        raise ValueError(f"Mixture: names must be distinct non-empty strings, got {list(names)!r}")
    return tuple(names)


def _check_weights(weights: Any, lengths: Sequence[int], names: Sequence[str]) -> list[Fraction]:
    """The weights as exact fractions summing to 1 (proportional to ``lengths`` when None)."""
    if weights is None:
        raw = [Fraction(n) for n in lengths]
    else:
        if isinstance(weights, (str, bytes, dict)) or not hasattr(weights, "__len__"):
            raise TypeError(f"Mixture: weights must be a list of numbers, got {type(weights).__name__}")
        weights = list(weights)
        if len(weights) != len(lengths):
            raise ValueError(f"Mixture: {len(weights)} weights for {len(lengths)} sources; give "
                             f"one weight per source")
        raw = []
        for k, w in enumerate(weights):
            if isinstance(w, bool) or not isinstance(w, numbers.Real):
                raise TypeError(f"Mixture: the weight of {names[k]!r} must be a number, got "
                                f"{type(w).__name__}")
            if not (math.isfinite(float(w)) and w > 0):
                raise ValueError(f"Mixture: the weight of {names[k]!r} must be positive and finite, "
                                 f"got {w!r}")
            raw.append(Fraction(w) if isinstance(w, numbers.Rational) else Fraction(float(w)))
    total = sum(raw)
    return [w / total for w in raw]


def _sample_kind(sample: Any) -> tuple[str, ...] | None:
    """``("pair",)``, the sorted field names of a dict sample, or None (not a sample:
    the engine says what is wrong with it)."""
    if isinstance(sample, dict):
        return tuple(sorted(str(k) for k in sample))
    if isinstance(sample, tuple) and len(sample) == 2:
        return ("pair",)
    return None


def _check_fields(sources: Sequence[Any], names: Sequence[str]) -> None:
    """Refuse sources whose samples cannot share a batch, judged from each one's
    first sample (a source whose first read fails is judged at the first batch,
    where the engine checks every sample against the first)."""
    seen: list[tuple[int, tuple[str, ...]]] = []
    for k, s in enumerate(sources):
        try:
            kind = _sample_kind(s.read(0))
        except Exception as exc:  # noqa: BLE001 - a bad sample is the pass's to report
            log.debug("Mixture: %r: sample 0 not read (%s): fields checked at the first batch",
                      names[k], exc)
            continue
        if kind is not None:
            seen.append((k, kind))
    for k, kind in seen[1:]:
        first, want = seen[0]
        if kind == want:
            continue
        if "pair" in (kind + want):
            pair, other = (k, first) if kind == ("pair",) else (first, k)
            fields = want if pair == k else kind
            raise ValueError(f"Mixture: {names[pair]!r} ({_kind(sources[pair])}) gives (image, label) "
                             f"pairs but {names[other]!r} ({_kind(sources[other])}) gives dicts of "
                             f"{list(fields)}: a batch holds one kind; give every source the same")
        missing, extra = sorted(set(want) - set(kind)), sorted(set(kind) - set(want))
        raise ValueError(f"Mixture: {names[k]!r} ({_kind(sources[k])}) gives the fields {list(kind)} "
                         f"but {names[first]!r} ({_kind(sources[first])}) gives {list(want)} "
                         f"(missing {missing}, extra {extra}): every sample of a batch must have "
                         f"the same fields")
