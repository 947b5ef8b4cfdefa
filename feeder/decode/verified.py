"""Which JPEG files a feeder has already read to their end without an error,
and where their Huffman data can be entered.

With ``jpeg_verify``, a region decode entropy-decodes the whole file, because
damaged Huffman data shows only at the end of the scan. :class:`VerifiedJpegs`
remembers a fingerprint (CRC-32C and length) of every byte string that
passed, so a later decode of the same bytes stops after the crop's last row,
and keeps each file's row index (checkpoints recorded by feeder's Huffman
decoder, ``feeder/decode/_huffman.c``), so a later decode enters each row of
its crop near its first column. Both live in bounded memory: a table sized
from the source's length and a ring of ``index_bytes``; an entry lost to
either costs time, never correctness. The design and its figures:
``docs/design/verified-jpegs.md``.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref
import zlib

import numpy as np

from .extension import jpeg as _ext

# The extension's CRC-32C where the CPU has its instruction (only the
# extension's region decode consults this memory).
_crc = _ext.crc32c if _ext is not None and _ext.CRC32C_HARDWARE else zlib.crc32

__all__ = ["VerifiedJpegs"]

_RECORD = struct.Struct("<QIIH")  # fingerprint, CRC of the first half, CRC of the index, its length
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing multiplier: spreads the bits over the bucket index
WAYS = 4  # slots per bucket: 32 bytes, within one cache line


def _anonymous(size: int) -> mmap.mmap:
    """``size`` bytes of anonymous memory: the system's zero pages until written,
    a mapping of its own (its resident pages are what the kernel reports for
    it), and given back whole when freed. Shared with a forked child, which
    therefore starts a memory of its own (see :func:`_forget_in_child`)."""
    return mmap.mmap(-1, size)


# Every live memory, so that a forked child can drop what it inherited.
_LIVE: "weakref.WeakSet[VerifiedJpegs]" = weakref.WeakSet()


def _forget_in_child() -> None:
    """In a forked child (the isolated engine's worker, a DataLoader worker over
    the dataset view): each memory starts empty, as a pickled copy does. Its
    pages are shared with the parent, whose head and lock this process cannot
    follow: writing them would put two processes' records in one ring."""
    for memo in list(_LIVE):
        memo.__setstate__(memo.__getstate__())


os.register_at_fork(after_in_child=_forget_in_child)


class VerifiedJpegs:
    """A bounded, thread-safe memory of JPEG byte strings read to their end without an error.

    Args:
        slots: Table size, a power of two of at least 8 (8 bytes each).
        index_bytes: Room for indexes (0: none kept).
        files: How many distinct files will come (None: not known), which sets
            each file's share of that room (:attr:`points`).
        rewritten: Indexes grow as crops reach further down their files and are
            written again, longer (``jpeg_verify=False``): each file gets half the
            share, so that the ring also holds the copies a longer one replaced.
    """

    SLOTS = 1 << 21
    MIN_SLOTS = 64
    INDEX_BYTES = 128 << 20
    #: Checkpoints per file: at least, at most, and when the number of files is not known.
    MIN_POINTS, MAX_POINTS, UNKNOWN_POINTS = 4, 4096, 16
    POINT_BYTES = 15  # a checkpoint of a 3-component file with restart markers (13 without)
    #: A file's index takes at most one checkpoint per this many of its bytes
    #: (an index of at most 1/32 of the file): past that density the memory
    #: stops paying (see docs/design/verified-jpegs.md).
    FILE_BYTES_PER_POINT = 32 * POINT_BYTES
    INDEX_HEADER = 26

    def __init__(self, slots: int | None = None, index_bytes: int = INDEX_BYTES,
                 files: int | None = None, rewritten: bool = False) -> None:
        if files is not None and (not isinstance(files, int) or isinstance(files, bool) or files < 0):
            raise ValueError(f"files must be None or an int of at least 0, got {files!r}")
        if slots is None:
            slots = self.slots_for(files)
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 2 * WAYS or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two of at least {2 * WAYS}, got {slots}")
        if not isinstance(index_bytes, int) or isinstance(index_bytes, bool) or index_bytes < 0:
            raise ValueError(f"index_bytes must be an int of at least 0, got {index_bytes!r}")
        self.slots = slots
        self.index_bytes = index_bytes
        self.files = files
        self.rewritten = bool(rewritten)
        #: The most checkpoints a file's index may have: three quarters of the
        #: ring shared among ``files`` (half that when indexes are rewritten),
        #: within MIN_POINTS..MAX_POINTS; 0 without a ring.
        self.points = self.points_for(index_bytes, files if files is None or not rewritten else 2 * files)
        self._buckets = slots // WAYS
        self._bits = self._buckets.bit_length() - 1
        self._table: memoryview | None = None  # mapped on the first add
        self._where: memoryview | None = None  # per slot: 1 + where its index starts in the ring, or 0
        # The indexes, written round and round: mapped now, so that a size the
        # system cannot give fails here, not in the middle of a decode (the
        # pages are the system's zero pages until written).
        self._ring: memoryview | None = None
        if index_bytes:
            try:
                self._ring = memoryview(_anonymous(index_bytes))
            except (OSError, OverflowError, ValueError) as exc:
                raise ValueError(f"index_bytes={index_bytes}: the system cannot map that much memory "
                                 f"({exc})") from None
        # Bytes ever written to the ring, in a word of its own: the extension's
        # fused decode reads it without the GIL (see :attr:`native`).
        self._heads = memoryview(bytearray(8)).cast("Q")
        self._adding = threading.Lock()
        self._native: tuple | None = None
        _LIVE.add(self)

    @property
    def _head(self) -> int:
        return self._heads[0]

    @_head.setter
    def _head(self, value: int) -> None:
        self._heads[0] = value

    @property
    def native(self) -> tuple | None:
        """This memory as the extension's fused decode reads it without the GIL
        (``fused``'s ``memory``: the table, where each index starts, the
        ring, the head word, log2 of the buckets and :meth:`points_of`'s terms),
        or None where the extension does not compute this memory's fingerprint
        (no CRC-32C instruction). Lookups only: adds stay with :meth:`add` and
        :meth:`keep_index`, under their lock."""
        native = self._native
        if native is None and _ext is not None and _ext.CRC32C_HARDWARE:
            table, where = self._table, self._where
            native = (None if table is None else table.obj,
                      None if where is None else where.obj,
                      None if self._ring is None else self._ring.obj, self._heads.obj, self._bits,
                      self.points, self.MIN_POINTS, self.FILE_BYTES_PER_POINT)
            if table is not None:  # fixed from now on
                self._native = native
        return native

    def points_of(self, nbytes: int) -> int:
        """Checkpoints for the index of a file of ``nbytes``: its share of the ring
        (:attr:`points`), and at most one per :data:`FILE_BYTES_PER_POINT` of the
        file (at least MIN_POINTS); 0 without a ring."""
        if not self.points:
            return 0
        return max(self.MIN_POINTS, min(self.points, nbytes // self.FILE_BYTES_PER_POINT))

    @classmethod
    def slots_for(cls, files: int | None) -> int:
        """Table slots for ``files`` distinct files: the power of two that keeps the
        table at most half full (where two buckets of :data:`WAYS` slots lose next
        to no entry), within MIN_SLOTS..SLOTS; SLOTS when the number is not known."""
        if files is None:
            return cls.SLOTS
        return max(cls.MIN_SLOTS, min(cls.SLOTS, 1 << (2 * max(1, files) - 1).bit_length()))

    @classmethod
    def points_for(cls, index_bytes: int, files: int | None) -> int:
        """Checkpoints per file for a ring of ``index_bytes`` shared by ``files``."""
        if not index_bytes:
            return 0
        if files is None:
            return cls.UNKNOWN_POINTS
        share = index_bytes * 3 // 4 // max(1, files) - _RECORD.size - cls.INDEX_HEADER
        return max(cls.MIN_POINTS, min(cls.MAX_POINTS, share // cls.POINT_BYTES))

    @staticmethod
    def fingerprints(data: bytes | bytearray | memoryview) -> tuple[int, int]:
        """``(fingerprint, check)``: the length (low 32 bits) and CRC-32C of ``data``
        as one nonzero 64-bit int, and the CRC-32C of its first half (computed on
        the way: the whole costs one pass)."""
        view = data if isinstance(data, memoryview) else memoryview(data)
        half = _crc(view[:len(view) // 2])
        fp = ((len(view) & 0xFFFFFFFF) << 32) | _crc(view[len(view) // 2:], half)
        return fp or 1, half  # 0 marks an empty slot

    @classmethod
    def fingerprint(cls, data: bytes | bytearray | memoryview) -> int:
        """The length (low 32 bits) and CRC-32C of ``data`` as one nonzero 64-bit int."""
        return cls.fingerprints(data)[0]

    def _bases(self, fp: int) -> tuple[int, int]:
        """The first slots of the two buckets ``fp`` may live in."""
        h = (fp * _GOLDEN) & _MASK64
        return (h >> (64 - self._bits)) * WAYS, ((h >> 7) & (self._buckets - 1)) * WAYS

    def seen(self, fp: int) -> bool:
        """Whether bytes of fingerprint ``fp`` were added (and not pushed out since)."""
        table = self._table
        if table is None:
            return False
        a, b = self._bases(fp)
        return fp in table[a:a + WAYS] or fp in table[b:b + WAYS]

    def add(self, fp: int, index: bytes | None = None, check: int = 0) -> None:
        """Remember that bytes of fingerprint ``fp`` decoded to their end without an
        error, with their row ``index`` if one was recorded (``check``: the
        CRC-32C of their first half, from :meth:`fingerprints`)."""
        # Adds take turns, so that two threads never fill the same empty slot;
        # a lookup meanwhile reads whole slots (each read and write of one
        # holds the GIL), so it never sees a torn one.
        with self._adding:
            self._put(fp, index, check, False)

    def keep_index(self, fp: int, index: bytes, check: int) -> None:
        """Keep ``index`` for the bytes of fingerprints ``(fp, check)`` in place of
        any kept before (a decode that read further than the index it had).
        Bytes not added yet are added, unread to their end: only a feeder with
        ``jpeg_verify=False``, which never asks :meth:`seen`, keeps indexes of
        such bytes."""
        if index and self.index_bytes:
            with self._adding:
                self._put(fp, index, check, True)

    def _put(self, fp: int, index: bytes | None, check: int, replace: bool) -> None:
        """add() and keep_index(), the caller holding ``_adding``."""
        a, b = self._bases(fp)
        table = self._table
        if table is None:
            # An anonymous mapping, not a heap allocation: its pages are the
            # system's zero pages until written (one 4 KiB page per slot
            # written at first), and it goes back to the system whole when the
            # feeder is freed. (A heap calloc of this size may be zeroed, all
            # resident, and kept by the allocator.)
            table = memoryview(_anonymous(self.slots * 8)).cast("Q")
            if self.index_bytes:
                self._where = memoryview(_anonymous(self.slots * 8)).cast("Q")
            # Published last: a thread that sees the table sees where too
            # (:attr:`native` keeps what it saw once the table is there).
            self._table = table
        where = self._where
        native = self.native
        if native is not None:
            # The extension's writer: the same steps, without a line of Python
            # per step (an add runs once per file, in every first epoch).
            _ext.memory_put(native, fp, check, index or None, replace)
            return
        # Both buckets' entries in one list (bucket a first): found or placed
        # with list methods, not a loop of Python per slot (an add runs once
        # per file, holding the GIL, in every first epoch).
        held = table[a:a + WAYS].tolist() + table[b:b + WAYS].tolist()
        if fp in held:
            k = held.index(fp)
            i = (a if k < WAYS else b) + k % WAYS
            # A longer index of the same bytes stays: two decodes that
            # started with none (threads, a file listed twice) each
            # keep what they passed, and the deeper one must win.
            if (replace and index and where is not None
                    and self._kept_length(where[i] - 1, fp, check) < len(index)):
                where[i] = 1 + self._keep(fp, check, index)
            return
        if 0 in held:
            k = held.index(0)
            slot = (a if k < WAYS else b) + k % WAYS
        else:
            # Both buckets full: push out one of their eight entries, chosen by fp's bits.
            slot = (a if fp & 1 else b) + ((fp >> 1) & (WAYS - 1))
        if where is not None and where[slot]:
            where[slot] = 0  # the slot's old index is not the new file's
        table[slot] = fp
        if index and where is not None:
            where[slot] = 1 + self._keep(fp, check, index)

    def _kept_length(self, at: int, fp: int, check: int) -> int:
        """The length of the index of ``(fp, check)`` kept at ``at`` in the ring
        (bytes ever written), 0 if there is none there any more."""
        ring = self._ring
        if at < 0 or ring is None or self._head > at + self.index_bytes:
            return 0
        start = at % self.index_bytes
        if start + _RECORD.size > self.index_bytes:
            return 0
        got_fp, got_check, _, n = _RECORD.unpack_from(ring, start)
        return n if (got_fp, got_check) == (fp, check) else 0

    def _keep(self, fp: int, check: int, index: bytes) -> int:
        """Write a record of ``index`` into the ring (the caller holds ``_adding``);
        return where it starts, counted in bytes ever written."""
        size = _RECORD.size + len(index)
        if size > self.index_bytes or len(index) > 0xFFFF:
            return -1
        assert self._ring is not None  # mapped in __init__ when index_bytes > 0
        at = self._head
        if at % self.index_bytes + size > self.index_bytes:  # no record wraps round the end
            at += self.index_bytes - at % self.index_bytes
        # The head moves on before the bytes are written: a reader that copied
        # a record and then finds the head still short of overwriting it knows
        # its copy is whole (see index()).
        self._head = at + size
        start = at % self.index_bytes
        self._ring[start:start + size] = _RECORD.pack(fp, check, _crc(index), len(index)) + index
        return at

    def index(self, fp: int, check: int) -> bytes | None:
        """The row index kept for the bytes of fingerprints ``(fp, check)``, or None."""
        table, where, ring = self._table, self._where, self._ring
        if table is None or where is None or ring is None:
            return None
        a, b = self._bases(fp)
        for base in (a, b):
            for i in range(base, base + WAYS):
                if table[i] != fp:
                    continue
                at = where[i] - 1
                if at < 0:
                    return None
                start = at % self.index_bytes
                if start + _RECORD.size > self.index_bytes:
                    return None
                # The head, then one copy of the body (an index is up to tens of
                # KB, read for every decode), then the checks: the ring's head
                # moves on before a record is written over, so if it has not
                # passed this one, neither read saw a write.
                got_fp, got_check, crc, n = _RECORD.unpack_from(ring, start)
                body = bytes(ring[start + _RECORD.size:start + _RECORD.size + n])
                if self._head > at + self.index_bytes:  # written over since
                    return None
                if got_fp != fp or got_check != check or len(body) != n or _crc(body) != crc:
                    return None
                return body
        return None

    def __getstate__(self) -> dict:
        # A copy in another process starts empty: its decodes verify for themselves.
        return {"slots": self.slots, "index_bytes": self.index_bytes, "files": self.files,
                "rewritten": self.rewritten}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["slots"], state.get("index_bytes", self.INDEX_BYTES), state.get("files"),
                      state.get("rewritten", False))

    def table_bytes(self) -> int:
        """Bytes of the tables mapped now (fingerprints, and where their indexes
        are; 0 before the first add): resident as their pages are written, all of
        it once the files outnumber the table's pages."""
        if self._table is None:
            return 0
        return self.slots * 8 * (2 if self._where is not None else 1)

    def indexes_bytes(self) -> int:
        """Bytes of the index ring written so far (resident), at most ``index_bytes``."""
        return min(self._head, self.index_bytes)

    def __len__(self) -> int:
        """Slots in use (counted: for tests and reports, not the decode path)."""
        if self._table is None:
            return 0
        return int(np.count_nonzero(np.frombuffer(self._table, np.uint64)))
