"""The epoch order of a mixture of sources (see :class:`feeder.Mixture`).

Source ``k`` gets ``weights[k] * N`` of an epoch's ``N`` positions (rounded by
the largest remainder), dealt out by a binary tree over the sources so that
every prefix of the epoch holds the weights to within a bound; each source's
draws go through passes over its samples, shuffled per pass. The bounds and the
dealing: docs/design/orders.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from ..sample.rng import order_key
from .sequence import Order, Permutation, subkey

# (i * C + M // 2) // M in int64 while i * C + M stays below 2^63: epochs up to this.
_INT64_EPOCH = 3_000_000_000


def apportion(weights: Sequence[Fraction], total: int) -> list[int]:
    """``total`` positions shared out by ``weights`` (exact fractions summing to 1)
    with the largest remainder: each ``floor(w * total)``, one more for the
    largest fractional parts (ties: the lower index) until they sum to ``total``."""
    exact = [w * total for w in weights]
    counts = [int(e) for e in exact]  # floor: every e >= 0
    left = total - sum(counts)
    by_rest = sorted(range(len(weights)), key=lambda k: (-(exact[k] - counts[k]), k))
    for k in by_rest[:left]:
        counts[k] += 1
    return counts


def _tree(counts: Sequence[int], lo: int, hi: int) -> int | tuple:
    """The split tree of sources ``[lo, hi)``: a source number, or
    ``(left, right, left_count, count)``."""
    if hi - lo == 1:
        return lo
    total = sum(counts[lo:hi])
    at, best, acc = lo + 1, None, 0
    for m in range(lo + 1, hi):
        acc += counts[m - 1]
        gap = abs(2 * acc - total)
        if best is None or gap < best:
            at, best = m, gap
    left = sum(counts[lo:at])
    return (_tree(counts, lo, at), _tree(counts, at, hi), left, total)


def _before(i: np.ndarray, c: int, m: int) -> np.ndarray:
    """``floor((i * c + m // 2) / m)``: the left child's share of the first ``i``."""
    if m <= _INT64_EPOCH:
        return (i * c + m // 2) // m
    # Past int64's reach: Python integers (slower, exact).
    return ((i.astype(object) * c + m // 2) // m).astype(np.int64)


class Interleave:
    """Which source each position of an epoch draws from.

    Args:
        counts: Positions per epoch of each source (each at least 1).
    """

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts = tuple(int(c) for c in counts)
        self.length = sum(self.counts)
        self.tree = _tree(self.counts, 0, len(self.counts))

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, draw)`` at ``positions`` (int64, each in ``[0, length)``):
        the source number and how many earlier positions of the epoch drew from it."""
        positions = np.asarray(positions, dtype=np.int64)
        source = np.zeros(len(positions), np.int64)
        draw = np.zeros(len(positions), np.int64)
        stack = [(self.tree, np.arange(len(positions)), positions)]
        while stack:
            node, where, i = stack.pop()
            if isinstance(node, int):
                source[where], draw[where] = node, i
                continue
            left, right, c, m = node
            before = _before(i, c, m)
            to_left = _before(i + 1, c, m) > before
            stack.append((left, where[to_left], before[to_left]))
            stack.append((right, where[~to_left], (i - before)[~to_left]))
        return source, draw


class MixtureOrder(Order):
    """The global order of one epoch of a mixture: global sample indices
    (``offsets[k] + `` source ``k``'s own index) by position.

    Args:
        counts: Draws per epoch of each source (see :func:`apportion`).
        lengths: Each source's length.
        offsets: Each source's first global index.
        seed, epoch: The order's seed and epoch.
        shuffle: Each pass of each source in a keyed permutation (else in order).
    """

    def __init__(self, counts: Sequence[int], lengths: Sequence[int], offsets: Sequence[int],
                 seed: int, epoch: int, shuffle: bool) -> None:
        self.interleave = Interleave(counts)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.first_draw = np.asarray(counts, dtype=np.int64) * epoch  # draws of earlier epochs
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self._perms: dict[tuple[int, int], Permutation] = {}

    def __len__(self) -> int:
        return self.interleave.length

    def _perm(self, source: int, pass_: int) -> Permutation:
        key = (source, pass_)
        p = self._perms.get(key)
        if p is None:
            if len(self._perms) > 4 * len(self.lengths):  # passes are walked in order: keep a few
                self._perms.clear()
            p = self._perms[key] = Permutation(int(self.lengths[source]),
                                               subkey(order_key(self.seed, pass_), source))
        return p

    def take(self, start: int, stop: int) -> np.ndarray:
        stop = min(stop, len(self))
        if stop <= start:
            return np.zeros(0, np.int64)
        source, draw = self.interleave(np.arange(start, stop, dtype=np.int64))
        overall = self.first_draw[source] + draw
        length = self.lengths[source]
        passes, local = overall // length, overall % length
        if self.shuffle:
            for k in np.unique(source).tolist():
                mine = np.flatnonzero(source == k)
                for p in np.unique(passes[mine]).tolist():
                    at = mine[passes[mine] == p]
                    local[at] = self._perm(k, p)(local[at])
        return self.offsets[source] + local

    def sources(self, start: int, stop: int) -> np.ndarray:
        """The source number at positions ``[start, stop)``."""
        stop = min(stop, len(self))
        return self.interleave(np.arange(start, max(start, stop), dtype=np.int64))[0]
