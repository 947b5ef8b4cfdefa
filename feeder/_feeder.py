"""The public :class:`Feeder`: configuration, passes, the consumer's side, shutdown."""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import _reaper
from ._augment import Chain
from ._dataset import FeederDataset
from ._config import Config, reads_may_block, signature_parameters
from ._decode import note_jpeg_decoder
from ._engine import Engine, ThreadEngine, close_when_collected as _close_when_collected
from ._engine import stop_pass as _stop_pass
from ._pipeline import Pass
from ._queue import END, Closed
from ._order import Handled
from ._resume import (COMPACT_ABOVE, COMPACT_VERSION, FORMAT_VERSION, Progress, check_progress,
                      check_settings, describe_transforms, handled_from_bitmaps, load_compact, pack,
                      pass_finished, unpack)
from ._sampler import (LAZY_MIN, check_epoch, num_batches, pass_sequence, shard_layout, shard_size,
                       shard_sizes)
from ._group import group_sequence
from ._stats import Stats
from ._transfer import Delivery, Failure
from .errors import FeederError, FeederTimeoutError, safe_text
from .sources import Source

log = logging.getLogger(__name__)

# While the training loop waits in next(), a sample one stage has worked on for
# longer than this is named in a warning (once per sample): a read that never
# returns (a hung network mount) otherwise looks like a silent hang.
STUCK_WARNING_S = 60.0
# How often a waiting next() looks for stuck samples (seconds).
_WATCH_S = 1.0

# Settings saved in a state only when set (see Feeder._settings).
_OPTIONAL_SETTINGS = ("max_image_size", "size_divisibility", "group_by_aspect_ratio")


@dataclass(frozen=True)
class BatchInfo:
    """Which samples a delivered batch holds (``Feeder.last_batch``).

    Attributes:
        epoch: The epoch of the pass that delivered it.
        number: Its position among that pass's batches (0, 1, ...).
        indices: int64 CPU tensor ``[B]``: the source index of each sample, in the
            batch's order (so ``labels[i]`` is the label of ``source`` sample
            ``indices[i]``).
    """

    epoch: int
    number: int
    indices: torch.Tensor


class EpochSampler:
    """``Feeder.sampler``: a sampler-like handle whose ``set_epoch`` sets the feeder's.

    Trainers that set the epoch on ``loader.sampler`` (Lightning calls
    ``set_epoch`` on ``dataloader.sampler`` at the start of every training
    epoch) set the feeder's epoch through it; ``len()`` is this rank's samples
    per epoch. It holds the feeder weakly, so an unclosed feeder is still
    collected (and its threads stopped) when the program drops it.
    """

    def __init__(self, feeder: "Feeder") -> None:
        self._feeder = weakref.ref(feeder)

    def _target(self) -> "Feeder":
        feeder = self._feeder()
        if feeder is None:
            raise ReferenceError("the feeder of this sampler was garbage-collected")
        return feeder

    def set_epoch(self, epoch: int) -> None:
        """``Feeder.set_epoch(epoch)``."""
        self._target().set_epoch(epoch)

    def __len__(self) -> int:
        return self._target().num_samples

    def __repr__(self) -> str:
        return "EpochSampler(set_epoch -> Feeder.set_epoch)"


class Feeder:
    """Feeds batches of images to a training loop from one process, with thread pools.

    Iterate it in the training loop: each pass yields ``(images, labels)`` with
    ``images`` a ``[B, 3, H, W]`` tensor on ``device`` (uint8 in channels_last
    layout by default; see ``memory_format``) and ``labels`` an int64 ``[B]`` tensor on ``device``
    (float, multi-hot or vector labels: a ``[B, ...]`` tensor of their dtype). A
    source whose ``read`` returns dicts (``"image"``, ``"mask"``, ``"boxes"``,
    ``"label"``...) yields dicts with the same keys (see :mod:`feeder._sample`).

    Args:
        source: An :class:`~feeder.ImageFolder`, a :class:`~feeder.FileList`, or any
            object with ``__len__`` and ``read(index) -> (encoded_bytes, label)``
            or a dict of fields (see :func:`feeder.check_sample`).
        batch_size: Samples per batch.
        transforms: CPU transforms on uint8 HWC RGB arrays (see :mod:`feeder.ops`),
            or plain callables ``fn(img, rng) -> img``.
        decode_threads: Threads reading and decoding, or ``"auto"`` (one per core, at least 2),
            or ``"tune"``: the ``"auto"`` count, parked and woken at batch boundaries
            to keep the fewest that hold the loop's wait share at 1% (see
            :mod:`feeder._tune`; :attr:`Stats.active_threads` shows the count over time).
        augment_threads: Threads running the transforms, or 0 to run them in the
            decode threads, or ``"auto"`` (0: measured fastest; see the docs'
            results page), or ``"tune"``: a pool of its own of the decode
            pool's ``"auto"`` count, tuned as ``decode_threads="tune"``.
        read_threads: Threads calling ``source.read``, ahead of the decode
            threads, so that a read waiting on storage never idles a core;
            ``"auto"``: 16 per decode thread, within [16, 128], when the
            source's reads may wait on storage (remote shards, a network or
            FUSE file system, a source without a ``reads_may_block`` attribute),
            else 0; 0 reads in the decode threads; ``"tune"``: the ``"auto"``
            count, tuned as ``decode_threads="tune"`` (0 where ``"auto"`` is 0).
            With several pools tuned, one changes at a batch boundary: only the
            busiest may grow, the least busy shrinks (see :mod:`feeder._tune`).
        read_ahead_bytes: Most bytes read and not yet taken by a decode thread
            (default 64 MiB); with ``read_threads``, it bounds the read-ahead.
        queue_size: Finished batches buffered ahead of the training loop.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. ``"cuda"`` is the current
            device of the thread that starts each pass (its first ``next()``),
            so a feeder built before ``torch.cuda.set_device(local_rank)``
            delivers on that rank's GPU. Only the stream current at ``next()``
            waits for the batch's copy: a batch used on another stream needs
            your own ``wait_stream`` and ``record_stream``.
        dtype: Output dtype; a floating dtype scales to [0, 1]. Converted on
            ``device`` after the copy, so only uint8 crosses the bus.
        normalize: ``(mean, std)``, three values each on the [0, 1] scale (as
            torchvision's ``Normalize`` after ``ToTensor``); implies float32
            unless ``dtype`` is given.
        memory_format: Layout of the ``[B, 3, H, W]`` images: ``"channels_last"``
            (default; the batch buffers' own layout, so a CPU uint8 batch is a
            view of one, no copy) or ``"contiguous"`` (plain NCHW, as ``x.view(B,
            -1)`` needs; made on ``device`` after the copy, by the transfer
            thread). ``torch.channels_last`` and ``torch.contiguous_format`` are
            accepted too.
        shuffle: Shuffle each epoch (seeded by ``seed`` and the epoch); off by
            default, as in ``DataLoader``: pass ``shuffle=True`` for training. ``"shards"``:
            the order for streaming storage, for a source made of shards
            (:class:`~feeder.TarShards`): shards shuffled per epoch, samples
            shuffled within windows of ``shuffle_window`` consecutive samples,
            each rank reading a contiguous run of shards.
        shuffle_window: Samples per shuffle window with ``shuffle="shards"``.
        shuffle_shards: With ``shuffle="shards"``, the block shuffle for storage
            larger than the cache: each rank reads its shards (permuted per
            epoch) in windows of this many whole shards, the samples of a window
            mixed; a window's shards are prefetched while the previous one is
            read (a :class:`~feeder.TarShards` source), so a rank holds about
            two windows of shards and reads each shard once per epoch. None:
            windows of ``shuffle_window`` samples.
        seed: Base seed of the order and of every transform's randomness; by
            default drawn from torch's default generator (so ``torch.manual_seed``
            makes runs repeatable, as with DataLoader).
        drop_last: Drop the last batch when it would be smaller than ``batch_size``,
            and give every rank the same number of samples (``len(source) //
            world_size``; the remainder is left out of that epoch), as DDP
            training needs. False: the ranks' shards cover every sample once
            (sizes differ by at most one, see :meth:`shard_sizes`), as an
            evaluation needs.
        ordered: True: batches and their contents depend only on the seed and
            epoch, not on thread counts or timing. False: batches in completion
            order (each sample still exactly once per epoch).
        on_error: ``"raise"``: a failing sample raises :class:`~feeder.SampleError`
            from ``next()``. ``"skip"``: it is dropped, counted and logged once,
            and later samples fill its place.
        max_skipped: With ``on_error="skip"``, raise once more than this many
            samples were skipped (None: no limit).
        rank: This process's shard (disjoint shards cut from one shared order
            per epoch; see ``drop_last``). Default: from ``torch.distributed``
            when it is initialized, else from ``torchrun``'s ``RANK`` and
            ``WORLD_SIZE`` environment variables (so ``len(feeder)`` is right
            before ``init_process_group``), else 0; read when each pass starts.
        world_size: The number of shards (default: from ``torch.distributed``,
            as ``rank``).
        image_size: (height, width) of the output, when the transforms do not
            fix it themselves.
        max_image_size: (height, width) of the largest image, for transforms
            whose output size varies (``Resize(800)``, or none): batches are then
            dicts with ``"image"`` ``[B, 3, Hb, Wb]`` padded with zeros to the
            largest image of the batch (bottom and right), ``"size"`` int64
            ``[B, 2]`` (each image's valid height and width), and the other
            fields (``"label"``; a ``"mask"`` padded with ``mask_fill``; boxes
            unchanged). The batch buffers are allocated for it: a larger image
            is an error naming the sample (skipped under ``on_error="skip"``).
            ``batch_size=1`` delivers each image as decoded and transformed.
        size_divisibility: Variable sizes: pad each batch's height and width up
            to a multiple of it (32 for FPN backbones, as detectron2 and
            mmdetection do); the buffers are ``max_image_size`` rounded up too.
        mask_fill: Variable sizes: the value of padded mask pixels (255, the
            segmentation references' ignore index).
        group_by_aspect_ratio: Batch samples of similar aspect ratio together, as
            torchvision's ``GroupedBatchSampler`` does: True (its default factor
            3) or a factor ``k`` (bins at ``2 ** linspace(-1, 1, 2k + 1)`` of
            width / height; 0: landscape vs portrait). Sizes come from the image
            headers, read once per source (or from ``source.image_sizes()``);
            every sample still once per epoch, in an order that depends only on
            (seed, epoch, rank). With ``max_image_size`` and transforms that can
            plan each sample's output size (``planned_size_for``), the samples
            of one aspect group are also batched by planned size (windows of 8
            batches sorted by area), so scale-jittered batches pad little.
        max_pixels: Largest decoded ``width * height`` accepted; larger images
            are rejected from their header (decompression bombs).
        timeout: Seconds ``next()`` may wait for a batch before it raises
            :class:`~feeder.FeederTimeoutError` naming the samples in flight for
            longer than that (stage, index, path); None waits forever, and names
            a sample in a warning once it has been in a stage for 60 s.
        exif_orientation: Apply the EXIF Orientation tag (JPEG, PNG, WebP, TIFF).
            False (default): pixels come out as stored, for every format, as
            with torchvision's ``decode_jpeg``.
        batch_transforms: Transforms of whole batches on ``device``, after the
            dtype conversion and normalization, in the transfer thread (on its
            side stream for CUDA): :class:`~feeder.ops.MixUp`,
            :class:`~feeder.ops.CutMix`, or callables ``fn(images, labels,
            generator) -> (images, labels)``; ``generator`` is a
            ``torch.Generator`` on ``device`` seeded from (seed, epoch, batch
            number), so results do not depend on thread counts. One that needs
            floating images (``needs_float = True``) is refused with uint8 output.
        isolation: Where the reading, decoding and transforms run. ``"thread"``
            (default): threads of this process. ``"process"``: the same threads
            in one worker process (started when the feeder is built, see
            ``start_method``), writing batches into shared memory; this process
            keeps only the transfer to ``device``, so the decode threads never
            hold this process's GIL while the training thread launches kernels.
        start_method: How ``isolation="process"`` starts its worker (a
            :class:`~feeder.errors.ConfigError` with ``isolation="thread"``).
            ``"auto"`` (default): ``"fork"`` where it is safe (Linux, CUDA not
            initialized in this process, no other thread running than feeder's
            idle ones), else ``"spawn"``; :attr:`start_method` says which ran.
            ``"fork"``: a copy of this process, its first batch a fraction of
            a second after ``Feeder(...)``; the source and transforms are not
            pickled (lambdas work).
            ``"spawn"`` / ``"forkserver"``: a fresh interpreter (seconds: it
            imports torch again); the source and transforms must be picklable
            (module-level functions and classes; a
            :class:`~feeder.errors.ConfigError` names the one that is not), and
            a script must guard its entry point with ``if __name__ ==
            "__main__":``.

    Raises:
        ValueError: an option is invalid, or an epoch would have no batch on
            some rank (an empty source, fewer samples than ranks, or, with
            ``drop_last=True``, ``batch_size`` above the shard size); the message
            names the numbers.

    Attributes:
        source: The source the feeder reads.
        seed: The base seed in use (drawn from torch's generator when ``seed=None``;
            rank 0's under ``torch.distributed``).
        last_batch: A :class:`BatchInfo` for the batch ``next()`` last returned
            (its epoch, its number in the epoch, its samples' source indices).
        sampler: A sampler-like handle: ``feeder.sampler.set_epoch(e)`` is
            ``feeder.set_epoch(e)`` (Lightning calls it on a loader's ``sampler``).

    One pass at a time: a pass starts at its iterator's first ``next()`` and
    stops an unfinished one, whose iterator then raises a
    :class:`~feeder.FeederError`. ``close()`` is safe from any thread and twice.

    The docs site says more: "Getting started" and "From DataLoader" (defaults
    and output), the guides (``docs/guides/``: resume, distributed, trainers,
    isolation, reliability), and the design notes ``docs/design/memory.md``
    (the memory formula) and ``docs/design/how-it-works.md``.
    """

    def __init__(self, source: Source, batch_size: int, transforms: Sequence[Any] = (),
                 **options: Any) -> None:
        # The options (keyword-only), their defaults and checks are declared once,
        # in _config.Config; the signature below is derived from it.
        if not (hasattr(source, "__len__") and callable(getattr(source, "read", None))):
            raise TypeError(f"source must have __len__ and read(index) -> (bytes, label); "
                            f"got {type(source).__name__}")
        self.config = cfg = Config.build(reads_may_block(source), batch_size=batch_size, **options)
        self.source = source
        self.chain = Chain(list(transforms), cfg.image_size, cfg.max_pixels, cfg.max_image_size,
                           cfg.size_divisibility)
        # Ranks are resolved again at every pass (see ``rank``): a feeder built
        # before init_process_group must shard once the group exists.
        self._given_shard = (cfg.rank, cfg.world_size)
        check_epoch(len(source), cfg.batch_size, cfg.drop_last, self.world_size)
        self._layout = shard_layout(source, cfg.shuffle, cfg.shuffle_window,
                                    cfg.shuffle_shards)  # checks the source
        reserve = getattr(source, "reserve_indices", None)
        if cfg.shuffle_shards is not None and reserve is not None:
            # A window and the next one's indices in memory at once (lazy indexing).
            reserve(2 * cfg.shuffle_shards + 2)
        # Drawn now from torch's generator (torch.manual_seed makes runs repeatable);
        # agreed on across ranks at the first pass that runs under torch.distributed.
        self.seed = cfg.seed if cfg.seed is not None else _local_seed(*self._given_shard)
        self._seed_agreed = cfg.seed is not None
        self.last_batch: BatchInfo | None = None
        self._next_epoch = 0
        self._progress: Progress | None = None  # the latest pass's
        # A loaded state's unfinished pass and the epoch to use after it (see load_state_dict).
        self._resume: tuple[Progress, int] | None = None
        note_jpeg_decoder()  # once per process: which JPEG decoder runs, and how to get the fast one
        self._engine: Engine
        if cfg.isolation == "process":
            from .isolation.engine import ProcessEngine
            self._engine = ProcessEngine(cfg, source, list(transforms))
        else:
            self._engine = ThreadEngine(cfg, source, self.chain)
        self.sampler = EpochSampler(self)
        self._dataset: FeederDataset | None = None  # made on first use
        # Stops the engine when an unclosed feeder is collected (see _reaper).
        self._watch = _reaper.watch(self, _close_when_collected, self._engine)
        log.debug("feeder built: %s", self.config)

    # A loader with a ``sampler`` has a ``batch_sampler`` too, for the trainers
    # that read both (Lightning); the feeder batches by itself.
    batch_sampler = None

    @property
    def dataset(self) -> FeederDataset:
        """The source as a map-style dataset: ``len(feeder.dataset)`` and
        ``feeder.dataset[i]`` (sample ``i`` decoded and transformed as in a
        batch, as ``(image, label)`` or ``(image, target)``), for the scripts
        and evaluation helpers that read ``loader.dataset``. See
        :class:`~feeder.FeederDataset`. Not a way to load batches."""
        # Accelerate's skip_first_batches rebuilds a DataLoader around
        # ``loader.dataset`` and would read every skipped sample through it,
        # one at a time: it alone gets the AttributeError saying what to use.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "accelerate" or caller.startswith("accelerate."):
            raise AttributeError(
                "Feeder cannot be rebuilt as a DataLoader around its dataset: to skip the first "
                "batches of an epoch use feeder.skip(num_batches) after feeder.set_epoch(epoch); "
                "to resume, feeder.load_state_dict(state)")
        if self._dataset is None:
            self._dataset = FeederDataset(self)
        return self._dataset

    # -- shape of an epoch --------------------------------------------------
    @property
    def image_size(self) -> tuple[int, int]:
        """(height, width) of the images in every batch; with ``max_image_size``, of
        the batch buffers (``max_image_size`` rounded up to ``size_divisibility``)."""
        return self.chain.image_size

    @property
    def num_buffers(self) -> int:
        """Batch buffers the pool holds (the memory bound; see the class docstring)."""
        return self.config.num_buffers

    @property
    def num_samples(self) -> int:
        """Samples in this rank's shard per epoch (see :meth:`shard_sizes`); with
        ``drop_last=True`` a short last batch of them is dropped too."""
        return shard_size(len(self.source), self.rank, self.world_size, self.config.drop_last)

    def shard_sizes(self) -> list[int]:
        """Samples each rank reads per epoch, by rank; the same list on every rank.

        With ``drop_last=True`` they are equal (``len(source) // world_size``).
        With ``drop_last=False`` they cover every sample once and the first
        ``len(source) % world_size`` ranks read one more, so ranks may run
        different numbers of batches (``ceil(size / batch_size)``): a training
        step with collective ops (DDP's gradient all-reduce) would then wait
        forever on the ranks that have finished.
        """
        return shard_sizes(len(self.source), self.world_size, self.config.drop_last)

    @property
    def rank(self) -> int:
        """This process's rank: as given, else ``torch.distributed``'s once it is
        initialized, else 0. Read again at every pass."""
        return _shard(*self._given_shard)[0]

    @property
    def world_size(self) -> int:
        """The number of ranks sharing the data (see :attr:`rank`)."""
        return _shard(*self._given_shard)[1]

    def __len__(self) -> int:
        """This rank's batches per epoch (fewer if samples are skipped under ``on_error="skip"``)."""
        return num_batches(self.num_samples, self.config.batch_size, self.config.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass: its order and randomness depend on (seed, epoch) alone.
        Without a call, each pass uses the previous pass's epoch + 1, starting at 0."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._next_epoch = epoch
        if self._resume is not None and self._resume[0].epoch != epoch:
            self._resume = None  # another epoch than the loaded state's unfinished one

    def skip(self, batches: int) -> None:
        """Start the next pass after its first ``batches`` batches, without reading them.

        What ``accelerator.skip_first_batches(loader, batches)`` does for a
        DataLoader, for the epoch the next pass takes: call :meth:`set_epoch`
        first (another ``set_epoch`` afterwards cancels the skip). Under
        ``torch.distributed`` every rank calls it at the same point, as it may
        agree on the seed as a first pass does. The skipped batches are the
        first ``batches * batch_size`` samples of this rank's order for that
        epoch: with ``ordered=True`` and ``on_error="raise"`` exactly the
        batches an uninterrupted pass delivers first, so the rest are that
        pass's batches, pixel for pixel, and ``last_batch.number`` continues the
        count. Otherwise every other sample comes once, in batches that may
        differ from the uninterrupted run's (a :meth:`state_dict` checkpoint
        resumes those exactly). ``skip(0)`` does nothing.

        Raises:
            ValueError: ``batches`` is not an int in ``[0, len(feeder))``, or a
                state loaded with :meth:`load_state_dict` already positions the
                next pass inside its epoch.
        """
        if isinstance(batches, bool) or not isinstance(batches, int) or not 0 <= batches < len(self):
            raise ValueError(f"batches must be an int in [0, len(feeder)) = [0, {len(self)}) (to skip "
                             f"a whole epoch, set_epoch(epoch + 1)), got {batches!r}")
        if batches == 0:
            return
        epoch = self._next_epoch
        if self._resume is not None:
            raise ValueError(f"the state given to load_state_dict already positions the next pass "
                             f"inside epoch {epoch}; skip() would skip batches of the resumed pass")
        # The order is cut from rank 0's seed: agree on it now, as a first pass would.
        self._ranks()
        # A resume of this epoch as if a pass had delivered those batches: the
        # same path as load_state_dict, so state_dict() before the pass keeps it.
        self._resume = (self._new_progress(epoch, Handled(batches * self.config.batch_size), (),
                                           batches), epoch + 1)

    def _pass_sequence(self, epoch: int, rank: int | None = None, seed: int | None = None) -> Any:
        """This rank's (or ``rank``'s) order of ``epoch``, as the sampler dispatches it."""
        c = self.config
        seed = self.seed if seed is None else seed
        order = pass_sequence(len(self.source), c.batch_size, c.shuffle, c.drop_last,
                              c.on_error == "skip", seed, epoch,
                              self.rank if rank is None else rank, self.world_size, self._layout)
        return group_sequence(order, self.source, c, self.chain, seed, epoch)

    def _new_progress(self, epoch: int, start: Handled | None = None, skipped: Any = (),
                      batches: int = 0) -> Progress:
        # The order is made at its first need, with the seed then agreed on.
        return Progress(epoch, len(self.source), lambda: self._pass_sequence(epoch), start,
                        skipped, batches)

    # -- checkpoints ---------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        """The settings that decide which samples a pass delivers, in which batches."""
        c = self.config
        return {"source_length": len(self.source), "seed": self.seed, "batch_size": c.batch_size,
                "shuffle": c.shuffle, "drop_last": c.drop_last, "ordered": c.ordered,
                "on_error": c.on_error, "rank": self.rank, "world_size": self.world_size,
                "image_size": tuple(self.image_size), "exif_orientation": c.exif_orientation,
                "transforms": describe_transforms(self.chain.transforms),
                **({"shuffle_window": c.shuffle_window} if c.shuffle == "shards" else {}),
                **({"shuffle_shards": c.shuffle_shards} if c.shuffle_shards is not None else {}),
                # Only when set: states saved before these options existed still load.
                **({"max_image_size": tuple(c.max_image_size),
                    "size_divisibility": c.size_divisibility}
                   if c.max_image_size is not None else {}),
                **({"group_by_aspect_ratio": c.group_by_aspect_ratio}
                   if c.group_by_aspect_ratio is not None else {})}

    def state_dict(self) -> dict[str, Any]:
        """Where the feeder stands, for a checkpoint: a small picklable dict.

        Taken between batches (before any pass, mid-pass or after one), it lets
        :meth:`load_state_dict` on a new feeder continue where this one stopped.
        It holds the epoch of an unfinished pass, the samples that pass has
        delivered and skipped, the next epoch, and the settings that decide the
        output (checked on load). Sources of up to ``COMPACT_ABOVE`` (2^19)
        samples write format 1: the delivered and skipped samples as one bit per
        source sample each. Longer ones write format 2, whose size does not grow
        with the epoch: ``position`` (every sample of this rank's order before it
        was delivered or skipped), ``after`` (the positions past it handled
        out of order: at most the samples that were in flight) and ``skipped``
        (the skipped samples' indices).
        """
        epoch: int | None = None
        delivered = skipped = None
        handled: Handled | None = None
        skipped_list: list[int] | None = None
        compact = len(self.source) > COMPACT_ABOVE
        batches = 0
        next_epoch = self._next_epoch
        if self._resume is not None:
            progress, next_epoch = self._resume
        else:
            progress = self._progress
            if progress is not None and progress.ended:
                progress = None
        if progress is not None:
            handled, skipped_list, batches = progress.compact()
            c = self.config
            if progress.batches and pass_finished(
                    handled.count(), len(self.source), c.batch_size, c.drop_last,
                    c.on_error == "skip", self.rank, self.world_size):
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
        if compact:
            return {"version": COMPACT_VERSION, "epoch": epoch, "next_epoch": next_epoch,
                    "batches": batches, "position": None if handled is None else handled.position,
                    "after": None if handled is None else list(handled.after),
                    "skipped": skipped_list, "skipped_total": self.stats().skipped,
                    "settings": self._settings()}
        return {"version": FORMAT_VERSION, "epoch": epoch, "next_epoch": next_epoch,
                "batches": batches, "delivered": delivered, "skipped": skipped,
                "skipped_total": self.stats().skipped, "settings": self._settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a feeder with the same source and settings.

        The next ``iter(feeder)`` finishes the saved unfinished pass (only the
        samples it had not delivered or skipped), then later passes continue the
        saved epoch numbering. ``set_epoch`` afterwards overrides the epoch as
        usual: another epoch than the unfinished pass's starts that epoch from
        its beginning. Thread counts and queue sizes may differ from the saving
        feeder's. A feeder built with ``seed=None`` takes the saved seed.

        With ``ordered=True`` and ``on_error="raise"`` a state saved by another
        rank of the same world size is accepted (trainers that write checkpoints
        from rank 0 only, as Lightning does under DDP): this rank continues its
        own shard after as many batches as the saving rank had delivered.

        Raises:
            ValueError: the state is not one of these, or a setting that decides
                the output differs (source length, seed, batch size, shuffle,
                drop_last, ordered, on_error, rank (see above), world_size, image
                size, transforms); the message names the field and both values.
        """
        version = state.get("version") if isinstance(state, dict) else None
        if version not in (FORMAT_VERSION, COMPACT_VERSION) or isinstance(version, bool):
            found = version if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a feeder state of format version {FORMAT_VERSION} or "
                             f"{COMPACT_VERSION} (got {found!r})")
        settings = state.get("settings")
        current = self._settings()
        if (self.config.seed is None and isinstance(settings, dict)
                and isinstance(settings.get("seed"), int) and not isinstance(settings["seed"], bool)
                and 0 <= settings["seed"] < 2**64):
            current["seed"] = settings["seed"]
        c = self.config
        saved_rank = current["rank"]
        world_size = current["world_size"]
        if (isinstance(settings, dict) and c.ordered and c.on_error == "raise"
                and settings.get("world_size") == world_size
                and isinstance(settings.get("rank"), int) and 0 <= settings["rank"] < world_size):
            # Another rank's state (a trainer that checkpoints from rank 0 only):
            # with ordered batches, every rank's position is its batch count,
            # and the ranks step together, so this rank continues from there.
            saved_rank = current["rank"] = settings["rank"]
        if isinstance(settings, dict):
            # Saved only when set (older states lack them): a state saved with
            # one of them must not load into a feeder without it.
            for name in _OPTIONAL_SETTINGS:
                if name in settings and name not in current:
                    current[name] = None
        check_settings(settings, current)
        epoch, next_epoch = state.get("epoch"), state.get("next_epoch")
        for name, value in (("epoch", epoch), ("next_epoch", next_epoch),
                            ("batches", state.get("batches"))):
            if not (value is None and name == "epoch") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"state[{name!r}] must be an int >= 0, got {value!r}")
        total = state.get("skipped_total")
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"state['skipped_total'] must be an int >= 0, got {total!r}")
        if epoch is None:
            for name in (("delivered", "skipped") if version == FORMAT_VERSION
                         else ("position", "after", "skipped")):
                if state.get(name) is not None:
                    raise ValueError(f"state[{name!r}] must be None when state['epoch'] is None "
                                     f"(no unfinished pass), got {type(state[name]).__name__}")
        resume = None
        if epoch is not None:
            length = len(self.source)
            skip = c.on_error == "skip"
            order = self._pass_sequence(epoch, saved_rank, current["seed"])
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
                handled, skipped_list = load_compact(state, order, length, c.batch_size, skip,
                                                     epoch)
            if c.ordered and c.on_error == "raise":
                # The delivered samples must be the head of the epoch's order,
                # else the rest would not be the uninterrupted run's batches.
                n = handled.count()
                whole = n in (state["batches"] * c.batch_size, len(order))
                if not whole or handled.after:
                    raise ValueError(f"state[{field!r}] is not the start of epoch {epoch}'s "
                                     f"order ({n} samples in {state['batches']} batches): the "
                                     f"state is damaged or from other settings")
                if saved_rank != self.rank:
                    mine = self._pass_sequence(epoch, self.rank, current["seed"])
                    handled = Handled(min(len(mine), state["batches"] * c.batch_size))
            resume = (self._new_progress(epoch, handled, skipped_list, state["batches"]),
                      next_epoch)
            if state["batches"] and pass_finished(handled.count(), length,
                                                  c.batch_size, c.drop_last, c.on_error == "skip",
                                                  self.rank, self.world_size):
                resume, epoch = None, None  # nothing left of that pass: continue with the next
        self.seed = current["seed"]
        self._resume = resume
        self._progress = None
        self._next_epoch = epoch if epoch is not None else next_epoch

    # -- iteration ---------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A new pass's iterator. The pass starts at its first ``next()``: until then
        nothing runs and no epoch number is used (trainers probe with ``iter()``
        and may call ``set_epoch`` between ``iter()`` and the first ``next()``).
        Starting stops any unfinished pass of this feeder.

        Raises:
            FeederError: the feeder is closed.
        """
        if self.closed:
            raise FeederError("the feeder is closed")
        return _PassIterator(self)

    def _ranks(self) -> tuple[int, int]:
        """(rank, world_size) now, with the seed agreed among the ranks once there
        are several (a collective call: every rank makes it at the same point)."""
        rank, world_size = self.rank, self.world_size
        if world_size > 1:
            check_epoch(len(self.source), self.config.batch_size, self.config.drop_last, world_size)
            if not self._seed_agreed:
                self.seed = _agreed_seed(self.seed, world_size)
                self._seed_agreed = True
        return rank, world_size

    def _start_pass(self) -> tuple[Pass, Progress]:
        """Start the next pass (the first ``next()`` of an iterator): take its epoch,
        resolve the ranks, agree on the seed, and start the threads."""
        rank, world_size = self._ranks()
        epoch = self._next_epoch
        resume = self._resume
        done = None
        if resume is not None and resume[0].epoch == epoch:
            progress, next_epoch = resume
            done = progress.handled()
        else:
            progress, next_epoch = self._new_progress(epoch), epoch + 1
        # The epoch and the resume are used up only once the pass is running: a
        # start that fails (a closed feeder, a rank contradiction) leaves them.
        run = self._engine.start_pass(self.seed, epoch, rank, world_size, done)
        self._next_epoch, self._resume = next_epoch, None
        progress.run = run
        self._progress = progress
        return run, progress

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        """Stop all threads; returns within about a second. Safe to repeat, from any thread."""
        self._engine.close()
        # Nothing is left for collection to do; the watch would only hold the engine.
        _reaper.unwatch(self._watch)

    @property
    def closed(self) -> bool:
        return self._engine.closed

    @property
    def start_method(self) -> str | None:
        """How the worker process was started with ``isolation="process"``:
        ``"fork"``, ``"spawn"`` or ``"forkserver"`` (``"auto"`` resolved; the
        reason is logged at INFO by ``feeder.isolation``); None with threads."""
        return getattr(self._engine, "start_method", None)

    def __enter__(self) -> "Feeder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> Stats:
        """A snapshot of where the pipeline's time went (prints as a table)."""
        return self._engine.stats()

    def __repr__(self) -> str:
        c = self.config
        return (f"Feeder({self.source!r}, batch_size={c.batch_size}, image_size={self.image_size}, "
                f"decode_threads={c.decode_threads}, augment_threads={c.augment_threads}, "
                f"device={str(c.device)!r})")


class _PassIterator:
    """The consumer's side of one pass.

    The pass starts at the first ``next()`` (see :meth:`Feeder.__iter__`); an
    iterator dropped before it leaves no trace. Several threads may share one
    iterator (a prefetching helper, a trainer's workers): exactly one pass
    starts, each batch goes to exactly one of them, and every one of them gets
    ``StopIteration`` at the end of the pass, or the pass's error.
    """

    def __init__(self, feeder: Feeder) -> None:
        self._feeder = feeder  # keeps the feeder alive while a pass is iterated
        self._run: Pass | None = None  # set once, by the first next()
        self._progress: Progress | None = None  # what state_dict() says this pass has delivered
        self._start_lock = threading.Lock()  # threads sharing a fresh iterator start one pass
        self._book = feeder._engine.book
        self._cuda = feeder.config.device.type == "cuda"
        self._timeout = feeder.config.timeout
        self._warned: set[int] = set()  # stuck samples already named in a warning
        # Threads that have been given the pass's error: each learns it once, and
        # a later next() ends the iterator (as after the error on one thread).
        self._told: set[int] = set()
        self._failure: BaseException | None = None
        self._failure_lock = threading.Lock()  # threads sharing this iterator move the error once

    def __iter__(self) -> "_PassIterator":
        return self

    def _start(self) -> Pass:
        with self._start_lock:
            if self._run is None:
                run, self._progress = self._feeder._start_pass()
                # Like DataLoader's iterator: once the loop drops it (a break, an
                # exception), its pass stops and its threads and buffers are freed.
                # The collector may free it while this very thread holds a pass
                # lock, so the stop runs in the reaper thread (see _reaper). Only a
                # weak reference: a pass holding its error, whose traceback holds
                # the iterator's frame, must not be kept alive by the finalizer registry.
                _reaper.watch(self, _stop_pass, weakref.ref(run))
                self._run = run
            return self._run

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        run = self._run
        if run is None:
            run = self._start()
        if run.orphaned:
            raise FeederError(
                "this pass was started before the process forked; its threads do not exist in "
                "this process. Start a new pass (iter(feeder)) in the child.")
        if run.output_ended:
            raise StopIteration
        t0 = time.perf_counter()
        pool = run.pool
        book = self._book
        pool.set_consumer_waiting(True)
        book.consumer_waiting(t0)
        try:
            item = self._get(run, t0)
        except Closed:
            self._closed(run)
        except BaseException:
            # KeyboardInterrupt (or anything else) while waiting: stop the pass
            # so no thread keeps working for a loop that has gone.
            run.stop()
            raise
        finally:
            pool.set_consumer_waiting(False)  # before claim() below: see BufferPool.acquire
            book.consumer_waiting(None)
        progress = self._progress
        assert progress is not None
        if item is END:
            # Other threads sharing this iterator may wait in get(): closing the
            # output wakes them, and they see the end too.
            run.output_ended = True
            progress.ended = True
            run.output.close()
            raise StopIteration
        if isinstance(item, Failure):
            run.fail(item.error)  # wakes the threads sharing this iterator: they raise it too
            err = self._take_error(run)
            self._told.add(threading.get_ident())
            raise err from err.__cause__
        assert isinstance(item, Delivery)
        images = item.images
        if item.lent is not None:
            pool.claim(item.lent)
        if self._cuda:
            stream = torch.cuda.current_stream(run.cfg.device)
            stream.wait_event(item.event)
            # See _transfer.py: keep the caching allocator from reusing these
            # blocks while the consumer's stream may still read them.
            for tensor in item.device_tensors():
                tensor.record_stream(stream)
        book.delivered(images.shape[0])
        progress.record(item.indices)
        self._feeder.last_batch = BatchInfo(run.epoch, progress.first_batch + item.number,
                                            torch.from_numpy(item.indices))
        return item.batch()

    def _get(self, run: Pass, t0: float) -> Any:
        """The next item of the pass's output; raises the timeout error past ``timeout``
        and names samples stuck for longer than ``STUCK_WARNING_S`` while it waits."""
        timeout = self._timeout
        while True:
            wait = _WATCH_S
            if timeout is not None:
                wait = min(wait, t0 + timeout - time.perf_counter())
            try:
                return run.output.get(timeout=max(wait, 0.0))
            except TimeoutError:
                pass
            waited = time.perf_counter() - t0
            if timeout is not None and waited >= timeout:
                # The pass's error: threads sharing this iterator raise it too.
                run.fail(FeederTimeoutError(_timeout_message(run, timeout, waited)))
                self._told.add(threading.get_ident())
                raise self._take_error(run) from None
            for phase, index, path, age in run.in_flight(STUCK_WARNING_S):
                if index not in self._warned:
                    self._warned.add(index)
                    log.warning("sample %d (%s) has been in stage %r for %.0f s; the training "
                                "loop is waiting for it (Feeder(timeout=...) turns this into an "
                                "error)", index, safe_text(path), phase, age)

    def _closed(self, run: Pass) -> None:
        """The pass's output was closed while (or before) this thread waited: say why."""
        me = threading.get_ident()
        err = self._take_error(run)
        if err is not None and me not in self._told:
            self._told.add(me)
            raise err from err.__cause__
        if run.was_replaced():
            raise FeederError(
                "this pass was stopped because a new pass of the same feeder started "
                "(iter(feeder) again, e.g. an evaluation loop or zip(feeder, feeder)) before "
                "it ended; use one pass at a time, or a second Feeder for the other loop")
        raise StopIteration from None

    def _take_error(self, run: Pass) -> BaseException | None:
        """The pass's error, moved into this iterator. Once raised, its traceback holds
        this iterator's frame; left in the pass (which the feeder's finalizer keeps
        reachable), it would keep the iterator and the feeder alive for good."""
        with self._failure_lock:
            err = self._failure
            if err is None:
                err = run.error
                if err is not None:
                    self._failure = err
                    run.error = None
            return err

    def __len__(self) -> int:
        return len(self._feeder)


def _timeout_message(run: Pass, timeout: float, waited: float) -> str:
    stuck = run.in_flight(timeout)
    msg = f"no batch within timeout={timeout:g} s (waited {waited:.1f} s)"
    if stuck:
        rows = "; ".join(f"sample {index} ({safe_text(path)}) in stage {phase!r} for {age:.1f} s"
                         for phase, index, path, age in stuck[:8])
        more = f" and {len(stuck) - 8} more" if len(stuck) > 8 else ""
        return f"{msg}: {rows}{more}"
    busy = run.in_flight()
    return (f"{msg}; no sample has been in a stage for that long "
            f"({len(busy)} in flight): the pipeline is slower than the timeout allows")


def _local_seed(rank: int | None, world_size: int | None) -> int:
    """The seed of ``seed=None``: from torch's generator; 0 when ranks are given by
    hand with no process group to agree through (as ``DistributedSampler`` does)."""
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    dist = torch.distributed
    if world_size is not None and world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        log.info("seed=None with world_size=%d and no torch.distributed: using seed 0 on every rank",
                 world_size)
        return 0
    return seed


def _agreed_seed(seed: int, world_size: int) -> int:
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


def _shard(rank: int | None, world_size: int | None) -> tuple[int, int]:
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
    return _launcher_shard()


def _launcher_shard() -> tuple[int, int]:
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


Feeder.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
     inspect.Parameter("source", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Source),
     inspect.Parameter("batch_size", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=int),
     inspect.Parameter("transforms", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=(),
                       annotation=Sequence[Any]),
     *signature_parameters()])
