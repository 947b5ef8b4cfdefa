"""Per-sample random numbers that do not depend on thread scheduling.

Each sample gets a key derived from ``(seed, epoch, index)``; each transform in
the chain draws from its own stream of that key. The generator is a counter
based SplitMix64: creating one costs a few integer operations (no seeding of a
large state), which matters on the per-sample hot path where the GIL is held.
Batch transforms get a ``torch.Generator`` on the device, seeded from
``(seed, epoch, batch number, position)`` (:func:`batch_generator`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_UNIT = 1.0 / 9007199254740992.0  # 2**-53: a 53-bit integer to a float in [0, 1)


def _mix(z: int) -> int:
    """SplitMix64's output function: a bijective 64-bit avalanche."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


# ``index_key`` and ``SampleRNG._next`` run for every sample (and draw) with the
# GIL held, so they spell ``_mix`` out inline: a Python call costs as much as the
# mix itself. They must stay bit-identical to the composition of ``_mix`` they
# replace (the stream is part of the determinism promise; tests/sample/test_rng.py pins it).

def epoch_key(seed: int, epoch: int) -> int:
    """What :func:`sample_key` derives from ``(seed, epoch)`` alone: computed once per
    pass, then :func:`index_key` gives each sample's key with a single mix."""
    return _mix((_mix((seed & _MASK) ^ _GOLDEN) + (epoch & _MASK) * _GOLDEN) & _MASK)


def index_key(epoch_key: int, index: int) -> int:
    """``sample_key(seed, epoch, index)`` from ``epoch_key(seed, epoch)``."""
    z = epoch_key ^ ((index & _MASK) * 0xD1B54A32D192ED03) & _MASK
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


_INDEX_MUL = np.uint64(0xD1B54A32D192ED03)
_MIX_1, _MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def index_keys(epoch_key: int, indices: Any) -> list[int]:
    """:func:`index_key` of each of ``indices`` (ints of at least 0), in one numpy
    pass: the sampler keys a whole batch at once instead of a call per sample
    in the decode threads (the arithmetic wraps modulo 2**64, as the masks do)."""
    z = np.asarray(indices, dtype=np.uint64) * _INDEX_MUL
    z ^= np.uint64(epoch_key & _MASK)
    z = (z ^ (z >> _S30)) * _MIX_1
    z = (z ^ (z >> _S27)) * _MIX_2
    return (z ^ (z >> _S31)).tolist()


def sample_key(seed: int, epoch: int, index: int) -> int:
    """The 64-bit key of one sample in one epoch."""
    return index_key(epoch_key(seed, epoch), index)


def order_key(seed: int, epoch: int) -> int:
    """The 64-bit seed of one epoch's sample order (distinct from every sample key)."""
    return _mix((_mix((seed & _MASK) ^ 0xA0761D6478BD642F) + (epoch & _MASK) * _GOLDEN) & _MASK)


class SampleRNG:
    """Random numbers for one transform applied to one sample.

    Offers the small subset of ``numpy.random.Generator`` that image transforms
    use; :meth:`numpy` returns a full generator seeded from the same stream for
    anything else. Draw ``n`` (from 1) of stream ``s`` of ``key`` is
    ``_mix(_mix(key + (s + 1) * golden) + n * golden)``: a counter-based stream,
    so creating one costs next to nothing.
    """

    __slots__ = ("_state",)

    def __init__(self, key: int, stream: int = 0) -> None:
        # The start, ``_mix(key + (stream + 1) * golden)``, is mixed at the first
        # draw: the chain makes a stream for every transform of every sample, and
        # some never draw (a crop whose box was drawn for the decode hint). Until
        # then the state holds the unmixed start, bit-inverted (so negative).
        self._state = ~((key + (stream + 1) * _GOLDEN) & _MASK)

    def _next(self) -> int:
        z = self._state
        if z < 0:
            z = _mix(~z)
        self._state = z = (z + _GOLDEN) & _MASK
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        return z ^ (z >> 31)

    # The draws below spell ``_next`` out too (a call per draw costs about as
    # much as the draw): each is ``_next``'s arithmetic, then its own.

    def random(self) -> float:
        """A float uniformly drawn from [0, 1)."""
        z = self._state
        if z < 0:
            z = _mix(~z)
        self._state = z = (z + _GOLDEN) & _MASK
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        return ((z ^ (z >> 31)) >> 11) * _UNIT

    def uniform(self, low: float = 0.0, high: float = 1.0) -> float:
        """A float uniformly drawn from [low, high)."""
        z = self._state
        if z < 0:
            z = _mix(~z)
        self._state = z = (z + _GOLDEN) & _MASK
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        return low + (high - low) * (((z ^ (z >> 31)) >> 11) * _UNIT)

    def integers(self, low: int, high: int | None = None) -> int:
        """An int uniformly drawn from [low, high), like ``Generator.integers``."""
        if high is None:
            low, high = 0, low
        span = high - low
        if span <= 0:
            raise ValueError(f"integers: high ({high}) must be greater than low ({low})")
        z = self._state
        if z < 0:
            z = _mix(~z)
        self._state = z = (z + _GOLDEN) & _MASK
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        return low + ((z ^ (z >> 31)) * span >> 64)

    def log_uniform(self, low: float, high: float) -> float:
        """``exp(uniform(log(low), log(high)))``: a ratio drawn evenly in log space."""
        return math.exp(self.uniform(math.log(low), math.log(high)))

    def numpy(self) -> np.random.Generator:
        """A ``numpy.random.Generator`` seeded from this stream (far costlier to make than a draw: use when needed)."""
        return np.random.Generator(np.random.PCG64(self._next()))


def batch_key(seed: int, epoch: int, number: int, position: int = 0) -> int:
    """The 64-bit key of batch ``number`` of ``epoch`` for the batch transform at
    ``position`` in the list (distinct from every sample and order key)."""
    k = _mix((_mix((seed & _MASK) ^ 0x8EBC6AF09C88C6E3) + (epoch & _MASK) * _GOLDEN) & _MASK)
    k = _mix((k ^ ((number & _MASK) * 0xD1B54A32D192ED03)) & _MASK)
    return _mix((k + (position + 1) * _GOLDEN) & _MASK)


def batch_generator(seed: int, epoch: int, number: int, position: int,
                    device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded from :func:`batch_key`: a batch
    transform's draws depend on (seed, epoch, batch number) only, never on which
    thread finished which sample first."""
    gen = torch.Generator(device=device)
    gen.manual_seed(batch_key(seed, epoch, number, position))
    return gen
