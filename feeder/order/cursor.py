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

from .epoch import LAZY_MIN, num_batches, shard_size
from ..decode.step import DecodeOptions
from ..sample.sizes import SizeOptions
from .plan import EpochPlan, OrderOptions
from .progress import Progress, pass_finished
from .sequence import Handled, Order, Remaining
from .plan import Levels
from .state import (COMPACT_ABOVE, COMPACT_VERSION, DAMAGED_STATES, EPOCHS, FORMAT_VERSION,
                    check_version, check_world, common_epoch, decode_levels, encode_levels,
                    every_rank, check_progress, check_settings, describe_transforms,
                    handled_from_bitmaps, layout_digest, load_compact, pack, unpack, _check_counts)

class Cursor:
    """Where a feeder stands between passes: the epoch its next pass takes, what its
    latest pass has delivered, and a place inside an epoch to start the next pass
    from (a loaded state, or :meth:`skip`). Behind ``Feeder.set_epoch``,
    ``skip``, ``state_dict`` and ``load_state_dict``.

    Args:
        order: The feeder's order options (``skip``: ``on_error="skip"``).
        decode: Its decode options and ``sizes``, its size options: with
            ``order``, the settings a state records.
        plan: The feeder's :class:`~feeder.order.plan.EpochPlan`: every order
            progress is counted along and states are checked against.
        ranks: The feeder's :class:`~feeder.engine.ranks.Ranks` (``seed``,
            ``shard()``): the seed and shard in use, read when they are needed (the
            seed is agreed on at the first pass).
    """

    def __init__(self, order: OrderOptions, decode: DecodeOptions, sizes: SizeOptions,
                 plan: EpochPlan, ranks: Any) -> None:
        self.options, self.decode, self.sizes = order, decode, sizes
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
        self.resume = (self.new_progress(epoch, Handled(batches * self.options.batch_size), (),
                                         batches), epoch + 1)

    def order(self, epoch: int, rank: int | None = None, seed: int | None = None,
              levels: Levels = (), world_size: int | None = None) -> Any:
        """This rank's (or ``rank``'s of ``world_size``) order of ``epoch``, as the
        sampler dispatches it (after the world sizes of ``levels``)."""
        seed = self.ranks.seed if seed is None else seed
        this_rank, this_world = self.ranks.shard()
        return self.plan.order(epoch, this_rank if rank is None else rank,
                               this_world if world_size is None else world_size, seed, levels=levels)

    def next_order(self) -> Any:
        """What the next pass dispatches on this rank, in order: its epoch's order,
        less what a loaded state's pass or :meth:`skip` has handled."""
        epoch = self.next_epoch
        if epoch >= EPOCHS:
            raise ValueError(f"epoch {epoch} is past the last epoch 2**64 - 1: set_epoch() another")
        resume = self.resume
        if resume is not None and resume[0].epoch == epoch:
            handled = resume[0].handled()
            return Remaining(self.order(epoch, levels=handled.levels), handled)
        return self.order(epoch)

    def new_progress(self, epoch: int, start: Handled | None = None, skipped: Any = (),
                     batches: int = 0) -> Progress:
        # The order is made at its first need, with the seed then agreed on.
        levels = start.levels if start is not None else ()
        return Progress(epoch, len(self.source), lambda: self.order(epoch, levels=levels), start,
                        skipped, batches)

    def settings(self) -> dict[str, Any]:
        """The settings that decide which samples a pass delivers, in which order and
        batches, and with which pixels: every one is saved and checked on load."""
        c, sizes = self.options, self.sizes
        rank, world_size = self.ranks.shard()
        settings = {"source_length": len(self.source), "shard_layout": self.layout_digest,
                "seed": self.ranks.seed, "batch_size": c.batch_size, "shuffle": c.shuffle,
                "shuffle_window": c.shuffle_window, "shuffle_shards": c.shuffle_shards,
                "drop_last": c.drop_last, "ordered": c.ordered,
                "on_error": "skip" if c.skip else "raise",
                "rank": rank, "world_size": world_size,
                "image_size": tuple(self.chain.image_size),
                "max_image_size": (None if sizes.max_image_size is None
                                   else tuple(sizes.max_image_size)),
                "size_divisibility": sizes.size_divisibility,
                "group_by_aspect_ratio": c.group_by_aspect_ratio,
                "exif_orientation": self.decode.exif_orientation,
                # Which samples fail (and, under on_error="skip", which batches come).
                "max_pixels": self.decode.max_pixels,
                "transforms": describe_transforms(self.chain.transforms)}
        # A source that orders its own epochs (feeder.Mixture): what its order is a
        # function of, besides (seed, epoch). Saved only then, so that a state of
        # any other source still loads in a release that does not know the name.
        order = _source_order(self.source)
        if order is not None:
            settings["source_order"] = order
        return settings

    def _finished(self, handled: Handled, order: Callable[[], Order]) -> bool:
        """Whether a pass that has handled ``handled`` of ``order()`` has no batch left."""
        if handled.levels:  # a resharded rest: every sample of it is delivered
            return handled.count() >= len(order())
        c = self.options
        rank, world_size = self.ranks.shard()
        return pass_finished(handled.count(), len(self.source), c.batch_size, c.drop_last,
                             c.skip, rank, world_size)

    def state_dict(self, skipped_total: Callable[[], int]) -> dict[str, Any]:
        """``Feeder.state_dict``; ``skipped_total()``: the samples skipped so far."""
        epoch: int | None = None
        delivered = skipped = None
        handled: Handled | None = None
        skipped_list: list[int] | None = None
        # A source that orders its own epochs may draw a sample twice in one (a
        # mixture's small source): one bit per sample cannot say which draw was delivered.
        compact = len(self.source) > COMPACT_ABOVE or self.plan.own_order is not None
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
            if progress.batches and self._finished(handled, lambda: progress.order):
                # Every batch is delivered but the loop has not asked for the end
                # (Lightning stops at len(feeder)): the uninterrupted run's next
                # pass is the next epoch, not an empty rest of this one.
                progress = None
                handled = skipped_list = None
            else:
                epoch = progress.epoch
                if not compact and not handled.levels:
                    done, failed, _ = progress.snapshot()
                    delivered, skipped = pack(done), pack(failed)
        # A grouped order depends on the images' sizes, not on the settings alone:
        # the resumed pass checks that it regroups the same way.
        grouped = (self.grouped_digest(progress.order)
                   if progress is not None and self.options.group_by_aspect_ratio is not None
                   else None)
        if compact or (handled is not None and handled.levels):
            # A resharded rest is resumed by position (format 2) whatever the length.
            state = {"version": COMPACT_VERSION, "epoch": epoch, "next_epoch": next_epoch,
                     "batches": batches, "position": None if handled is None else handled.position,
                     "after": None if handled is None else list(handled.after),
                     "skipped": skipped_list, "skipped_total": skipped_total(),
                     "grouped_order": grouped, "settings": self.settings()}
        else:
            state = {"version": FORMAT_VERSION, "epoch": epoch, "next_epoch": next_epoch,
                     "batches": batches, "delivered": delivered, "skipped": skipped,
                     "skipped_total": skipped_total(), "grouped_order": grouped,
                     "settings": self.settings()}
        if handled is not None and handled.levels:
            state["levels"] = encode_levels(handled.levels)
        return state

    @staticmethod
    def grouped_digest(order: Order) -> str:
        """A digest of a grouped pass's order (an array: see :func:`~feeder.order.group.group_sequence`)."""
        flat = np.ascontiguousarray(order.take(0, len(order)), dtype=np.int64)
        return hashlib.blake2b(flat.tobytes(), digest_size=16).hexdigest()

    def load_state_dict(self, state: Any) -> None:
        """``Feeder.load_state_dict``: one rank's state, or the list of every rank's
        (see :meth:`_load_every_rank`)."""
        if isinstance(state, (list, tuple)):
            self._loadevery_rank(list(state))
            return
        version = check_version(state, "state")
        settings = state.get("settings")
        current = self._current_settings(settings)
        saved_rank = current["rank"]
        check_world(settings, current)
        check_settings(settings, current)
        epoch, next_epoch = state.get("epoch"), state.get("next_epoch")
        _check_counts(state, epoch, version)
        levels = self._checked_levels(decode_levels(state.get("levels"), epoch), epoch,
                                      current["seed"])
        resume = None
        if epoch is not None:
            resume = self._resumed_pass(state, version, epoch, next_epoch, saved_rank,
                                        current["seed"], levels)
            if resume is None:
                epoch = None  # nothing left of that pass: continue with the next
        self.ranks.seed = current["seed"]
        self.resume = resume
        self.progress = None
        self.next_epoch = epoch if epoch is not None else next_epoch

    def _loadevery_rank(self, states: list[Any]) -> None:
        """Every rank's state of a run, saved under any world size. Under this
        feeder's world size, this rank's state is loaded as alone. Under another,
        the samples the saving ranks had not handled in their unfinished epoch
        are shared among this world's ranks (see
        :meth:`~feeder.order.plan.EpochPlan.order`): each delivered once."""
        if not states:
            raise ValueError("load_state_dict got an empty list: pass every rank's state_dict()")
        for k, s in enumerate(states):
            check_version(s, f"state[{k}]")
        by_rank = every_rank(states)
        old_world = len(by_rank)
        rank, world_size = self.ranks.shard()
        if old_world == world_size:
            self.load_state_dict(by_rank[rank])
            return
        current = self._current_settings(by_rank[0]["settings"])
        seed = current["seed"]
        for r, s in enumerate(by_rank):
            check_settings(s["settings"], dict(current, rank=r, world_size=old_world))
            _check_counts(s, s.get("epoch"), s["version"])
        epoch, next_epoch = common_epoch(by_rank)
        self.ranks.seed = seed
        self.progress = None
        self.resume = None
        self.next_epoch = next_epoch
        if epoch is None:
            return  # every rank had finished its pass: the next epoch starts anew
        unfinished = [s for s in by_rank if s.get("epoch") is not None]
        levels = self._checked_levels(decode_levels(unfinished[0].get("levels"), epoch), epoch,
                                      seed)
        if any(decode_levels(s.get("levels"), epoch) != levels for s in unfinished):
            raise ValueError(f"cannot resume: the ranks' states went through different world "
                             f"sizes in epoch {epoch}: {DAMAGED_STATES}")
        handled = []
        for r, s in enumerate(by_rank):
            if s.get("epoch") is None:  # this rank had delivered its whole pass
                handled.append(Handled(len(self.order(epoch, r, seed, levels, old_world))))
            else:
                h, _ = self._saved_handled(s, s["version"], epoch, r, old_world, seed, levels)
                handled.append(Handled(h.position, h.after))
        levels = (*levels, (old_world, tuple(handled)))
        if not len(self.plan.left(epoch, seed, levels)):
            return  # nothing was left of that epoch
        # The batch count continues so that the rest ends at len(feeder): this
        # rank's pass under the new world size less the batches its share of the
        # rest makes (the old ranks' counts are of other passes' lengths).
        c = self.options
        planned = num_batches(shard_size(len(self.source), rank, world_size, c.drop_last),
                              c.batch_size, c.drop_last)
        mine = len(self.order(epoch, levels=levels))
        batches = max(0, planned - num_batches(mine, c.batch_size, False))
        self.resume = (self.new_progress(epoch, Handled(0, (), levels), (), batches), next_epoch)
        self.next_epoch = epoch

    def _current_settings(self, saved: Any) -> dict[str, Any]:
        """This feeder's settings as a saved state's must be: with the saved seed
        when the feeder drew its own, and the saving rank's when batches are ordered."""
        current = self.settings()
        c = self.options
        if (c.seed is None and isinstance(saved, dict)
                and isinstance(saved.get("seed"), int) and not isinstance(saved["seed"], bool)
                and 0 <= saved["seed"] < 2**64):
            current["seed"] = saved["seed"]
        world_size = current["world_size"]
        if (isinstance(saved, dict) and c.ordered and not c.skip
                and saved.get("world_size") == world_size
                and isinstance(saved.get("rank"), int) and 0 <= saved["rank"] < world_size):
            # Another rank's state (a trainer that checkpoints from rank 0 only):
            # with ordered batches, every rank's position is its batch count,
            # and the ranks step together, so this rank continues from there.
            current["rank"] = saved["rank"]
        return current

    def _checked_levels(self, levels: Levels, epoch: int, seed: int) -> Levels:
        """``levels`` of a loaded state, each rank's handled positions checked
        against its order at that level: a position past it would drop samples."""
        for depth, (world_size, handled) in enumerate(levels):
            for rank, h in enumerate(handled):
                n = len(self.order(epoch, rank, seed, levels[:depth], world_size))
                if h.position > n or (h.after and h.after[-1] >= n):
                    raise ValueError(f"state['levels'][{depth}]: rank {rank} of {world_size} "
                                     f"handled positions up to {max(h.position, *h.after, 0)} of "
                                     f"an order of {n} samples in epoch {epoch}: the state is "
                                     f"damaged or from other settings")
        return levels

    def _resumed_pass(self, state: dict[str, Any], version: int, epoch: int, next_epoch: int,
                      saved_rank: int, seed: int, levels: Levels = ()) -> tuple[Progress, int] | None:
        """The unfinished pass of a state, checked; None when nothing is left of it."""
        c = self.options
        handled, skipped_list = self._saved_handled(state, version, epoch, saved_rank, None, seed,
                                                    levels)
        if c.ordered and not c.skip and not levels:
            rank = self.ranks.shard()[0]
            if saved_rank != rank:
                mine = self.order(epoch, rank, seed)
                handled = Handled(min(len(mine), state["batches"] * c.batch_size))
        progress = self.new_progress(epoch, handled, skipped_list, state["batches"])
        if state["batches"] and self._finished(handled, lambda: progress.order):
            return None
        return progress, next_epoch

    def _saved_handled(self, state: dict[str, Any], version: int, epoch: int, rank: int,
                       world_size: int | None, seed: int, levels: Levels) -> tuple[Handled, list[int]]:
        """What rank ``rank`` (of ``world_size``; None: this feeder's) had handled of
        its order of ``epoch`` by ``state``, checked against that order."""
        c = self.options
        length = len(self.source)
        skip = c.skip
        order = self.order(epoch, rank, seed, levels, world_size)
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
            handled, skipped_list = load_compact(state, order, length, c.batch_size, skip, epoch,
                                                 resharded=bool(levels))
        if c.ordered and not c.skip and not levels:
            # The delivered samples must be the head of the epoch's order,
            # else the rest would not be the uninterrupted run's batches.
            n = handled.count()
            whole = n in (state["batches"] * c.batch_size, len(order))
            if not whole or handled.after:
                raise ValueError(f"state[{field!r}] is not the start of epoch {epoch}'s "
                                 f"order ({n} samples in {state['batches']} batches): the "
                                 f"state is damaged or from other settings")
        return Handled(handled.position, handled.after, levels), skipped_list


def _source_order(source: Any) -> Any:
    """What the epoch order of a source that orders its own epochs depends on
    besides (seed, epoch), from its ``order_settings()`` (a Mixture's sources'
    lengths and positions per epoch); None for any other source."""
    settings = getattr(source, "order_settings", None)
    return settings() if callable(settings) else None
