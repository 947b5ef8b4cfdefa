"""Which shard this process reads, and the base seed every rank agrees on.

The sampler cuts each epoch's order into one shard per rank (see
:mod:`feeder.order.epoch`). The ranks are read again at every pass (a feeder built
before ``init_process_group`` must shard once the group exists), and the order
is cut after shuffling, so every rank must shuffle with rank 0's seed.
"""

from __future__ import annotations

from collections.abc import Iterator

import logging
import os
import weakref
from typing import Any

import torch

from ..order.epoch import check_epoch

log = logging.getLogger(__name__)


class Ranks:
    """A feeder's ranks and base seed.

    Args:
        rank, world_size: As given to the feeder (both None: follow
            ``torch.distributed``, else the launcher's environment).

    Attributes:
        seed: The base seed in use (see :meth:`choose_seed`).
    """

    def __init__(self, rank: int | None, world_size: int | None) -> None:
        self.given = (rank, world_size)
        self.seed = 0
        self.agreed = False

    def choose_seed(self, seed: int | None) -> None:
        """Use ``seed`` as given; None draws one from torch's generator (so
        ``torch.manual_seed`` makes runs repeatable), agreed on by :meth:`agree`."""
        self.seed = seed if seed is not None else local_seed(*self.given)
        self.agreed = seed is not None

    def shard(self) -> tuple[int, int]:
        """(rank, world_size) now (see :func:`shard`)."""
        return shard(*self.given)

    def agree(self, world_size: int) -> None:
        """Take rank 0's seed, once, when there are several ranks (a collective call)."""
        if world_size > 1 and not self.agreed:
            self.seed = agreed_seed(self.seed, world_size)
            self.agreed = True

    def for_pass(self, size: int, batch_size: int, drop_last: bool) -> tuple[int, int]:
        """(rank, world_size) for a pass over ``size`` samples, with the seed agreed
        among the ranks once there are several (a collective call: every rank makes
        it at the same point) and every rank checked to get a batch."""
        rank, world_size = self.shard()
        if world_size > 1:
            check_epoch(size, batch_size, drop_last, world_size)
            self.agree(world_size)
        return rank, world_size

    def check_agreed(self) -> None:
        """Raise when the ranks of a process group have yet to agree on a drawn
        seed: iterating ``feeder.sampler`` is not a collective call, as a sampler's
        iteration is not, so it raises rather than wait for ranks that may never ask
        (they agree at the first pass or ``skip``)."""
        _, world_size = self.shard()
        dist = torch.distributed
        if (world_size > 1 and not self.agreed and dist.is_available()
                and dist.is_initialized()):
            raise RuntimeError(
                "iter(feeder.sampler) before the ranks have agreed on the shuffle seed: they "
                "agree at the first pass (or feeder.skip), every rank at once; pass seed=... to "
                "the Feeder, or iterate the sampler after the first pass")


def local_seed(rank: int | None, world_size: int | None) -> int:
    """The seed of ``seed=None``: from torch's generator; 0 when ranks are given by
    hand with no process group to agree through (as ``DistributedSampler`` does)."""
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    dist = torch.distributed
    if world_size is not None and world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        log.info("seed=None with world_size=%d and no torch.distributed: using seed 0 on every rank",
                 world_size)
        return 0
    return seed


def agreed_seed(seed: int, world_size: int) -> int:
    """Rank 0's seed, for every rank (a collective call: every rank starts its first
    pass at the same point of the script, as with DistributedSampler's set_epoch).

    The order is cut into shards after shuffling, so every rank must shuffle
    alike: ranks often seed torch differently (``manual_seed(base + rank)``),
    which would make the shards overlap.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        # Ranks from the launcher's environment or given by hand, and no group
        # to agree through: every rank uses seed 0, as DistributedSampler does.
        if seed != 0:
            log.info("seed=None with world_size=%d and no torch.distributed: using seed 0 on every rank",
                     world_size)
        return 0
    box = [seed]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def shard(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's (rank, world_size): from ``torch.distributed`` when it is
    initialized (given values must agree with it), else as given (checked by
    Config), else from the launcher's environment, else (0, 1).

    Raises:
        ValueError: ``rank``/``world_size`` were given and contradict the process group.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        actual = dist.get_rank(), dist.get_world_size()
        if actual[1] > 1 and world_size is not None and (rank, world_size) != actual:
            raise ValueError(f"Feeder(rank={rank}, world_size={world_size}) contradicts "
                             f"torch.distributed (rank {actual[0]} of {actual[1]}); leave them "
                             f"unset to follow the process group")
        if world_size is None or actual[1] > 1:
            return actual
    if rank is not None and world_size is not None:
        return rank, world_size
    return launcher_shard()


def launcher_shard() -> tuple[int, int]:
    """(rank, world_size) from the launcher's environment (``torchrun`` sets
    ``RANK`` and ``WORLD_SIZE`` before the script starts), else (0, 1): so
    ``len(feeder)`` is this rank's from the start, before ``init_process_group``.

    Raises:
        ValueError: the variables are set but are not a rank in ``[0, WORLD_SIZE)``.
    """
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is None or env_world is None:
        # Launchers that set only some (Lightning's ddp launcher sets WORLD_SIZE
        # and LOCAL_RANK, and the group exists before the first pass) are read
        # from torch.distributed at the pass instead.
        return 0, 1
    try:
        world_size = int(env_world)
        rank = int(env_rank) if env_rank is not None else -1
    except ValueError:
        world_size = rank = -1
    if not 0 <= rank < world_size:
        raise ValueError(f"the environment's RANK={env_rank!r} and WORLD_SIZE={env_world!r} are not a rank "
                         f"in [0, WORLD_SIZE) (torchrun sets both); fix or unset them, or pass "
                         f"Feeder(rank=, world_size=)")
    return rank, world_size


class EpochSampler:
    """``Feeder.sampler``: a sampler-like handle whose ``set_epoch`` sets the feeder's.

    Trainers that set the epoch on ``loader.sampler`` (Lightning calls
    ``set_epoch`` on ``dataloader.sampler`` at the start of every training
    epoch) set the feeder's epoch through it; ``len()`` is this rank's samples
    per epoch; iterating it gives this rank's sample indices of the next pass
    (the epoch last set), in the order the feeder dispatches them, as iterating
    a ``DistributedSampler`` does: after ``skip`` or ``load_state_dict``, only
    the samples that pass has left. It holds the feeder weakly, so an unclosed feeder is still
    collected (and its threads stopped) when the program drops it.
    """

    def __init__(self, feeder: Any) -> None:
        self._feeder = weakref.ref(feeder)

    def _target(self) -> Any:
        feeder = self._feeder()
        if feeder is None:
            raise ReferenceError("the feeder of this sampler was garbage-collected")
        return feeder

    def set_epoch(self, epoch: int) -> None:
        """``Feeder.set_epoch(epoch)``."""
        self._target().set_epoch(epoch)

    def __len__(self) -> int:
        return self._target().num_samples

    def __iter__(self) -> Iterator[int]:
        return self._target()._next_pass_indices()

    def __repr__(self) -> str:
        return "EpochSampler(set_epoch -> Feeder.set_epoch)"
