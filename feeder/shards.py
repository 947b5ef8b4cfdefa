"""Packed tar shards (the WebDataset layout) as a feeder source.

A dataset of many small files costs a file open and a seek per sample; packed
into tar shards of tens of MB, it is a few large files read at known offsets.
:class:`TarShards` reads shards made by ``feeder-pack`` or by any tool that
writes the WebDataset layout (``key.jpg``, ``key.cls``, ... in ``name-000000.tar``),
from local disk or from ``http(s)://`` (and any fsspec URL: ``s3://``, ``gs://``...
once that backend is installed), in any order, by sample index: the feeder's
global shuffle and exactly-once epochs work as with files.

Fields: the image is the sample's first member among ``image_exts``, the
label the ASCII integer in its ``cls`` member; shards holding more (a mask,
boxes, metadata) give dict samples, each member a field named and decoded by
its extension (:func:`field_of`; the table: [Masks, boxes and other
fields](../guides/shards.md#masks-boxes-and-other-fields)).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .storage.access import (note_facts, open_shards, reads_may_block, release,
                             window_reads_may_block)
from .storage.fields import FIELD_NAMES, field_of
from .storage.local import no_collection
from .storage.members import ImageSizes, LazyMembers, LoadedMembers, MemberTable, lazy_entry
from .storage.shardlist import expand_braces, resolve
from .storage.tar import IMAGE_EXTS, ShardFormatError
from .storage.tarread import MemberReader, plan_fields
from .errors import name_tuple
from .sample import DEFAULT_MAX_PIXELS

# Importable from here before: kept for old imports.
from .storage.fields import json_value, make_plan, npy_array  # noqa: F401
from .storage.index import Column, IndexTable, LocalShard, load_indices  # noqa: F401
from .storage.local import FilePool, on_network_storage  # noqa: F401
from .storage.shardlist import is_url  # noqa: F401
from .storage.tar import COMPRESSED, ShardIndex  # noqa: F401

__all__ = ["FIELD_NAMES", "IMAGE_EXTS", "ShardFormatError", "TarShards", "expand_braces", "field_of"]

log = logging.getLogger(__name__)

# TarShards(deadline_s=): building a remote source as a whole, seconds.
DEFAULT_DEADLINE_S = 60.0
# TarShards(max_field_bytes=): the largest non-image member read, bytes.
DEFAULT_MAX_FIELD_BYTES = 256 << 20

# TarShards(lazy_index="auto"): a shard list naming more shards than this, with
# every shard's sample count, is indexed lazily (no request per shard up front).
LAZY_INDEX_SHARDS = 64
# TarShards(index_cache=): shard indices kept in memory with lazy indexing. An
# index of a shard of 10^4 two-member samples takes about 4 MB (measured with
# tracemalloc: keys and member names 3.6 MB, the arrays 0.3 MB).
DEFAULT_INDEX_CACHE = 16


def _check_options(deadline_s: Any, max_pixels: Any, max_field_bytes: Any, lazy_index: Any,
                   index_cache: Any) -> None:
    """Refuse the options of ``TarShards`` that cannot work, naming them."""
    if deadline_s is not None and not (isinstance(deadline_s, (int, float))
                                       and not isinstance(deadline_s, bool) and deadline_s > 0):
        raise ValueError(f"TarShards: deadline_s must be a number of seconds > 0 or None, "
                         f"got {deadline_s!r}")
    for opt, value in (("max_pixels", max_pixels), ("max_field_bytes", max_field_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"TarShards: {opt} must be an int > 0, got {value!r}")
    if lazy_index not in (True, False, "auto"):
        raise ValueError(f"TarShards: lazy_index must be True, False or 'auto', got "
                         f"{lazy_index!r}")
    if isinstance(index_cache, bool) or not isinstance(index_cache, int) or index_cache < 1:
        raise ValueError(f"TarShards: index_cache must be an int >= 1, got {index_cache!r}")


class TarShards:
    """A source over tar shards in the WebDataset layout.

    Samples are numbered shard by shard, in the order the shards are given, and
    within a shard in the order their keys first appear. Reads go by offset (the
    shard's index: its ``.idx`` file in DALI's ``wds2idx`` format when there is
    one, else one is made by reading the tar headers), so any order of samples
    costs the same and every thread reads on its own.

    Args:
        spec: Where the shards are: a directory (its ``*.tar`` files, sorted), one
            shard, a brace pattern (``"data/train-{000000..000127}.tar"``, also
            as a URL), a local glob, the shard list ``feeder-pack`` writes
            (``train.json``, local or a URL), or a list of shard paths and URLs.
        label: The field holding the class index as ASCII digits (``"cls"``);
            None for unlabeled data (pairs' labels are -1; dict samples have no
            ``"label"`` and the ``cls`` members are not read).
        image_exts: Fields that hold the image, the first present wins (a
            string: that one field).
        fields: What ``read`` returns: ``"auto"``, pairs when every member is an
            image or the label, else dicts of every member; None: always pairs; a
            list of extensions, or a mapping ``{extension: field name}`` (``"*"``
            spreads a JSON object), to choose them (see [Masks, boxes and other
            fields](../guides/shards.md#masks-boxes-and-other-fields)).
        cache_dir: Local copies of remote shards (see :mod:`feeder.storage.remote`;
            default ``$FEEDER_CACHE`` or ``~/.cache/feeder``); False: no cache.
        cache_bytes: The cache's size bound, bytes (default
            ``$FEEDER_CACHE_BYTES`` or 32 GiB).
        retries: Retries of a remote request failing with a transient error
            (a 5xx status, a dropped connection), with exponential backoff.
        backoff_s: The first retry's wait, seconds (doubled each time, with jitter).
        downloads: Remote shards copied into the cache at once, in the background.
        storage_options: Passed to the fsspec file system of remote shards
            (credentials, endpoints; see fsspec's and the backend's docs).
        deadline_s: Bound on building the source as a whole, seconds (the shard
            list and every index, retries included); None: no bound.
        max_pixels: The largest image the feeder will decode: an image member
            larger than such an image could be is refused before it is read.
        max_field_bytes: The largest non-image member read, bytes (a mask,
            boxes, JSON): larger ones are refused before they are read, naming
            the shard, key and field.
        lazy_index: ``True``: number the samples from the shard list's
            ``nsamples`` and load each shard's index at its first read;
            ``"auto"`` (default): so for a list of more than 64 shards giving
            every count; ``False``: every index at construction (see [Web-scale
            datasets](../guides/web-scale.md)).
        index_cache: Shard indices kept in memory with ``lazy_index``; a feeder
            with the block shuffle raises it to ``2 * shuffle_shards + 2``.

    Raises:
        FileNotFoundError: a shard (or the directory) does not exist.
        ShardFormatError: an index file is malformed, a shard without an index is
            not a whole tar, a shard's sample count differs from the shard list's,
            or a remote shard list names local files (naming the file).
        RemoteError: a remote shard, index or list could not be read, or did
            not arrive within ``deadline_s`` (naming the URL).
        ValueError: pairs without the ``label`` field (``label=None`` for
            unlabeled data), no image field, ``fields`` naming a field no sample
            has or an image field, or two members mapping to one field name.
    """

    def __init__(self, spec: Any, *, label: str | None = "cls",
                 image_exts: Sequence[str] = IMAGE_EXTS, fields: Any = "auto", cache_dir: Any = None,
                 cache_bytes: int | None = None, retries: int = 5, backoff_s: float = 0.2,
                 downloads: int = 2, storage_options: dict | None = None,
                 deadline_s: float | None = DEFAULT_DEADLINE_S, max_pixels: int = DEFAULT_MAX_PIXELS,
                 max_field_bytes: int = DEFAULT_MAX_FIELD_BYTES, lazy_index: bool | str = "auto",
                 index_cache: int = DEFAULT_INDEX_CACHE) -> None:
        _check_options(deadline_s, max_pixels, max_field_bytes, lazy_index, index_cache)
        exts = name_tuple(image_exts, "TarShards: image_exts")
        self.max_image_bytes = 4 * max_pixels + (1 << 20)
        self.max_field_bytes = max_field_bytes
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        # No collection from the list's parsing to the shard objects made from it
        # (see storage.local.no_collection; a collection between the two would walk them all).
        with no_collection():
            names, self.classes, facts = resolve(spec, storage_options, deadline)
            if not names:
                raise FileNotFoundError(f"TarShards: {spec!r} names no shard")
            self.label = None if label is None else label.lower().lstrip(".")
            self.image_exts = tuple(e.lower().lstrip(".") for e in exts)
            self._reader = MemberReader(self.image_exts, self.label, self.max_image_bytes,
                                        max_field_bytes)
            self._remote_options = (cache_dir, cache_bytes, retries, backoff_s, downloads,
                                    storage_options)
            self._open_shards(names)
        shards = self._shards
        self.warnings: list[str] = []
        self._warn_lock = threading.Lock()
        note_facts(shards, facts)
        listed = [facts.get(shard.name, {}).get("nsamples") for shard in shards]
        self._use(self._members_for(lazy_index, listed, index_cache, deadline, deadline_s))
        counts = self._members.counts
        # The image sizes a shard list of an earlier feeder-pack gives, for
        # Feeder(group_by_aspect_ratio=...): only when every shard has them
        # (feeder-pack now writes them in each shard's index: image_sizes()).
        sizes = [facts.get(shard.name, {}).get("image_sizes") for shard in shards]
        self._image_info = ImageSizes(np.concatenate(sizes) if sizes and all(
            v is not None and len(v) == c for v, c in zip(sizes, counts)) else None)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64).tolist()
        self._check_fields(fields, *self._members.pop_checked())

    def _members_for(self, lazy_index: bool | str, listed: list[int | None], index_cache: int,
                     deadline: float | None, deadline_s: float | None) -> MemberTable:
        """The member table, lazy or loaded now as ``lazy_index`` and the shard
        list's counts (``listed``) decide."""
        complete = all(c is not None for c in listed)
        if lazy_index is True and not complete:
            missing = next(shard.name for shard, c in zip(self._shards, listed) if c is None)
            raise ValueError(f"TarShards: lazy_index=True numbers the samples from the shard "
                             f"list's nsamples, but {missing} has none (give a shard list that "
                             f"feeder-pack wrote, or lazy_index=False)")
        if lazy_index is True or (lazy_index == "auto" and complete
                                  and len(self._shards) > LAZY_INDEX_SHARDS):
            self.index_cache = index_cache
            return LazyMembers(self, listed, index_cache, deadline)  # type: ignore[arg-type]
        return LoadedMembers(self._shards, listed, self._warn, deadline, deadline_s, self._store,
                             self.image_exts, self.label)

    def _use(self, members: MemberTable) -> None:
        """Read through ``members``: its columns become this source's."""
        self._members = members
        self._lazy_counts = members.lazy_counts
        if isinstance(members, LazyMembers):
            self._table = members.table
        self._indices, self._image_member, self._label_member, self._offsets, self._sizes = (
            members.columns())

    def _check_fields(self, fields: Any, checked_shards: list[int], entries: list[tuple]) -> None:
        """Decide what ``read`` gives (:attr:`plan`) from the members of the shards
        checked (see :func:`~feeder.storage.tarread.plan_fields`)."""
        where = (self._where() if self._lazy_counts is None
                 else f"{self._shards[checked_shards[0]].name} (the first shard; the others are "
                      f"indexed when read)")
        #: ``{extension: (field name, format)}`` of the members a dict sample
        #: holds besides its image; None when ``read`` gives pairs.
        self.plan: dict[str, tuple[str, str]] | None = plan_fields(
            fields, entries, self._starts[-1], where, self._where(), self.image_exts, self.label)
        self._required = self.plan is not None and not isinstance(fields, str)

    def _warn(self, msg: str) -> None:
        with self._warn_lock:
            self.warnings.append(msg)
        log.warning("%s", msg)

    def _index_entry(self, s: int, expected: int, deadline: float | None = None) -> tuple:
        """Shard ``s``'s entry, its index loaded now (lazy indexing: the
        :class:`~feeder.storage.index.IndexTable` calls it)."""
        return lazy_entry(self._shards[s], expected, self._warn, deadline, self.image_exts,
                          self.label)

    def _want_copy(self, s: int) -> None:
        shard = self._shards[s]
        if shard.remote and self._store is not None:
            self._store.want(shard)

    def will_read(self, indices: Sequence[int]) -> None:
        """A hint that samples ``indices`` are read soon (the feeder's sampler gives
        each batch as it dispatches it): with lazy indexing, their shards' indices
        are loaded in the background. Never blocks."""
        if self._lazy_counts is None:
            return
        starts = self._starts
        self._members.will_read({bisect.bisect_right(starts, i) - 1 for i in indices})

    def will_read_shards(self, shards: Sequence[int]) -> None:
        """A hint that these shards are read next (a window of the block shuffle):
        their indices are loaded and remote shards' copies into the cache started,
        in the background. Never blocks."""
        if self._lazy_counts is not None or self._store is not None:
            self._members.ahead(shards, self._want_copy)

    def reserve_indices(self, count: int) -> None:
        """Keep at least ``count`` shard indices in memory (lazy indexing): the
        block shuffle reads ``shuffle_shards`` shards at once and prefetches as
        many. Safe to repeat; never lowers the bound."""
        raised = self._members.reserve(count)
        if raised is not None:
            self.index_cache = raised

    @property
    def indices_loaded(self) -> int:
        """Shard indices loaded so far (all of them without lazy indexing)."""
        return self._members.loaded

    def _open_shards(self, names: list[str]) -> None:
        """The per-process access to each shard: descriptors, remote store."""
        self.files, self._store, self._shards = open_shards(names, self._remote_options)
        # A dropped source releases its descriptors and stops its copies: a job
        # that builds sources in a loop must not run out of file descriptors.
        self._finalizer = weakref.finalize(self, release, self.files, self._store)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for a spawned process (a DataLoader worker): descriptors, locks
        # and copier threads are per process; the indices travel as they are.
        state = self.__dict__.copy()
        if self._lazy_counts is not None:
            # The loaded indices stay here: the other process loads its own.
            for name in ("_members", "_table", "_indices", "_image_member", "_label_member",
                         "_offsets", "_sizes"):
                del state[name]
        del state["_warn_lock"]
        state["_shards"] = [shard.name for shard in self._shards]
        state["_shard_facts"] = [s.state() for s in self._shards]
        del state["files"], state["_store"], state["_finalizer"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        names = state.pop("_shards")
        facts = state.pop("_shard_facts", None) or [None] * len(names)
        self.__dict__.update(state)
        self._warn_lock = threading.Lock()
        if getattr(self, "_lazy_counts", None) is not None:
            self._use(LazyMembers(self, self._lazy_counts, self.index_cache, first=False))
        self._open_shards(names)
        for shard, fact in zip(self._shards, facts):
            if fact is not None:
                shard.restore(fact)

    def _where(self) -> str:
        first = self._shards[0].name
        return first if len(self._shards) == 1 else f"{len(self._shards)} shards ({first}, ...)"

    # -- the source interface ------------------------------------------------
    def __len__(self) -> int:
        return self._starts[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard number, sample number within that shard)`` of sample ``index``."""
        if not 0 <= index < self._starts[-1]:
            raise IndexError(f"TarShards: sample {index} out of range [0, {self._starts[-1]})")
        s = bisect.bisect_right(self._starts, index) - 1
        return s, index - self._starts[s]

    def describe(self, index: int) -> str:
        """``shard:key`` of sample ``index`` (``/data/train-000003.tar:000123``)."""
        s, j = self.locate(index)
        return f"{self._shards[s].name}:{self._indices[s].keys[j]}"

    def key(self, index: int) -> str:
        s, j = self.locate(index)
        return self._indices[s].keys[j]

    @property
    def reads_may_block(self) -> bool:
        """True when a shard is remote or on a network or FUSE file system: feeder
        then reads in threads of their own (``read_threads="auto"``); local shards
        are read by the decode threads, which costs less CPU per sample."""
        cached = getattr(self, "_reads_may_block", None)
        if cached is None:
            cached = self._reads_may_block = reads_may_block(self._shards)
        return cached

    @property
    def window_reads_may_block(self) -> bool:
        """:attr:`reads_may_block` under the block shuffle (``shuffle_shards``): the
        window's remote shards are copied into the cache ahead of their reads
        (:meth:`will_read_shards`), so once a window is warm every read is a local
        ``pread``; True for shards on a network or FUSE file system, and for
        remote shards that are not all known to fit the cache (no cache, a
        shard larger than its bound, a size not known before the first read)."""
        return self.reads_may_block and window_reads_may_block(self._shards, self._store)

    @property
    def shards(self) -> list[str]:
        """The shard paths and URLs, in sample order."""
        return [s.name for s in self._shards]

    def image_sizes(self) -> np.ndarray | None:
        """int64 ``[len, 2]``: each sample's image (height, width) as stored (before
        any EXIF orientation: see :meth:`oriented_image_sizes`), -1 where unknown, as
        the shards' indices give them (``feeder-pack`` stores them there; a shard
        list of an earlier version holds them itself, and is read as well); None
        when a shard's index has none (shards packed by another tool). Used by
        ``Feeder(group_by_aspect_ratio=...)`` instead of reading every header.

        With lazy indexing this reads every shard's index once (grouping needs
        every sample's size: 16 bytes a sample), in parallel, not through the
        index LRU; the sizes are kept."""
        return self._image_info.stored(self._all_indices)

    def oriented_image_sizes(self) -> np.ndarray | None:
        """:meth:`image_sizes` after each image's EXIF orientation (height and width
        swapped for orientations 5 to 8): the sizes ``Feeder(exif_orientation=True)``
        decodes, which its aspect-ratio grouping uses. None when a shard's index
        does not record the transposed images (shards packed by another tool or an
        earlier version: the grouping then reads the headers)."""
        return self._image_info.oriented(self._all_indices)

    def _all_indices(self) -> list[Any]:
        """Every shard's index (with lazy indexing, read once more, not through the LRU)."""
        return self._members.all_indices(self._shards, self._warn, self._store)

    def shard_ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` sample indices of each shard, in order."""
        return [(self._starts[i], self._starts[i + 1]) for i in range(len(self._shards))]

    def _read_members(self, s: int, j: int, members: list[int]) -> list[bytes]:
        shard = self._shards[s]
        ix = self._indices[s]
        if not members:
            return []
        return self._reader.read(shard, ix, j, members, self._offsets[s], self._sizes[s])

    def read(self, index: int) -> tuple[bytes, int] | dict[str, Any]:
        """Sample ``index``: its image bytes and label, or a dict of its fields
        (see ``fields``).

        Raises:
            ShardFormatError: the sample has no image field, no label field (pairs,
                when ``label`` is set), a label that is not an integer, a field
                that cannot be decoded (a bad ``.npy``, ``.json``, ``.txt`` or
                ``.cls``) or lacks a field ``fields`` names, or the shard is
                truncated; the message names the shard and the key, and the
                field (also as the error's ``field``).
            OSError: the shard cannot be read (remote: after the retries).
        """
        s, j = self.locate(index)
        ix = self._indices[s]
        img = self._image_member[s][j]
        if img < 0:
            raise ShardFormatError(
                f"{self._shards[s].name}:{ix.keys[j]}: no image field (one of "
                f"{', '.join(self.image_exts)}); the sample has: "
                f"{', '.join(ix.exts[m] for m in ix.members(j)) or 'nothing'}")
        if self.plan is not None:
            return self._read_dict(s, j, img, self.plan)
        if self.label is None:
            return self._read_members(s, j, [img])[0], -1
        lab = self._label_member[s][j]
        if lab < 0:
            # A shard cut short loses the fields after the cut: say that, not "no label".
            self._read_members(s, j, [img])
            raise ShardFormatError(
                f"{self._shards[s].name}:{ix.keys[j]}: no .{self.label} field (its label); the "
                f"sample has: {', '.join(ix.exts[m] for m in ix.members(j))}")
        data, raw = self._read_members(s, j, [img, lab])
        return data, self._reader.parse_label(raw, f"{self._shards[s].name}:{ix.keys[j]}")

    def _read_dict(self, s: int, j: int, img: int, plan: dict[str, tuple[str, str]]) -> dict[str, Any]:
        return self._reader.read_dict(self._shards[s], self._indices[s], j, img, plan,
                                      self._required, self._offsets[s], self._sizes[s])

    def read_fields(self, index: int) -> dict[str, bytes]:
        """Every field of sample ``index``, raw: ``{extension: bytes}``."""
        s, j = self.locate(index)
        ix = self._indices[s]
        members = list(ix.members(j))
        return dict(zip((ix.exts[m] for m in members), self._read_members(s, j, members)))

    def read_record(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as a dict of every member, named and decoded as the
        module docstring says, whatever ``fields`` is (what ``fields="auto"``
        gives for shards holding more than images and labels)."""
        s, j = self.locate(index)
        ix = self._indices[s]
        img = self._image_member[s][j]
        if img < 0:
            raise ShardFormatError(f"{self._shards[s].name}:{ix.keys[j]}: no image field (one of "
                                   f"{', '.join(self.image_exts)})")
        return self._read_dict(s, j, img, self._reader.record_plan(ix, j))

    # -- lifecycle -----------------------------------------------------------
    def wait_downloads(self, timeout: float | None = None) -> bool:
        """Wait until the background copies of remote shards into the cache are done;
        False if ``timeout`` (seconds) ran out first. Local shards: True at once."""
        return True if self._store is None else self._store.wait(timeout)

    def close(self) -> None:
        """Stop background downloads, close open files and remove private copies.
        Reads after it reopen what they need. Safe to repeat; also done when the
        source is garbage-collected."""
        release(self.files, self._store, True)

    def __enter__(self) -> "TarShards":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TarShards({self._where()}, {len(self)} samples)"
