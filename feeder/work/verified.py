"""Which JPEG files a feeder has already read to their end without an error.

With ``jpeg_verify`` (the default), a region decode entropy-decodes the whole
file, below the crop too, because Huffman data that lost its sync shows only at
the end of the scan. That costs 12-18% of the decode, every epoch, for files
whose bytes have not changed since they last passed. :class:`VerifiedJpegs`
remembers a fingerprint of every byte string that passed (its CRC-32 and its
length); a later region decode of the same bytes stops after the crop's last
row, as ``jpeg_verify=False`` does, and still gets exactly the pixels it would
have got: the same bytes decode the same way. Bytes that changed in any way (a
re-published shard, a damaged copy, a cut file) have another fingerprint and
are read to their end again. A damaged copy goes unnoticed only if its length
and CRC-32 both equal those of a copy that passed: about 2**-32 for random
damage (CRC-32 misses no burst of up to 32 bits).

The memory is bounded: a table of ``slots`` 8-byte fingerprints (16 MiB by
default, its pages touched only as they fill), each fingerprint in one of two
slots; when both are taken, one is overwritten, and the file it named is read
to its end the next time it comes. A lost entry costs time, never correctness.
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["VerifiedJpegs"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing multiplier: spreads the bits over the slot index


class VerifiedJpegs:
    """A bounded, thread-safe memory of JPEG byte strings read to their end without an error.

    Args:
        slots: Table size, a power of two (8 bytes each).
    """

    SLOTS = 1 << 21

    def __init__(self, slots: int = SLOTS) -> None:
        if slots < 2 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two of at least 2, got {slots}")
        self.slots = slots
        self._bits = slots.bit_length() - 1
        self._table: memoryview | None = None  # allocated on the first add

    @staticmethod
    def fingerprint(data: bytes | memoryview) -> int:
        """The length (low 32 bits) and CRC-32 of ``data`` as one nonzero 64-bit int
        (zlib.crc32 releases the GIL on inputs of more than a few KB)."""
        fp = ((len(data) & 0xFFFFFFFF) << 32) | zlib.crc32(data)
        return fp or 1  # 0 marks an empty slot

    def _slots(self, fp: int) -> tuple[int, int]:
        h = (fp * _GOLDEN) & _MASK64
        return h >> (64 - self._bits), (h >> 7) & (self.slots - 1)

    def seen(self, fp: int) -> bool:
        """Whether bytes of fingerprint ``fp`` were added (and not pushed out since)."""
        table = self._table
        if table is None:
            return False
        a, b = self._slots(fp)
        return table[a] == fp or table[b] == fp

    def add(self, fp: int) -> None:
        """Remember that bytes of fingerprint ``fp`` decoded to their end without an error."""
        table = self._table
        if table is None:
            # np.zeros takes zeroed pages from the system: untouched slots cost no memory.
            table = self._table = memoryview(np.zeros(self.slots, np.uint64)).cast("B").cast("Q")
        a, b = self._slots(fp)
        # Each read and write of one slot holds the GIL: a race between two
        # threads can lose an entry (time, not correctness), never tear one.
        if table[a] in (0, fp):
            table[a] = fp
        elif table[b] in (0, fp):
            table[b] = fp
        else:
            table[b if fp & 1 else a] = fp

    def __len__(self) -> int:
        """Slots in use (counted: for tests and reports, not the decode path)."""
        if self._table is None:
            return 0
        return int(np.count_nonzero(np.frombuffer(self._table, np.uint64)))
