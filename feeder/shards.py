"""Packed tar shards (the WebDataset layout) as a feeder source.

A dataset of many small files costs a file open and a seek per sample; packed
into tar shards of tens of MB, it is a few large files read at known offsets.
:class:`TarShards` reads shards made by ``feeder-pack`` or by any tool that
writes the WebDataset layout (``key.jpg``, ``key.cls``, ... in ``name-000000.tar``),
from local disk or from ``http(s)://`` (and any fsspec URL: ``s3://``, ``gs://``...
once that backend is installed), in any order, by sample index: the feeder's
global shuffle and exactly-once epochs work as with files.

Fields: the image is the sample's first member among ``image_exts`` (``jpg``,
``jpeg``, ``png``, ``webp``...), the label the ASCII integer in its ``cls``
member. Shards holding nothing else give the classic ``(bytes, label)`` pairs;
shards holding more (a mask, boxes, metadata) give dict samples (see
:mod:`feeder.work.sample`), each member a field named and decoded by its extension
(:func:`field_of`):

==================================  ==========================  ===============================
member (``key.<ext>``)              field                       value
==================================  ==========================  ===============================
``jpg``, ``png``... (image_exts)    ``"image"``                 bytes (the first present wins)
``cls`` (the ``label`` field)       ``"label"``                 int
``seg.png``, ``mask.png``           ``"mask"``                  bytes (a PNG of class ids)
``<name>.npy``                      ``name`` (``npy`` alone)    ``np.load``, no pickles
``<name>.json``                     ``name`` (``json`` alone)   ``json.loads``
``<name>.txt``                      ``name`` (``txt`` alone)    str (UTF-8)
``<name>.cls``                      ``name``                    int
anything else (``<name>.bin``...)   its extension (``name``     bytes
                                    for ``.bin``)
==================================  ==========================  ===============================

so ``boxes.npy`` and ``box_labels.npy`` are the ``"boxes"`` and ``"box_labels"``
of a detection sample, as ``feeder-pack`` writes them.
"""

from __future__ import annotations

import array
import bisect
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .storage.fields import FIELD_NAMES, json_value, npy_array, field_of, make_plan
from .storage.index import Column, IndexTable, LocalShard, load_indices
from .sample import DEFAULT_MAX_PIXELS
from .storage.shardlist import is_url, expand_braces, resolve
from .storage.local import FilePool, no_collection, on_network_storage
from .storage.tar import COMPRESSED, IMAGE_EXTS, ShardFormatError, ShardIndex

__all__ = ["FIELD_NAMES", "IMAGE_EXTS", "ShardFormatError", "TarShards", "expand_braces", "field_of"]

log = logging.getLogger(__name__)

# Image fields, in the order a sample's image is looked for.

# A sample's members are read with one call (one request, remotely) when the
# gaps between them (tar headers, fields not asked for) add at most this much.
_SPAN_SLACK = 64 << 10

# TarShards(deadline_s=): building a remote source as a whole, seconds.
DEFAULT_DEADLINE_S = 60.0
# TarShards(max_field_bytes=): the largest non-image member read, bytes.
DEFAULT_MAX_FIELD_BYTES = 256 << 20

def _release(files: FilePool, store: Any, wait: bool = False) -> None:
    if store is not None:
        store.close(wait)
    files.close()


# TarShards(lazy_index="auto"): a shard list naming more shards than this, with
# every shard's sample count, is indexed lazily (no request per shard up front).
LAZY_INDEX_SHARDS = 64
# TarShards(index_cache=): shard indices kept in memory with lazy indexing. An
# index of a shard of 10^4 two-member samples takes about 4 MB (measured with
# tracemalloc: keys and member names 3.6 MB, the arrays 0.3 MB).
DEFAULT_INDEX_CACHE = 16


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
        image_exts: Fields that hold the image, the first present wins.
        fields: What ``read`` returns. ``"auto"``: ``(bytes, label)`` pairs when
            every member of every sample is an image or the label, else dicts
            with every member as a field (named and decoded as the module
            docstring says). None: always pairs (other members are not read).
            A list of extensions: dicts of the image and those members (each
            sample must have them all). A mapping ``{extension: field name}``:
            the same, naming the fields; the name ``"*"`` spreads a JSON
            object's keys into the sample (``{"json": "*"}`` for a foreign
            detection set's ``{"boxes": ..., "box_labels": ...}``).
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
        deadline_s: Bound on building the source as a whole, seconds: the
            shard list and every index (or, without one, the copy of the shard
            to index it) must arrive within it, retries included, or the error
            names the URLs that had not answered. None: no bound.
        max_pixels: The largest image the feeder will decode (the
            ``Feeder(max_pixels=)`` default): an image member larger than an
            uncompressed image of that many pixels could be (4 bytes a pixel,
            plus 1 MiB) is refused before it is read, naming the shard, key and
            field.
        max_field_bytes: The largest non-image member read, bytes (a mask,
            boxes, JSON): larger ones are refused before they are read, naming
            the shard, key and field.
        lazy_index: ``True``: number the samples from the shard list's
            ``nsamples`` without touching the shards, and load a shard's index
            at its first read (ahead of the order, in the background), keeping
            ``index_cache`` of them; needs a shard list giving every shard's
            ``nsamples``. The fields (``fields="auto"``) and the image and label
            checks are then decided from the first non-empty shard, and a
            shard whose sample count differs from the list fails its reads
            (naming it). ``"auto"`` (default): lazy for a shard list of more
            than 64 shards that gives every count. ``False``: every index at
            construction, as for shards without a list.
        index_cache: Shard indices kept in memory with ``lazy_index`` (about
            4 MB each for 10^4 two-member samples). A feeder with the block
            shuffle raises it to two windows and two shards
            (``2 * shuffle_shards + 2``) if it is lower, so that a window's
            reads never reload an index.

    Raises:
        FileNotFoundError: a shard (or the directory) does not exist.
        ShardFormatError: an index file is malformed (naming the file and line),
            a shard without an index is not a whole tar (empty, not a tar,
            cut short after a member), a shard's sample count differs from the
            shard list's, or a remote shard list names local files.
        RemoteError: a remote shard, index or list could not be read, or did
            not arrive within ``deadline_s`` (naming the URL).
        ValueError: no sample has the ``label`` field when the samples are pairs
            (give ``label=None`` for unlabeled data), no sample has an image
            field, ``fields`` names a field no sample has or an image field, or
            two members map to one field name.
    """

    def __init__(self, spec: Any, *, label: str | None = "cls",
                 image_exts: Sequence[str] = IMAGE_EXTS, fields: Any = "auto", cache_dir: Any = None,
                 cache_bytes: int | None = None, retries: int = 5, backoff_s: float = 0.2,
                 downloads: int = 2, storage_options: dict | None = None,
                 deadline_s: float | None = DEFAULT_DEADLINE_S, max_pixels: int = DEFAULT_MAX_PIXELS,
                 max_field_bytes: int = DEFAULT_MAX_FIELD_BYTES, lazy_index: bool | str = "auto",
                 index_cache: int = DEFAULT_INDEX_CACHE) -> None:
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
            self.image_exts = tuple(e.lower().lstrip(".") for e in image_exts)
            for name in names:
                if name.lower().endswith(COMPRESSED):
                    raise ValueError(f"TarShards: {name} is compressed: a compressed tar cannot be "
                                     f"read by offset; decompress it (the images inside are "
                                     f"compressed already, so little space is lost)")
            self._remote_options = (cache_dir, cache_bytes, retries, backoff_s, downloads,
                                    storage_options)
            self._open_shards(names)
        shards = self._shards
        self.warnings: list[str] = []
        self._warn_lock = threading.Lock()
        warn = self._warn

        for shard in shards:
            fact = facts.get(shard.name, {})
            if shard.remote:
                shard.sha256 = fact.get("sha256")
                shard.list_size = fact.get("filesize")
        counts = [facts.get(shard.name, {}).get("nsamples") for shard in shards]
        complete = all(c is not None for c in counts)
        if lazy_index is True and not complete:
            missing = next(shard.name for shard, c in zip(shards, counts) if c is None)
            raise ValueError(f"TarShards: lazy_index=True numbers the samples from the shard "
                             f"list's nsamples, but {missing} has none (give a shard list that "
                             f"feeder-pack wrote, or lazy_index=False)")
        self._lazy_counts: list[int] | None = None
        if lazy_index is True or (lazy_index == "auto" and complete
                                  and len(shards) > LAZY_INDEX_SHARDS):
            self._lazy_counts = counts
            self.index_cache = index_cache
            self._make_table()
            # The fields and the checks below come from the first non-empty shard.
            first = next((k for k, c in enumerate(counts) if c), 0)
            sample_shards = [first]
            # One request; its parse makes 10^5 objects, whose collections would
            # walk the list's 10^6 again.
            with no_collection():
                entries = [self._table.put(first, self._index_entry(first, counts[first],
                                                                    deadline))]
        else:
            indices = self._load_indices(shards, warn, deadline, deadline_s)
            for shard, ix in zip(shards, indices):
                expected = facts.get(shard.name, {}).get("nsamples")
                if expected is not None and expected != len(ix):
                    raise ShardFormatError(f"{shard.name}: holds {len(ix)} samples but the shard "
                                           f"list says {expected}: the shard or the list is "
                                           f"damaged or out of date (re-pack, or fix the list)")
            counts = [len(ix) for ix in indices]
            entries = [self._entry(ix) for ix in indices]
            sample_shards = list(range(len(shards)))
            self._indices: Any = [e[0] for e in entries]
            # Plain lists (not numpy scalars): a read looks these up at Python speed.
            self._image_member: Any = [e[1] for e in entries]
            self._label_member: Any = [e[2] for e in entries]
            self._offsets: Any = [e[3] for e in entries]
            self._sizes: Any = [e[4] for e in entries]
        # The image sizes a shard list of an earlier feeder-pack gives, for
        # Feeder(group_by_aspect_ratio=...): only when every shard has them
        # (feeder-pack now writes them in each shard's index: image_sizes()).
        listed = [facts.get(shard.name, {}).get("image_sizes") for shard in shards]
        self._image_sizes = (np.concatenate(listed) if listed and all(
            v is not None and len(v) == c for v, c in zip(listed, counts)) else None)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64).tolist()
        exts_seen: set[str] = set()
        for e in entries:
            exts_seen.update(e[0].exts)
        n = self._starts[-1]
        where = (self._where() if self._lazy_counts is None
                 else f"{self._shards[sample_shards[0]].name} (the first shard; the others are "
                      f"indexed when read)")
        found = ", ".join(sorted(exts_seen)) or "none"
        if n and not any(m >= 0 for e in entries for m in e[1]):
            raise ValueError(f"TarShards: none of the {n} samples in {where} has an image "
                             f"field ({', '.join(self.image_exts)}); fields found: {found}; "
                             f"give image_exts=")
        #: ``{extension: (field name, format)}`` of the members a dict sample
        #: holds besides its image; None when ``read`` gives pairs.
        self.plan: dict[str, tuple[str, str]] | None = make_plan(
            fields, exts_seen, found, self.image_exts, self.label, self._where())
        self._required = self.plan is not None and not isinstance(fields, str)
        if (n and self.plan is None and self.label is not None
                and not any(m >= 0 for e in entries for m in e[2])):
            raise ValueError(f"TarShards: none of the {n} samples in {where} has a "
                             f".{self.label} field holding its label; fields found: {found}; "
                             f"give label=None for unlabeled data (labels -1), or label='<ext>' "
                             f"naming the field that holds the class index")

    def _warn(self, msg: str) -> None:
        with self._warn_lock:
            self.warnings.append(msg)
        log.warning("%s", msg)

    def _entry(self, ix: ShardIndex) -> tuple:
        """What a read needs of one shard: its index, each sample's image and
        label member, and the members' offsets and sizes, as lists."""
        img, lab = self._pick_members(ix)
        return ix, img.tolist(), lab.tolist(), ix.offsets.tolist(), ix.sizes.tolist()

    @staticmethod
    def _compact_entry(entry: tuple) -> tuple:
        # Lazily indexed shards keep their per-member numbers as array('q'): 8
        # bytes each instead of a list's 36 (indexing still gives Python ints),
        # so that the index LRU costs about 4 MB per 10^4-sample shard, not 5.6.
        ix, *columns = entry
        return (ix, *(array.array("q", c) for c in columns))

    def _index_entry(self, s: int, expected: int, deadline: float | None = None) -> tuple:
        """Shard ``s``'s entry, its index loaded now (lazy indexing), its sample
        count checked against the shard list's (the numbering rests on it)."""
        shard = self._shards[s]
        ix = shard.load_index(self._warn, deadline)
        if len(ix) != expected:
            raise ShardFormatError(f"{shard.name}: holds {len(ix)} samples but the shard list says "
                                   f"{expected}: the shard or the list is damaged or out of date "
                                   f"(re-pack, or fix the list)")
        return self._compact_entry(self._entry(ix))

    def _make_table(self) -> None:
        table = IndexTable(self, self._lazy_counts, self.index_cache)
        self._table = table
        self._indices, self._image_member, self._label_member, self._offsets, self._sizes = (
            Column(table, k) for k in range(5))

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
        starts, table = self._starts, self._table
        shards = {bisect.bisect_right(starts, i) - 1 for i in indices}
        todo = [s for s in shards if not table.cached(s)]
        if todo:
            table.ahead(todo)

    def will_read_shards(self, shards: Sequence[int]) -> None:
        """A hint that these shards are read next (a window of the block shuffle):
        their indices are loaded and remote shards' copies into the cache started,
        in the background. Never blocks."""
        if self._lazy_counts is not None:
            self._table.ahead(shards, copy=True)
        elif self._store is not None:
            for s in shards:
                self._want_copy(s)

    def reserve_indices(self, count: int) -> None:
        """Keep at least ``count`` shard indices in memory (lazy indexing): the
        block shuffle reads ``shuffle_shards`` shards at once and prefetches as
        many. Safe to repeat; never lowers the bound."""
        if self._lazy_counts is not None and count > self._table.capacity:
            self.index_cache = self._table.capacity = count

    @property
    def indices_loaded(self) -> int:
        """Shard indices loaded so far (all of them without lazy indexing)."""
        return len(self._shards) if self._lazy_counts is None else self._table.loads

    def _load_indices(self, shards: list[Any], warn: Any, deadline: float | None,
                      deadline_s: float | None) -> list[ShardIndex]:
        return load_indices(shards, warn, deadline, deadline_s, self._store)

    def _open_shards(self, names: list[str]) -> None:
        """The per-process access to each shard: descriptors, remote store."""
        self.files = FilePool()
        self._store = None
        shards: list[Any] = []
        for name in names:
            if is_url(name):
                if self._store is None:
                    from .storage.remote import RemoteStore  # noqa: PLC0415 - fsspec only when remote

                    self._store = RemoteStore(self.files, *self._remote_options)
                shards.append(self._store.shard(name))
            else:
                shards.append(LocalShard(name, self.files))
        self._shards = shards
        # A dropped source releases its descriptors and stops its copies: a job
        # that builds sources in a loop must not run out of file descriptors.
        self._finalizer = weakref.finalize(self, _release, self.files, self._store)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for a spawned process (a DataLoader worker): descriptors, locks
        # and copier threads are per process; the indices travel as they are.
        state = self.__dict__.copy()
        if self._lazy_counts is not None:
            # The loaded indices stay here: the other process loads its own.
            for name in ("_table", "_indices", "_image_member", "_label_member", "_offsets",
                         "_sizes"):
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
            self._make_table()
        self._open_shards(names)
        for shard, fact in zip(self._shards, facts):
            if fact is not None:
                shard.restore(fact)

    def _where(self) -> str:
        first = self._shards[0].name
        return first if len(self._shards) == 1 else f"{len(self._shards)} shards ({first}, ...)"

    def _pick_members(self, ix: ShardIndex) -> tuple[np.ndarray, np.ndarray]:
        """Per sample, the member holding its image and its label (-1: none)."""
        img = np.full(len(ix), -1, np.int64)
        lab = np.full(len(ix), -1, np.int64)
        rank = {e: r for r, e in enumerate(self.image_exts)}
        for s in range(len(ix)):
            best = len(rank)
            for m in ix.members(s):
                e = ix.exts[m]
                r = rank.get(e)
                if r is not None and r < best:
                    best, img[s] = r, m
                elif e == self.label:
                    lab[s] = m
        return img, lab

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
            shards = self._shards
            cached = any(s.remote for s in shards) or on_network_storage(
                [os.path.dirname(os.path.abspath(s.name)) for s in shards])
            self._reads_may_block = cached
        return cached

    @property
    def window_reads_may_block(self) -> bool:
        """:attr:`reads_may_block` under the block shuffle (``shuffle_shards``): the
        window's remote shards are copied into the cache ahead of their reads
        (:meth:`will_read_shards`), so once a window is warm every read is a local
        ``pread``; True for shards on a network or FUSE file system, and for
        remote shards that are not all known to fit the cache (no cache, a
        shard larger than its bound, a size not known before the first read)."""
        if not self.reads_may_block:
            return False
        shards = self._shards
        store = self._store
        return (any(s.remote for s in shards) and (store is None or not store.copies_all(shards))) \
            or on_network_storage([os.path.dirname(os.path.abspath(s.name)) for s in shards if not s.remote])

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
        sizes = getattr(self, "_image_sizes", None)
        if sizes is None and not getattr(self, "_image_sizes_read", False):
            self._image_sizes_read = True  # None from the indices too: not asked again
            sizes = self._image_sizes = self._indexed_image_sizes()
        return None if sizes is None else sizes.copy()

    def oriented_image_sizes(self) -> np.ndarray | None:
        """:meth:`image_sizes` after each image's EXIF orientation (height and width
        swapped for orientations 5 to 8): the sizes ``Feeder(exif_orientation=True)``
        decodes, which its aspect-ratio grouping uses. None when a shard's index
        does not record the transposed images (shards packed by another tool or an
        earlier version: the grouping then reads the headers)."""
        sizes = self.image_sizes()
        if sizes is None:
            return None
        flags = getattr(self, "_transposed", None)
        if flags is None and not getattr(self, "_transposed_read", False):
            self._transposed_read = True
            flags = self._transposed = self._indexed_transposed()
        if flags is None:
            return None
        sizes[flags] = sizes[flags][:, ::-1]
        return sizes

    def _indexed_transposed(self) -> np.ndarray | None:
        """Every sample's EXIF-transposed flag from its shard's index, or None if one
        lacks them."""
        parts = [ix.image_transposed for ix in self._all_indices()]
        if not parts or any(p is None for p in parts):
            return None
        return np.concatenate(parts)

    def _all_indices(self) -> list[Any]:
        """Every shard's index (with lazy indexing, read once more, not through the LRU)."""
        if self._lazy_counts is None:
            return [self._indices[s] for s in range(len(self._shards))]
        indices = self._load_indices(self._shards, self._warn, None, None)
        for shard, ix, expected in zip(self._shards, indices, self._lazy_counts):
            if len(ix) != expected:
                raise ShardFormatError(f"{shard.name}: holds {len(ix)} samples but the shard "
                                       f"list says {expected}: the shard or the list is "
                                       f"damaged or out of date (re-pack, or fix the list)")
        return indices

    def _indexed_image_sizes(self) -> np.ndarray | None:
        """Every sample's image size from its shard's index, or None if one lacks them."""
        indices = self._all_indices()
        # The transposed flags come with the same indices: read them now, once.
        flags = [ix.image_transposed for ix in indices]
        self._transposed_read = True
        self._transposed = (np.concatenate(flags) if flags and all(f is not None for f in flags)
                            else None)
        parts = [ix.image_sizes for ix in indices]
        if not parts or any(p is None for p in parts):
            return None
        return np.concatenate(parts)

    def shard_ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` sample indices of each shard, in order."""
        return [(self._starts[i], self._starts[i + 1]) for i in range(len(self._shards))]

    def _read_members(self, s: int, j: int, members: list[int]) -> list[bytes]:
        shard = self._shards[s]
        ix = self._indices[s]
        if not members:
            return []
        all_offs, all_sizes = self._offsets[s], self._sizes[s]
        offs = [all_offs[m] for m in members]
        sizes = [all_sizes[m] for m in members]
        for m, n in zip(members, sizes):
            # Sizes come from tar headers or an index: bound them before reading.
            if n > self.max_field_bytes:
                ext = ix.exts[m]
                limit, opt = ((self.max_image_bytes, "max_pixels") if ext in self.image_exts
                              else (self.max_field_bytes, "max_field_bytes"))
                if n > limit:
                    name = "image" if ext in self.image_exts else field_of(ext, self.label)[0]
                    raise self._field_error(s, j, ext, name, f"holds {n} bytes, more than the "
                                            f"{limit} this source reads (TarShards({opt}=...))")
        lo = min(offs)
        hi = max(o + n for o, n in zip(offs, sizes))
        if hi - lo <= sum(sizes) + _SPAN_SLACK:
            blob = shard.pread(hi - lo, lo)
            pieces = [blob[o - lo:o - lo + n] for o, n in zip(offs, sizes)]
        else:
            pieces = [shard.pread(n, o) for o, n in zip(offs, sizes)]
        for m, o, n, piece in zip(members, offs, sizes, pieces):
            if len(piece) != n:
                raise ShardFormatError(
                    f"{shard.name}:{ix.keys[j]}: truncated shard: member {ix.names[m]!r} needs "
                    f"bytes [{o}, {o + n}) but the shard ends before byte {o + n}")
        return pieces

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
        return data, self._parse_label(raw, s, j)

    def _read_dict(self, s: int, j: int, img: int, plan: dict[str, tuple[str, str]]) -> dict[str, Any]:
        ix = self._indices[s]
        members = [img]
        exts = []
        for m in ix.members(j):
            e = ix.exts[m]
            if e in plan and e not in exts:
                members.append(m)
                exts.append(e)
        pieces = self._read_members(s, j, members)
        if self._required and len(exts) < len(plan):
            missing = next(e for e in plan if e not in exts)
            raise self._field_error(s, j, missing, plan[missing][0],
                                    f"missing (fields= asks for it); the sample has: "
                                    f"{', '.join(ix.exts[m] for m in ix.members(j))}")
        out: dict[str, Any] = {"image": pieces[0]}
        for ext, raw in zip(exts, pieces[1:]):
            name, fmt = plan[ext]
            value = self._decode_field(raw, s, j, ext, name, fmt)
            if name != "*":
                out[name] = value
                continue
            if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
                raise self._field_error(s, j, ext, ext, f"is {type(value).__name__}, not a JSON "
                                        f"object, so its keys cannot become fields")
            for k, v in value.items():
                if k in out or any(plan[e][0] == k for e in exts):
                    raise self._field_error(s, j, ext, k, "is both a key of this JSON object and "
                                            "another field of the sample")
                out[k] = v
        return out

    def _field_error(self, s: int, j: int, ext: str, name: str, what: str) -> ShardFormatError:
        exc = ShardFormatError(f"{self._shards[s].name}:{self._indices[s].keys[j]}: field {name!r} "
                               f"(.{ext}) {what}")
        exc.field = name  # type: ignore[attr-defined]
        return exc

    def _decode_field(self, raw: bytes, s: int, j: int, ext: str, name: str, fmt: str) -> Any:
        """One member's bytes as its field's value (see :func:`field_of`)."""
        if fmt == "bytes":
            return raw
        try:
            if fmt == "cls":
                return int(raw.decode("ascii").strip())
            if fmt == "txt":
                return raw.decode("utf-8")
            if fmt == "json":
                return json_value(raw)
            return npy_array(raw)
        except (UnicodeDecodeError, ValueError, OSError, EOFError, RecursionError) as exc:
            what = {"cls": "is not an integer", "txt": "is not UTF-8 text",
                    "json": "is not JSON", "npy": "is not a .npy array"}[fmt]
            raise self._field_error(s, j, ext, name, f"{what} ({type(exc).__name__}: {exc}): "
                                    f"{raw[:40]!r}") from None

    def _parse_label(self, raw: bytes, s: int, j: int) -> int:
        try:
            return int(raw.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise ShardFormatError(
                f"{self._shards[s].name}:{self._indices[s].keys[j]}: .{self.label} field is not an "
                f"integer: {raw[:40]!r}") from None

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
        images = set(self.image_exts)
        plan = {}
        for m in ix.members(j):
            e = ix.exts[m]
            if e not in images and not (self.label is None and e == "cls"):
                plan[e] = field_of(e, self.label)
        return self._read_dict(s, j, img, plan)

    # -- lifecycle -----------------------------------------------------------
    def wait_downloads(self, timeout: float | None = None) -> bool:
        """Wait until the background copies of remote shards into the cache are done;
        False if ``timeout`` (seconds) ran out first. Local shards: True at once."""
        return True if self._store is None else self._store.wait(timeout)

    def close(self) -> None:
        """Stop background downloads, close open files and remove private copies.
        Reads after it reopen what they need. Safe to repeat; also done when the
        source is garbage-collected."""
        _release(self.files, self._store, True)

    def __enter__(self) -> "TarShards":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TarShards({self._where()}, {len(self)} samples)"
