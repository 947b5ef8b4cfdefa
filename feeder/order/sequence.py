"""Epoch orders that cost O(1) memory and O(1) work per sample.

An order is a sequence of sample indices that is never materialised: position
``k`` of a rank's pass is computed when the sampler reaches it, from the seed,
the epoch and the rank alone. A source of 2 billion samples (or 10^10) starts
its epoch at once and the order holds no array of its samples.

The global shuffle is a keyed bijection of ``[0, n)``: a balanced Feistel
network over the smallest even number of bits covering ``n - 1``, made a
permutation of ``[0, n)`` by cycle-walking (a value that lands at or past ``n``
is encrypted again until it falls inside; the network permutes ``[0, 2^bits)``,
so the walk always ends and stays a bijection). ``2^bits < 4n``, so a walk takes
under four steps on average. Arithmetic is on ``uint64`` numpy arrays: a batch of
positions is one vectorised call, and every value stays below ``2^64`` for any
``n <= 2^62``.

Block orders serve storage larger than the cache: the shards are permuted per
epoch, laid end to end, each rank takes a contiguous chunk of that stream and
reads it window by window (a window is ``K`` consecutive shards of the chunk, or
``W`` samples), the samples of a window permuted by a Feistel network of their
own. A rank therefore holds at most one window of shards (two while the next is
prefetched), and reads each of its shards once per epoch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

# Rounds of the Feistel network: 4 make a pseudo-random permutation (Luby and
# Rackoff); 6 leave no visible structure in small domains either.
ROUNDS = 6
# The largest domain: positions and values stay below 2^64 in uint64 arithmetic.
MAX_LENGTH = 1 << 62


def _mix(z: int) -> int:
    """splitmix64's finalizer on a Python int (64-bit)."""
    z &= _MASK
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray) -> np.ndarray:
    # uint64 array arithmetic wraps modulo 2^64 without warnings (scalars warn).
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


def subkey(key: int, *parts: int) -> int:
    """A 64-bit key derived from ``key`` and integers (a rank, a window number)."""
    for p in parts:
        key = _mix((key ^ _mix((p & _MASK) + _GOLDEN)) + _GOLDEN)
    return key


class Permutation:
    """A keyed bijection of ``[0, length)`` (Feistel network with cycle-walking).

    Args:
        length: The domain's size, 1 to ``2^62``.
        key: Any 64-bit integer; each key gives another permutation.
    """

    __slots__ = ("length", "_half", "_mask", "_keys")

    def __init__(self, length: int, key: int) -> None:
        if not 1 <= length <= MAX_LENGTH:
            raise ValueError(f"a permutation's length must be in [1, 2^62], got {length}")
        self.length = length
        bits = max(2, (length - 1).bit_length())
        bits += bits & 1
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = [np.uint64(_mix((key + (r + 1) * _GOLDEN) & _MASK)) for r in range(ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h, m = self._half, self._mask
        left, right = x >> h, x & m
        for k in self._keys:
            left, right = right, left ^ (_mix_array(right ^ k) & m)
        return (left << h) | right

    def _decrypt(self, x: np.ndarray) -> np.ndarray:
        h, m = self._half, self._mask
        left, right = x >> h, x & m
        for k in reversed(self._keys):
            left, right = right ^ (_mix_array(left ^ k) & m), left
        return (left << h) | right

    def _walk(self, x: np.ndarray, step: Any) -> np.ndarray:
        n = np.uint64(self.length)
        out = step(x)
        out_of_range = np.flatnonzero(out >= n)
        while out_of_range.size:
            moved = step(out[out_of_range])
            out[out_of_range] = moved
            out_of_range = out_of_range[moved >= n]
        return out.astype(np.int64)

    def __call__(self, positions: Any) -> np.ndarray:
        """The values at ``positions`` (an int array, each in ``[0, length)``)."""
        return self._walk(np.asarray(positions, dtype=np.uint64), self._encrypt)

    def inverse(self, values: Any) -> np.ndarray:
        """The positions holding ``values``: ``p.inverse(p(x)) == x``."""
        return self._walk(np.asarray(values, dtype=np.uint64), self._decrypt)


class Order(Sequence):
    """A rank's pass order: sample indices by position, computed on demand.

    Subclasses give :meth:`take`; indexing with an int gives an int, with a
    slice a list (what the sampler dispatches), and :meth:`chunks` walks the
    order a batch at a time.
    """

    def __len__(self) -> int:
        raise NotImplementedError

    def take(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at positions ``[start, stop)`` (int64)."""
        raise NotImplementedError

    def __getitem__(self, item: Any) -> Any:
        n = len(self)
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self.take(start, max(start, stop)).tolist()
        if item < 0:
            item += n
        if not 0 <= item < n:
            raise IndexError(f"position {item} out of range [0, {n})")
        return int(self.take(item, item + 1)[0])

    def chunks(self, size: int, start: int = 0) -> Iterator[list[int]]:
        """The order from ``start`` in lists of ``size`` (the last may be shorter)."""
        n = len(self)
        for a in range(start, n, size):
            yield self.take(a, min(n, a + size)).tolist()

    def head(self, count: int) -> "Order":
        """The first ``count`` positions (a pass cut to whole batches)."""
        return _Head(self, min(count, len(self)))


class _Head(Order):
    def __init__(self, order: Order, count: int) -> None:
        self.order, self.count = order, count

    def __len__(self) -> int:
        return self.count

    def take(self, start: int, stop: int) -> np.ndarray:
        return self.order.take(start, min(stop, self.count))


class ArrayOrder(Order):
    """An order held as an array (the small sources' orders, as before)."""

    def __init__(self, indices: np.ndarray) -> None:
        self.indices = np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def take(self, start: int, stop: int) -> np.ndarray:
        return self.indices[start:stop]


class GlobalOrder(Order):
    """This rank's share of a global order: position ``k`` is the global order's
    position ``rank + k * world_size`` (identity, or a :class:`Permutation`)."""

    def __init__(self, length: int, key: int | None, rank: int, world_size: int, size: int) -> None:
        self.perm = None if key is None else Permutation(length, key)
        self.rank, self.world_size, self.size = rank, world_size, size

    def __len__(self) -> int:
        return self.size

    def take(self, start: int, stop: int) -> np.ndarray:
        stop = min(stop, self.size)
        if stop <= start:
            return np.zeros(0, np.int64)
        pos = np.arange(start, stop, dtype=np.int64) * self.world_size + self.rank
        return pos if self.perm is None else self.perm(pos)


class BlockOrder(Order):
    """A block shuffle: the shards permuted, this rank's chunk of their stream read
    window by window, each window's samples permuted (see the module docstring).

    Args:
        ranges: ``[start, stop)`` sample ranges of the shards, in source order.
        shard_perm: The epoch's order of the shards (a permutation of their numbers).
        begin, end: This rank's chunk of the permuted stream, ``[begin, end)``.
        key: The epoch's key for this rank (each window derives its own).
        window_shards: ``K``: a window is ``K`` consecutive shards of the chunk
            (cut at the chunk's ends); or None, with ``window_samples``.
        window_samples: ``W``: a window is ``W`` consecutive samples of the chunk.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]], shard_perm: np.ndarray, begin: int,
                 end: int, key: int, window_shards: int | None = None,
                 window_samples: int | None = None) -> None:
        sizes = np.asarray([b - a for a, b in ranges], dtype=np.int64)[shard_perm]
        self.first = np.asarray([a for a, _ in ranges], dtype=np.int64)[shard_perm]
        # Stream position where each permuted shard starts.
        self.cum = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.shard_perm = np.asarray(shard_perm, dtype=np.int64)
        self.begin, self.end, self.key = begin, end, key
        self.window_samples = window_samples
        if window_shards is not None:
            self.starts: list[int] | None = [begin]
            self.shard_windows: list[tuple[int, int]] | None = []
            if end > begin:
                # The chunk's shards: from the one holding ``begin`` to the one holding end - 1.
                lo = int(np.searchsorted(self.cum, begin, side="right")) - 1
                hi = int(np.searchsorted(self.cum, end - 1, side="right"))
                self.starts = [max(begin, int(self.cum[s])) for s in range(lo, hi, window_shards)]
                self.shard_windows = [(s, min(s + window_shards, hi))
                                      for s in range(lo, hi, window_shards)]
        else:
            self.starts = None
            self.shard_windows = None
        self._perms: dict[int, Permutation] = {}

    def __len__(self) -> int:
        return self.end - self.begin

    def window_of(self, position: int) -> tuple[int, int, int]:
        """``(window number, its first, its end)`` stream positions of a rank position."""
        at = self.begin + position
        if self.starts is None:
            w = position // self.window_samples
            a = self.begin + w * self.window_samples
            return w, a, min(self.end, a + self.window_samples)
        w = bisect.bisect_right(self.starts, at) - 1
        b = self.starts[w + 1] if w + 1 < len(self.starts) else self.end
        return w, self.starts[w], b

    def windows(self) -> int:
        """The number of windows of this rank's chunk."""
        if self.starts is None:
            return -(-len(self) // self.window_samples)
        return len(self.starts)

    def window_shard_numbers(self, w: int) -> list[int]:
        """The source's shard numbers that window ``w`` reads (for prefetching)."""
        if self.shard_windows is not None:
            if not 0 <= w < len(self.shard_windows):
                return []
            lo, hi = self.shard_windows[w]
            return self.shard_perm[lo:hi].tolist()
        a = self.begin + w * self.window_samples
        if not self.begin <= a < self.end:
            return []
        b = min(self.end, a + self.window_samples)
        lo = int(np.searchsorted(self.cum, a, side="right")) - 1
        hi = int(np.searchsorted(self.cum, b - 1, side="right"))
        return self.shard_perm[lo:hi].tolist()

    def _perm(self, w: int, size: int) -> Permutation:
        p = self._perms.get(w)
        if p is None:
            if len(self._perms) > 8:  # the sampler walks windows in order: keep a few
                self._perms.clear()
            p = self._perms[w] = Permutation(size, subkey(self.key, w))
        return p

    def take(self, start: int, stop: int) -> np.ndarray:
        stop = min(stop, len(self))
        out = np.empty(max(0, stop - start), np.int64)
        k = start
        while k < stop:
            w, a, b = self.window_of(k)
            upto = min(stop, b - self.begin)
            offs = np.arange(k + self.begin - a, upto + self.begin - a, dtype=np.int64)
            stream = a + self._perm(w, b - a)(offs)
            shard = np.searchsorted(self.cum, stream, side="right") - 1
            out[k - start:upto - start] = self.first[shard] + stream - self.cum[shard]
            k = upto
        return out


@dataclass(frozen=True)
class Handled:
    """What an earlier run of a pass handled (delivered or skipped), by position
    in the pass's order: every position before ``position``, and ``after``
    (positions past it, sorted). Small whatever the epoch's length: ``after``
    holds only the samples that finished out of order (at most those in flight).

    ``levels``: which order the positions are in. Empty for the epoch's own
    order; after the world size changed mid-epoch, the earlier worlds' sizes and
    what each of their ranks had handled (see :meth:`feeder.order.plan.EpochPlan.order`)."""

    position: int
    after: tuple[int, ...] = ()
    levels: tuple[tuple[int, tuple["Handled", ...]], ...] = ()

    def count(self) -> int:
        return self.position + len(self.after)


class Remaining(Order):
    """The positions of ``order`` that ``handled`` leaves, in order (a resumed pass)."""

    def __init__(self, order: Order, handled: Handled) -> None:
        self.order, self.handled = order, handled
        self._after = set(handled.after)

    def __len__(self) -> int:
        return max(0, len(self.order) - self.handled.position
                   - sum(1 for p in self._after if p < len(self.order)))

    def chunks(self, size: int, start: int = 0) -> Iterator[list[int]]:
        if start:
            raise ValueError("Remaining.chunks starts at the beginning")
        n = len(self.order)
        pending: list[int] = []
        step = max(size, 4096)
        for a in range(self.handled.position, n, step):
            b = min(n, a + step)
            got = self.order.take(a, b).tolist()
            if self._after:
                got = [i for p, i in zip(range(a, b), got) if p not in self._after]
            pending.extend(got)
            while len(pending) >= size:
                yield pending[:size]
                del pending[:size]
        if pending:
            yield pending

    def take(self, start: int, stop: int) -> np.ndarray:
        stop = min(stop, len(self))
        if stop <= start:
            return np.zeros(0, np.int64)
        k = np.arange(start, stop, dtype=np.int64)
        base = self.handled.position
        skipped = np.asarray(sorted(p for p in self._after if p < len(self.order)), dtype=np.int64)
        # The k-th position left is the smallest p = base + k + (handled positions <= p):
        # the iteration climbs to it from below (at most once per handled position).
        p = base + k
        while len(skipped):
            q = base + k + np.searchsorted(skipped, p, side="right")
            if np.array_equal(q, p):
                break
            p = q
        block = self.order.take(int(p[0]), int(p[-1]) + 1)
        return block[p - p[0]]


class Concat(Order):
    """Orders one after another."""

    def __init__(self, parts: Sequence[Order]) -> None:
        self.parts = list(parts)
        self.starts = np.cumsum([0] + [len(p) for p in self.parts]).tolist()

    def __len__(self) -> int:
        return self.starts[-1]

    def take(self, start: int, stop: int) -> np.ndarray:
        stop = min(stop, len(self))
        out = [np.zeros(0, np.int64)]
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        for part, begin in zip(self.parts[first:], self.starts[first:]):
            if begin >= stop:
                break
            out.append(part.take(max(0, start - begin), stop - begin))
        return np.concatenate(out).astype(np.int64, copy=False)


class Slice(Order):
    """Positions ``[start, stop)`` of ``order``."""

    def __init__(self, order: Order, start: int, stop: int) -> None:
        self.order, self.start, self.stop = order, start, max(start, min(stop, len(order)))

    def __len__(self) -> int:
        return self.stop - self.start

    def take(self, start: int, stop: int) -> np.ndarray:
        stop = min(stop, len(self))
        if stop <= start:
            return np.zeros(0, np.int64)
        return self.order.take(self.start + start, self.start + stop)


class Hinting(Order):
    """``order`` walked a batch at a time, telling ``source`` what comes: each
    batch's samples (``source.will_read``: their shards' indices are loaded ahead)
    and, for a block order, the shards of the window being entered and of the
    next one (``source.will_read_shards``: their copies into the cache start
    while the current window is read). Both are hints; the order is unchanged."""

    def __init__(self, order: Order, source: Any) -> None:
        self.order, self.source = order, source
        self._will_read = getattr(source, "will_read", None)
        self._will_read_shards = getattr(source, "will_read_shards", None)

    def __len__(self) -> int:
        return len(self.order)

    def take(self, start: int, stop: int) -> np.ndarray:
        return self.order.take(start, stop)

    def chunks(self, size: int, start: int = 0) -> Iterator[list[int]]:
        inner = self.order
        blocks = inner.order if isinstance(inner, Remaining) else inner
        if isinstance(blocks, _Head):
            blocks = blocks.order
        if not isinstance(blocks, BlockOrder) or blocks.shard_windows is None:
            blocks = None
        # A resumed pass starts past its handled head (a hint needs no more precision).
        position = inner.handled.position if isinstance(inner, Remaining) else start
        window = -1
        for chunk in inner.chunks(size, start):
            if blocks is not None and self._will_read_shards is not None and position < len(blocks):
                w = blocks.window_of(position)[0]
                if w != window:
                    window = w
                    self._will_read_shards(blocks.window_shard_numbers(w)
                                           + blocks.window_shard_numbers(w + 1))
            if self._will_read is not None:
                self._will_read(chunk)
            position += len(chunk)
            yield chunk
