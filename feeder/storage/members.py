"""The member table of :class:`feeder.shards.TarShards`: per shard, its index and,
per sample, the member holding its image and its label, with every member's
offset and size (what a read looks up).

Two ways to build it, one interface (:class:`MemberTable`):

* :class:`LoadedMembers`: every shard's index loaded when the source is built
  (shards without a shard list, or a short list);
* :class:`LazyMembers`: the samples numbered from the shard list's counts, a
  shard's index loaded at its first read and kept in a bounded LRU
  (:class:`feeder.storage.index.IndexTable`).

``TarShards.__init__`` picks one (``lazy_index=``) and keeps its columns
(``indices``, ``image_member``, ``label_member``, ``offsets``, ``sizes``, each
indexed by shard number); the fields and labels are decided from ``checked``.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from .index import Column, IndexTable, load_indices
from .local import no_collection
from .tar import ShardFormatError, ShardIndex


def count_mismatch(name: str, found: int, expected: int) -> ShardFormatError:
    """The error for a shard holding another number of samples than its list says."""
    return ShardFormatError(f"{name}: holds {found} samples but the shard list says {expected}: "
                            f"the shard or the list is damaged or out of date (re-pack, or fix "
                            f"the list)")


def joined(parts: Iterable[np.ndarray | None]) -> np.ndarray | None:
    """The shards' per-sample arrays (image sizes, transposed flags) joined in
    sample order, or None when there is none or a shard's index lacks them."""
    parts = list(parts)
    if not parts or any(p is None for p in parts):
        return None
    return np.concatenate(parts)  # type: ignore[arg-type]


def pick_members(ix: ShardIndex, image_exts: Sequence[str],
                 label: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, the member holding its image and its label (-1: none)."""
    img = np.full(len(ix), -1, np.int64)
    lab = np.full(len(ix), -1, np.int64)
    rank = {e: r for r, e in enumerate(image_exts)}
    for s in range(len(ix)):
        best = len(rank)
        for m in ix.members(s):
            e = ix.exts[m]
            r = rank.get(e)
            if r is not None and r < best:
                best, img[s] = r, m
            elif e == label:
                lab[s] = m
    return img, lab


def entry_of(ix: ShardIndex, image_exts: Sequence[str], label: str | None) -> tuple:
    """What a read needs of one shard: its index, each sample's image and label
    member, and the members' offsets and sizes, as lists."""
    img, lab = pick_members(ix, image_exts, label)
    return ix, img.tolist(), lab.tolist(), ix.offsets.tolist(), ix.sizes.tolist()


def compact_entry(entry: tuple) -> tuple:
    """``entry`` with its per-member numbers as ``array('q')``."""
    # Lazily indexed shards keep their per-member numbers as array('q'): 8
    # bytes each instead of a list's 36 (indexing still gives Python ints),
    # so that the index LRU costs about 4 MB per 10^4-sample shard, not 5.6.
    ix, *columns = entry
    return (ix, *(array.array("q", c) for c in columns))


def lazy_entry(shard: Any, expected: int, warn: Callable[[str], None], deadline: float | None,
               image_exts: Sequence[str], label: str | None) -> tuple:
    """Shard ``shard``'s entry, its index loaded now (lazy indexing), its sample
    count checked against the shard list's (the numbering rests on it)."""
    ix = shard.load_index(warn, deadline)
    if len(ix) != expected:
        raise count_mismatch(shard.name, len(ix), expected)
    return compact_entry(entry_of(ix, image_exts, label))


class MemberTable:
    """What both ways of building the table give.

    Attributes:
        counts: Samples per shard.
        lazy_counts: The shard list's counts when indices load lazily, else None.
        indices, image_member, label_member, offsets, sizes: The columns, each
            indexed by shard number.
    """

    counts: list[int]
    lazy_counts: list[int] | None = None
    _checked: tuple[list[int], list[tuple]] = ([], [])

    def pop_checked(self) -> tuple[list[int], list[tuple]]:
        """The shard numbers and entries the fields and the image and label checks
        are decided from, handed over once: not kept, so that with lazy indexing
        the first shard's index does not stay in memory past the LRU's bound."""
        checked, self._checked = self._checked, ([], [])
        return checked

    def columns(self) -> tuple:
        """``(indices, image_member, label_member, offsets, sizes)``."""
        return self.indices, self.image_member, self.label_member, self.offsets, self.sizes

    @property
    def loaded(self) -> int:
        """Shard indices loaded so far."""
        raise NotImplementedError

    def will_read(self, shards: set[int]) -> None:
        """A hint that these shards are read soon; never blocks."""

    def ahead(self, shards: Sequence[int], want_copy: Callable[[int], None]) -> None:
        """A hint that these shards are read next: their indices loaded and their
        copies into the cache started (``want_copy``), in the background."""
        raise NotImplementedError

    def reserve(self, count: int) -> int | None:
        """Keep at least ``count`` indices in memory; the new bound, or None when
        unchanged."""
        return None

    def all_indices(self, shards: list[Any], warn: Callable[[str], None],
                    store: Any) -> list[ShardIndex]:
        """Every shard's index."""
        raise NotImplementedError


class LoadedMembers(MemberTable):
    """Every shard's index, loaded at construction (remote ones in parallel,
    within the deadline), each shard's sample count checked against the shard
    list's where it gives one.

    Args:
        shards: The shards (:class:`feeder.storage.index.LocalShard` or remote).
        expected: Each shard's sample count in the shard list (None: not given).
    """

    def __init__(self, shards: list[Any], expected: Sequence[int | None],
                 warn: Callable[[str], None], deadline: float | None, deadline_s: float | None,
                 store: Any, image_exts: Sequence[str], label: str | None) -> None:
        loaded = load_indices(shards, warn, deadline, deadline_s, store)
        for shard, ix, count in zip(shards, loaded, expected):
            if count is not None and count != len(ix):
                raise count_mismatch(shard.name, len(ix), count)
        self.counts = [len(ix) for ix in loaded]
        entries = [entry_of(ix, image_exts, label) for ix in loaded]
        self._checked = (list(range(len(shards))), entries)
        self.indices: Any = [e[0] for e in entries]
        # Plain lists (not numpy scalars): a read looks these up at Python speed.
        self.image_member: Any = [e[1] for e in entries]
        self.label_member: Any = [e[2] for e in entries]
        self.offsets: Any = [e[3] for e in entries]
        self.sizes: Any = [e[4] for e in entries]

    @property
    def loaded(self) -> int:
        return len(self.indices)

    def ahead(self, shards: Sequence[int], want_copy: Callable[[int], None]) -> None:
        for s in shards:
            want_copy(s)

    def all_indices(self, shards: list[Any], warn: Callable[[str], None],
                    store: Any) -> list[ShardIndex]:
        return [self.indices[s] for s in range(len(shards))]


class LazyMembers(MemberTable):
    """The samples numbered from the shard list's counts; each shard's index
    loaded at its first need through ``owner._index_entry(s, count)`` (see
    :class:`feeder.storage.index.IndexTable`).

    Args:
        owner: The source (held weakly by the table).
        counts: Every shard's sample count, from the shard list.
        capacity: Indices kept in memory.
        deadline: When the first index must have arrived (``time.monotonic()``).
        first: Load the first non-empty shard's index now, the fields and the
            checks coming from it (False: a copy in another process).
    """

    def __init__(self, owner: Any, counts: list[int], capacity: int,
                 deadline: float | None = None, first: bool = True) -> None:
        self.counts = self.lazy_counts = counts
        self.table = IndexTable(owner, counts, capacity)
        self.indices, self.image_member, self.label_member, self.offsets, self.sizes = (
            Column(self.table, k) for k in range(5))
        if first:
            s = next((k for k, c in enumerate(counts) if c), 0)
            # One request; its parse makes 10^5 objects, whose collections would
            # walk the list's 10^6 again.
            with no_collection():
                entry = self.table.put(s, owner._index_entry(s, counts[s], deadline))
            self._checked = ([s], [entry])

    @property
    def loaded(self) -> int:
        return self.table.loads

    def will_read(self, shards: set[int]) -> None:
        table = self.table
        todo = [s for s in shards if not table.cached(s)]
        if todo:
            table.ahead(todo)

    def ahead(self, shards: Sequence[int], want_copy: Callable[[int], None]) -> None:
        self.table.ahead(shards, copy=True)

    def reserve(self, count: int) -> int | None:
        if count > self.table.capacity:
            self.table.capacity = count
            return count
        return None

    def all_indices(self, shards: list[Any], warn: Callable[[str], None],
                    store: Any) -> list[ShardIndex]:
        # Read once more, not through the LRU.
        indices = load_indices(shards, warn, None, None, store)
        for shard, ix, expected in zip(shards, indices, self.counts):
            if len(ix) != expected:
                raise count_mismatch(shard.name, len(ix), expected)
        return indices


class ImageSizes:
    """Each sample's image (height, width) as stored and whether its EXIF
    orientation swaps them, from every shard's index, read once when first
    asked (``all_indices`` gives them); a shard list of an earlier
    ``feeder-pack`` may give the sizes up front (``listed``)."""

    def __init__(self, listed: np.ndarray | None) -> None:
        self.sizes = listed
        self.sizes_read = False
        self.transposed: np.ndarray | None = None
        self.transposed_read = False

    def stored(self, all_indices: Callable[[], list[ShardIndex]]) -> np.ndarray | None:
        """The sizes (a copy), None when a shard's index has none."""
        if self.sizes is None and not self.sizes_read:
            self.sizes_read = True  # None from the indices too: not asked again
            indices = all_indices()
            # The transposed flags come with the same indices: read them now, once.
            self.transposed_read = True
            self.transposed = joined(ix.image_transposed for ix in indices)
            self.sizes = joined(ix.image_sizes for ix in indices)
        return None if self.sizes is None else self.sizes.copy()

    def oriented(self, all_indices: Callable[[], list[ShardIndex]]) -> np.ndarray | None:
        """The sizes after each image's EXIF orientation, None when a shard's index
        does not record the transposed images."""
        sizes = self.stored(all_indices)
        if sizes is None:
            return None
        if self.transposed is None and not self.transposed_read:
            self.transposed_read = True
            self.transposed = joined(ix.image_transposed for ix in all_indices())
        flags = self.transposed
        if flags is None:
            return None
        sizes[flags] = sizes[flags][:, ::-1]
        return sizes
