"""Mid-epoch resume: what a pass has delivered, and the state dict that carries it.

A pass records the source indices of every batch the training loop has taken
(and of every sample it skipped under ``on_error="skip"``). A resumed pass of the
same epoch dispatches the rest of that epoch's order, in order, leaving those
out. With ``ordered=True`` and ``on_error="raise"`` the delivered samples are
exactly the first ``samples`` of the order and state is taken between batches,
so the rest is ``order[samples:]`` cut at the same batch boundaries: the
remaining batches are the uninterrupted run's, pixel for pixel (each sample's
randomness depends on (seed, epoch, index) alone). Otherwise batches are made
of whatever is left, and each sample not yet delivered comes exactly once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .epoch import LAZY_MIN
from .plan import EpochPlan
from .progress import Progress, pass_finished
from .sequence import Handled, Order, Remaining
from .state import (COMPACT_ABOVE, COMPACT_VERSION, EPOCHS, FORMAT_VERSION, check_progress, check_settings, describe_transforms,
                    handled_from_bitmaps, layout_digest, load_compact, pack, unpack, _check_counts)

class Cursor:
    """Where a feeder stands between passes: the epoch its next pass takes, what its
    latest pass has delivered, and a place inside an epoch to start the next pass
    from (a loaded state, or :meth:`skip`). Behind ``Feeder.set_epoch``,
    ``skip``, ``state_dict`` and ``load_state_dict``.

    Args:
        config: The feeder's :class:`~feeder.engine.config.Config` (the settings a
            state records).
        plan: The feeder's :class:`~feeder.order.plan.EpochPlan`: every order
            progress is counted along and states are checked against.
        ranks: The feeder's :class:`~feeder.engine.ranks.Ranks` (``seed``,
            ``shard()``): the seed and shard in use, read when they are needed (the
            seed is agreed on at the first pass).
    """

    def __init__(self, config: Any, plan: EpochPlan, ranks: Any) -> None:
        self.config = config
        self.plan = plan
        self.source = plan.source
        self.chain = plan.chain
        self.layout_digest = layout_digest(plan.layout)
        self.ranks = ranks
        self.next_epoch = 0
        self.progress: Progress | None = None  # the latest pass's
        # A loaded state's unfinished pass and the epoch to use after it (see load_state_dict).
        self.resume: tuple[Progress, int] | None = None

    def latest_epoch(self) -> int:
        """The epoch of the latest pass, else of the next one."""
        return self.progress.epoch if self.progress is not None else self.next_epoch

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < EPOCHS:
            raise ValueError(f"epoch must be an int in [0, 2**64), got {epoch!r}")
        self.next_epoch = epoch
        if self.resume is not None and self.resume[0].epoch != epoch:
            self.resume = None  # another epoch than the loaded state's unfinished one

    def start(self, begin: Callable[[int, Handled | None], Any]) -> tuple[Any, Progress]:
        """Start the next pass: ``begin(epoch, handled)`` starts its threads (``handled``:
        what a resumed pass must not dispatch again); returns the pass and its progress."""
        epoch = self.next_epoch
        if epoch >= EPOCHS:
            raise ValueError(f"epoch {epoch} is past the last epoch 2**64 - 1 (orders and "
                             f"randomness are keyed by 64 bits of it): set_epoch() another")
        resume = self.resume
        done = None
        if resume is not None and resume[0].epoch == epoch:
            progress, next_epoch = resume
            done = progress.handled()
        else:
            progress, next_epoch = self.new_progress(epoch), epoch + 1
        # The epoch and the resume are used up only once the pass is running: a
        # start that fails (a closed feeder, a rank contradiction) leaves them.
        pass_ = begin(epoch, done)
        self.next_epoch, self.resume = next_epoch, None
        progress.pass_ = pass_
        self.progress = progress
        return pass_, progress

    def skip(self, batches: int, total: int, agree: Callable[[], Any]) -> None:
        """``Feeder.skip``: ``total`` is ``len(feeder)``; ``agree`` agrees on the seed."""
        if isinstance(batches, bool) or not isinstance(batches, int) or not 0 <= batches < total:
            raise ValueError(f"batches must be an int in [0, len(feeder)) = [0, {total}) (to skip "
                             f"a whole epoch, set_epoch(epoch + 1)), got {batches!r}")
        if batches == 0:
            return
        epoch = self.next_epoch
        if self.resume is not None:
            raise ValueError(f"the state given to load_state_dict already positions the next pass "
                             f"inside epoch {epoch}; skip() would skip batches of the resumed pass")
        # The order is cut from rank 0's seed: agree on it now, as a first pass would.
        agree()
        # A resume of this epoch as if a pass had delivered those batches: the
        # same path as load_state_dict, so state_dict() before the pass keeps it.
        self.resume = (self.new_progress(epoch, Handled(batches * self.config.batch_size), (),
                                         batches), epoch + 1)

    def order(self, epoch: int, rank: int | None = None, seed: int | None = None) -> Any:
        """This rank's (or ``rank``'s) order of ``epoch``, as the sampler dispatches it."""
        seed = self.ranks.seed if seed is None else seed
        this_rank, world_size = self.ranks.shard()
        return self.plan.order(epoch, this_rank if rank is None else rank, world_size, seed)

    def next_order(self) -> Any:
        """What the next pass dispatches on this rank, in order: its epoch's order,
        less what a loaded state's pass or :meth:`skip` has handled."""
        epoch = self.next_epoch
        if epoch >= EPOCHS:
            raise ValueError(f"epoch {epoch} is past the last epoch 2**64 - 1: set_epoch() another")
        order = self.order(epoch)
        resume = self.resume
        if resume is not None and resume[0].epoch == epoch:
            return Remaining(order, resume[0].handled())
        return order

    def new_progress(self, epoch: int, start: Handled | None = None, skipped: Any = (),
                     batches: int = 0) -> Progress:
        # The order is made at its first need, with the seed then agreed on.
        return Progress(epoch, len(self.source), lambda: self.order(epoch), start, skipped, batches)

    def settings(self) -> dict[str, Any]:
        """The settings that decide which samples a pass delivers, in which order and
        batches, and with which pixels: every one is saved and checked on load."""
        c = self.config
        rank, world_size = self.ranks.shard()
        return {"source_length": len(self.source), "shard_layout": self.layout_digest,
                "seed": self.ranks.seed, "batch_size": c.batch_size, "shuffle": c.shuffle,
                "shuffle_window": c.shuffle_window, "shuffle_shards": c.shuffle_shards,
                "drop_last": c.drop_last, "ordered": c.ordered, "on_error": c.on_error,
                "rank": rank, "world_size": world_size,
                "image_size": tuple(self.chain.image_size),
                "max_image_size": None if c.max_image_size is None else tuple(c.max_image_size),
                "size_divisibility": c.size_divisibility,
                "group_by_aspect_ratio": c.group_by_aspect_ratio,
                "exif_orientation": c.exif_orientation,
                # Which samples fail (and, under on_error="skip", which batches come).
                "max_pixels": c.max_pixels,
                "transforms": describe_transforms(self.chain.transforms)}

    def _finished(self, handled: int) -> bool:
        c = self.config
        rank, world_size = self.ranks.shard()
        return pass_finished(handled, len(self.source), c.batch_size, c.drop_last,
                             c.on_error == "skip", rank, world_size)

    def state_dict(self, skipped_total: Callable[[], int]) -> dict[str, Any]:
        """``Feeder.state_dict``; ``skipped_total()``: the samples skipped so far."""
        epoch: int | None = None
        delivered = skipped = None
        handled: Handled | None = None
        skipped_list: list[int] | None = None
        compact = len(self.source) > COMPACT_ABOVE
        batches = 0
        next_epoch = self.next_epoch
        if self.resume is not None:
            progress, next_epoch = self.resume
        else:
            progress = self.progress
            if progress is not None and progress.ended:
                progress = None
        if progress is not None:
            handled, skipped_list, batches = progress.compact()
            if progress.batches and self._finished(handled.count()):
                # Every batch is delivered but the loop has not asked for the end
                # (Lightning stops at len(feeder)): the uninterrupted run's next
                # pass is the next epoch, not an empty rest of this one.
                progress = None
                handled = skipped_list = None
            else:
                epoch = progress.epoch
                if not compact:
                    done, failed, _ = progress.snapshot()
                    delivered, skipped = pack(done), pack(failed)
        # A grouped order depends on the images' sizes, not on the settings alone:
        # the resumed pass checks that it regroups the same way.
        grouped = (self.grouped_digest(progress.order)
                   if progress is not None and self.config.group_by_aspect_ratio is not None
                   else None)
        if compact:
            return {"version": COMPACT_VERSION, "epoch": epoch, "next_epoch": next_epoch,
                    "batches": batches, "position": None if handled is None else handled.position,
                    "after": None if handled is None else list(handled.after),
                    "skipped": skipped_list, "skipped_total": skipped_total(),
                    "grouped_order": grouped, "settings": self.settings()}
        return {"version": FORMAT_VERSION, "epoch": epoch, "next_epoch": next_epoch,
                "batches": batches, "delivered": delivered, "skipped": skipped,
                "skipped_total": skipped_total(), "grouped_order": grouped,
                "settings": self.settings()}

    @staticmethod
    def grouped_digest(order: Order) -> str:
        """A digest of a grouped pass's order (an array: see :func:`~feeder.order.group.group_sequence`)."""
        flat = np.ascontiguousarray(order.take(0, len(order)), dtype=np.int64)
        return hashlib.blake2b(flat.tobytes(), digest_size=16).hexdigest()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``Feeder.load_state_dict``."""
        version = state.get("version") if isinstance(state, dict) else None
        if version not in (FORMAT_VERSION, COMPACT_VERSION) or isinstance(version, bool):
            found = version if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a feeder state of format version {FORMAT_VERSION} or "
                             f"{COMPACT_VERSION} (got {found!r})")
        settings = state.get("settings")
        current = self._current_settings(settings)
        saved_rank = current["rank"]
        check_settings(settings, current)
        epoch, next_epoch = state.get("epoch"), state.get("next_epoch")
        _check_counts(state, epoch, version)
        resume = None
        if epoch is not None:
            resume = self._resumed_pass(state, version, epoch, next_epoch, saved_rank,
                                        current["seed"])
            if resume is None:
                epoch = None  # nothing left of that pass: continue with the next
        self.ranks.seed = current["seed"]
        self.resume = resume
        self.progress = None
        self.next_epoch = epoch if epoch is not None else next_epoch

    def _current_settings(self, saved: Any) -> dict[str, Any]:
        """This feeder's settings as a saved state's must be: with the saved seed
        when the feeder drew its own, and the saving rank's when batches are ordered."""
        current = self.settings()
        c = self.config
        if (c.seed is None and isinstance(saved, dict)
                and isinstance(saved.get("seed"), int) and not isinstance(saved["seed"], bool)
                and 0 <= saved["seed"] < 2**64):
            current["seed"] = saved["seed"]
        world_size = current["world_size"]
        if (isinstance(saved, dict) and c.ordered and c.on_error == "raise"
                and saved.get("world_size") == world_size
                and isinstance(saved.get("rank"), int) and 0 <= saved["rank"] < world_size):
            # Another rank's state (a trainer that checkpoints from rank 0 only):
            # with ordered batches, every rank's position is its batch count,
            # and the ranks step together, so this rank continues from there.
            current["rank"] = saved["rank"]
        return current

    def _resumed_pass(self, state: dict[str, Any], version: int, epoch: int, next_epoch: int,
                      saved_rank: int, seed: int) -> tuple[Progress, int] | None:
        """The unfinished pass of a state, checked; None when nothing is left of it."""
        c = self.config
        length = len(self.source)
        skip = c.on_error == "skip"
        order = self.order(epoch, saved_rank, seed)
        saved_grouped = state.get("grouped_order")
        if (saved_grouped is not None and c.group_by_aspect_ratio is not None
                and saved_grouped != self.grouped_digest(order)):
            # Same settings, other sizes: the images changed, or their headers
            # read otherwise (positions along another order would lose samples).
            raise ValueError(f"cannot resume: grouped_order of epoch {epoch} differs (saved "
                             f"{saved_grouped!r}, this feeder {self.grouped_digest(order)!r}): "
                             f"the image sizes that group_by_aspect_ratio reads are not those "
                             f"of the saving run")
        field = "delivered"
        if version == FORMAT_VERSION:
            if length > LAZY_MIN:
                raise ValueError(
                    f"state of format {FORMAT_VERSION} (bitmaps) for a source of {length} "
                    f"samples: sources of more than {LAZY_MIN} samples have had another "
                    f"order since format {COMPACT_VERSION}, so its unfinished pass cannot be "
                    f"resumed; start that epoch again (set_epoch({epoch})) or the next one")
            done = unpack(state.get("delivered"), length, "delivered")
            skipped = unpack(state.get("skipped"), length, "skipped")
            check_progress(done, skipped, state["batches"], order[:], c.batch_size, skip, epoch)
            handled, skipped_list = handled_from_bitmaps(done, skipped, order)
        else:
            field = "position"
            handled, skipped_list = load_compact(state, order, length, c.batch_size, skip, epoch)
        if c.ordered and c.on_error == "raise":
            # The delivered samples must be the head of the epoch's order,
            # else the rest would not be the uninterrupted run's batches.
            n = handled.count()
            whole = n in (state["batches"] * c.batch_size, len(order))
            if not whole or handled.after:
                raise ValueError(f"state[{field!r}] is not the start of epoch {epoch}'s "
                                 f"order ({n} samples in {state['batches']} batches): the "
                                 f"state is damaged or from other settings")
            rank = self.ranks.shard()[0]
            if saved_rank != rank:
                mine = self.order(epoch, rank, seed)
                handled = Handled(min(len(mine), state["batches"] * c.batch_size))
        resume = (self.new_progress(epoch, handled, skipped_list, state["batches"]), next_epoch)
        if state["batches"] and self._finished(handled.count()):
            return None
        return resume
