"""The public :class:`Feeder`: configuration, passes, the consumer's side, shutdown."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .engine import reaper as _reaper
from .ops.chain import Chain
from .ops.compose import transform_list
from ._dataset import FeederDataset, refuse_a_rebuild
from .engine.config import Config
from ._consumer import BatchInfo, PassHooks, PassIterator
from .decode import note_jpeg_decoder
from .order.group import largest_image
from .engine.engine import Engine, ThreadEngine, close_when_collected as _close_when_collected
from .engine.pipeline import Pass
from .engine.ranks import EpochSampler, Ranks
from .order.cursor import Cursor
from .order.progress import Progress
from .engine.stats import Stats
from .order.epoch import check_epoch, num_batches, shard_size, shard_sizes
from .order.plan import EpochPlan
from .errors import FeederError
from ._keywords import OPTION_NAMES as _OPTION_NAMES
from ._keywords import answer_unknown_keywords as _answer_unknown_keywords
from .sources import Source
from .sample import DEFAULT_MAX_PIXELS

log = logging.getLogger(__name__)


class Feeder:
    """Feeds batches of images to a training loop from one process, with thread pools.

    Iterate it in the training loop: each pass yields ``(images, labels)`` with
    ``images`` a ``[B, 3, H, W]`` tensor on ``device`` (uint8 in channels_last
    layout by default; see ``memory_format``) and ``labels`` an int64 ``[B]`` tensor on ``device``
    (float, multi-hot or vector labels: a ``[B, ...]`` tensor of their dtype). A
    source whose ``read`` returns dicts (``"image"``, ``"mask"``, ``"boxes"``,
    ``"label"``...) yields dicts with the same keys (see
    [Segmentation and masks](../guides/segmentation.md)).

    Args:
        source: An :class:`~feeder.ImageFolder`, a :class:`~feeder.FileList`, or any
            object with ``__len__`` and ``read(index) -> (encoded_bytes, label)``
            or a dict of fields (see :func:`feeder.check_sample`).
        batch_size: Samples per batch.
        transforms: CPU transforms on uint8 HWC RGB arrays (see :mod:`feeder.ops`),
            or plain callables ``fn(img, rng) -> img``.
        decode_threads: Threads reading and decoding; ``"auto"``: one per core (at
            least 2); ``"tune"``: the ``"auto"`` count, of which only the threads the
            loop needs run (see [Performance tuning](../guides/performance.md)).
        augment_threads: Threads running the transforms; 0: in the decode threads;
            ``"auto"``: 0 (measured fastest); ``"tune"``: a pool of the decode
            pool's ``"auto"`` count, tuned as ``decode_threads="tune"``.
        read_threads: Threads calling ``source.read`` ahead of the decode threads,
            so that a read waiting on storage never idles a core; 0: the decode
            threads read; ``"auto"``: 16 per decode thread, within [16, 128], when
            the source's reads may wait on storage (measured when it does not say),
            else 0; ``"tune"``: as ``decode_threads`` (see [Performance
            tuning](../guides/performance.md#threads-and-cores)).
        read_ahead_bytes: Most bytes read and not yet taken by a decode thread
            (default 64 MiB); with ``read_threads``, it bounds the read-ahead.
        queue_size: Finished batches buffered ahead of the training loop.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``"cuda"`` is the current
            device of the thread whose ``next()`` starts each pass, so a feeder
            built before ``torch.cuda.set_device(local_rank)`` delivers on that
            rank's GPU (see [The CUDA transfer](../design/cuda-transfer.md)).
        dtype: Output dtype; a floating dtype scales to [0, 1]. Converted on
            ``device`` after the copy, so only uint8 crosses the bus.
        normalize: ``(mean, std)``, three values each on the [0, 1] scale (as
            torchvision's ``Normalize`` after ``ToTensor``); implies float32
            unless ``dtype`` is given.
        memory_format: ``"channels_last"`` (default; a CPU uint8 batch is a view of
            a batch buffer) or ``"contiguous"`` (plain NCHW, made on ``device``);
            ``torch.channels_last`` and ``torch.contiguous_format`` are accepted too.
        shuffle: Shuffle each epoch (seeded by ``seed`` and the epoch); off by
            default, as in ``DataLoader``. ``"shards"``: the order for streaming
            storage, shards shuffled and samples within windows (see [Packed
            shards](../guides/shards.md#order-for-streaming-storage)).
        shuffle_window: Samples per shuffle window with ``shuffle="shards"``.
        shuffle_shards: With ``shuffle="shards"``, windows of this many whole
            shards, each read once per epoch (see [Web-scale
            datasets](../guides/web-scale.md)); None: windows of ``shuffle_window``.
        seed: Base seed of the order and of every transform's randomness; by
            default drawn from torch's default generator (so ``torch.manual_seed``
            makes runs repeatable, as with DataLoader).
        drop_last: Drop a last batch smaller than ``batch_size`` and give every rank
            ``len(source) // world_size`` samples, as DDP training needs. False: the
            ranks' shards cover every sample once (see :meth:`shard_sizes`).
        ordered: True: batches and their contents depend only on the seed and
            epoch, not on thread counts or timing. False: batches in completion
            order (each sample still exactly once per epoch).
        on_error: ``"raise"``: a failing sample raises :class:`~feeder.SampleError`
            from ``next()``. ``"skip"``: it is dropped, counted and logged once,
            and later samples fill its place.
        max_skipped: With ``on_error="skip"``, raise once more than this many
            samples were skipped, counted over every epoch of this feeder object
            (a new feeder, as after a restart, starts from 0, whatever state
            it loads); None: no limit.
        rank: This process's shard of one shared order per epoch. Default: from
            ``torch.distributed``, else torchrun's ``RANK`` and ``WORLD_SIZE``, else
            0; read at each pass (see [Distributed and evaluation](../guides/distributed.md)).
        world_size: The number of shards (default: from ``torch.distributed``,
            as ``rank``).
        image_size: (height, width) of the output, when the transforms do not
            fix it themselves.
        max_image_size: (height, width) of the largest image, for transforms whose
            output size varies: batches are dicts with ``"image"`` zero-padded to
            the batch's largest and ``"size"`` (each image's ``[B, 2]`` valid size);
            ``"auto"``: the largest the transforms (or, without any, the source)
            can produce (see [Detection and boxes](../guides/detection.md)).
        size_divisibility: Variable sizes: pad each batch's height and width up
            to a multiple of it (32 for FPN backbones).
        mask_fill: Variable sizes: the value of padded mask pixels (255, the
            segmentation references' ignore index; up to 65535 for 16-bit masks:
            see [Segmentation and masks](../guides/segmentation.md)).
        group_by_aspect_ratio: Batch samples of similar aspect ratio together, as
            torchvision's ``GroupedBatchSampler``: True (its factor 3) or a factor
            ``k`` (0: landscape vs portrait), every sample still once per epoch
            (see [Detection and boxes](../guides/detection.md)).
        max_pixels: Largest decoded ``width * height`` accepted, checked from the
            header (decompression bombs); also the bound, in bytes, on one
            sample's per-instance ``"masks"`` (a :class:`~feeder.FieldError`).
        timeout: Seconds ``next()`` may wait for a batch before it raises
            :class:`~feeder.FeederTimeoutError` naming the stuck samples; None waits
            forever (see [Reliability](../guides/reliability.md#stuck-storage)).
        exif_orientation: Apply the EXIF Orientation tag (JPEG, PNG, WebP, TIFF).
            False (default): pixels as stored, as torchvision's ``decode_jpeg``.
        jpeg_verify: With the JPEG region decoder, still read each distinct file to
            its end once, so that damage anywhere fails the sample (default True).
            False: stop after the crop, a faster first epoch that can miss damage
            (see [the JPEG region decoder](../guides/performance.md#the-jpeg-region-decoder)).
        jpeg_index_bytes: Memory for the JPEGs' row indexes (default 128 MiB; 0:
            none), so that a later crop of the same bytes decodes only its part of
            its rows (see [Memory](../design/memory.md)).
        batch_transforms: Transforms of whole batches on ``device``, after the
            dtype conversion, in the transfer thread: :class:`~feeder.ops.MixUp`,
            :class:`~feeder.ops.CutMix`, or ``fn(images, labels, generator) ->
            (images, labels)`` with ``generator`` seeded from (seed, epoch, batch);
            one that needs float images is refused with uint8 output.
        isolation: ``"thread"`` (default): threads of this process; ``"process"``:
            the same threads in one worker process writing batches into shared
            memory, never holding this process's GIL (see [Threads or a worker
            process](../guides/isolation.md)).
        start_method: How ``isolation="process"`` starts its worker: ``"auto"``
            (``"fork"`` where it is safe, else ``"spawn"``), ``"fork"``, ``"spawn"``
            or ``"forkserver"``; :attr:`start_method` says which ran.

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
            (its epoch, its number in the epoch, its samples' source indices and,
            for a :class:`~feeder.Mixture`, their source numbers).
        sampler: A sampler-like handle: ``feeder.sampler.set_epoch(e)`` is
            ``feeder.set_epoch(e)`` (Lightning calls it on a loader's ``sampler``).

    One pass at a time: a pass starts at its iterator's first ``next()`` and
    stops an unfinished one, whose iterator then raises a
    :class:`~feeder.FeederError`. ``close()`` is safe from any thread and twice.
    More: [From DataLoader](../from-dataloader.md), the guides
    ([Resume](../guides/resume.md), [Trainers](../guides/trainers.md),
    [Reliability](../guides/reliability.md)), [Memory](../design/memory.md) and
    [How it works](../design/how-it-works.md).
    """

    @_answer_unknown_keywords
    def __init__(self, source: Source, batch_size: int, transforms: Sequence[Any] = (), *,
                 decode_threads: int | str = "auto",
                 augment_threads: int | str = "auto",
                 read_threads: int | str = "auto",
                 read_ahead_bytes: int = 64 << 20,
                 queue_size: int = 4,
                 device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None,
                 normalize: tuple[Sequence[float], Sequence[float]] | None = None,
                 memory_format: str = "channels_last",
                 shuffle: bool | str = False,
                 shuffle_window: int = 8192,
                 shuffle_shards: int | None = None,
                 seed: int | None = None,
                 drop_last: bool = False,
                 ordered: bool = True,
                 on_error: str = "raise",
                 max_skipped: int | None = None,
                 rank: int | None = None,
                 world_size: int | None = None,
                 image_size: tuple[int, int] | None = None,
                 max_image_size: tuple[int, int] | str | None = None,
                 size_divisibility: int = 1,
                 mask_fill: int = 255,
                 group_by_aspect_ratio: int | bool | None = False,
                 max_pixels: int = DEFAULT_MAX_PIXELS,
                 timeout: float | None = None,
                 exif_orientation: bool = False,
                 jpeg_verify: bool = True,
                 jpeg_index_bytes: int = 128 << 20,
                 batch_transforms: Sequence[Any] = (),
                 isolation: str = "thread",
                 start_method: str = "auto") -> None:
        # The options are checked once, in engine/config.py's table (its defaults
        # equal these: tests/engine/test_config.py checks).
        options: dict[str, Any] = {name: value for name, value in locals().items()
                                   if name in _OPTION_NAMES}
        if not (hasattr(source, "__len__") and callable(getattr(source, "read", None))):
            raise TypeError(f"source must have __len__ and read(index) -> (bytes, label); "
                            f"got {type(source).__name__}")
        self.config = cfg = Config.build(batch_size=batch_size, **options)
        self.source = source
        transforms = transform_list(transforms)
        self.chain = Chain(transforms, cfg.image_size, cfg.max_pixels, cfg.max_image_size,
                           cfg.size_divisibility,
                           functools.partial(largest_image, source, cfg.exif_orientation))
        if cfg.max_image_size == "auto":
            # Resolved once, here: the engine (a worker process too) and the
            # resume state see the bound itself.
            self.config = cfg = dataclasses.replace(cfg, max_image_size=self.chain.max_image_size)
        _check_batch_fits(cfg.batch_size, self.chain.image_size)
        # Ranks are resolved again at every pass (see ``rank``): a feeder built
        # before init_process_group must shard once the group exists.
        self._ranks = Ranks(cfg.rank, cfg.world_size)
        check_epoch(len(source), cfg.batch_size, cfg.drop_last, self.world_size)
        # The one source of epoch orders, for the passes and for resume.
        self._plan = EpochPlan(source, cfg.order, self.chain)  # checks the source
        reserve = getattr(source, "reserve_indices", None)
        if cfg.shuffle_shards is not None and reserve is not None:
            # A window and the next one's indices in memory at once (lazy indexing).
            reserve(2 * cfg.shuffle_shards + 2)
        # Drawn now from torch's generator; agreed on across ranks at the first
        # pass that runs under torch.distributed.
        self._ranks.choose_seed(cfg.seed)
        self.last_batch: BatchInfo | None = None
        self._cursor = Cursor(cfg.order, cfg.decode, cfg.sizes, self._plan, self._ranks)
        note_jpeg_decoder()  # once per process: which JPEG decoder runs, and how to get the fast one
        self._engine: Engine
        if cfg.isolation == "process":
            from .isolation.engine import ProcessEngine
            self._engine = ProcessEngine(cfg, source, list(transforms))
        else:
            self._engine = ThreadEngine(cfg, source, self.chain, plan=self._plan)
        # The engine resolved the thread counts ("auto", "tune") for this source.
        self.config = self._engine.config
        self.sampler = EpochSampler(self)
        self._dataset: FeederDataset | None = None  # made on first use
        # Stops the engine when an unclosed feeder is collected (see _reaper).
        self._watch = _reaper.watch(self, _close_when_collected, self._engine)
        log.debug("feeder built: %s", self.config)

    @property
    def seed(self) -> int:
        return self._ranks.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._ranks.seed = value

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
        refuse_a_rebuild(sys._getframe(1).f_globals.get("__name__", ""))
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
        """Batch buffers the pool holds: the memory bound (see [Memory](../design/memory.md))."""
        return self.config.num_buffers

    @property
    def num_samples(self) -> int:
        """Samples in this rank's shard per epoch (see :meth:`shard_sizes`); with
        ``drop_last=True`` a short last batch of them is dropped too."""
        return shard_size(len(self.source), self.rank, self.world_size, self.config.drop_last)

    def shard_sizes(self) -> list[int]:
        """Samples each rank reads per epoch, by rank; the same list on every rank.

        Equal with ``drop_last=True``; with ``drop_last=False`` the first
        ``len(source) % world_size`` ranks read one more, so ranks may run different
        numbers of batches (see [Distributed and evaluation](../guides/distributed.md)).
        """
        return shard_sizes(len(self.source), self.world_size, self.config.drop_last)

    @property
    def rank(self) -> int:
        """This process's rank: as given, else ``torch.distributed``'s once it is
        initialized, else 0. Read again at every pass."""
        return self._ranks.shard()[0]

    @property
    def world_size(self) -> int:
        """The number of ranks sharing the data (see :attr:`rank`)."""
        return self._ranks.shard()[1]

    def __len__(self) -> int:
        """This rank's batches per epoch, for a pass that skips nothing.

        A pass that skips samples (``on_error="skip"``) ends short of it, with a
        warning (see [Reliability](../guides/reliability.md#errors)).
        """
        return num_batches(self.num_samples, self.config.batch_size, self.config.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass: its order and randomness depend on (seed, epoch) alone.
        Without a call, each pass uses the previous pass's epoch + 1, starting at 0.

        Raises:
            ValueError: ``epoch`` is not an int in ``[0, 2**64)`` (orders and
                randomness are keyed by 64 bits of it).
        """
        self._cursor.set_epoch(epoch)

    def skip(self, batches: int) -> None:
        """Start the next pass after its first ``batches`` batches, without reading them.

        Accelerate's ``skip_first_batches`` for the epoch the next pass takes: call
        :meth:`set_epoch` first; under ``torch.distributed``, on every rank at the
        same point (see [Resume](../guides/resume.md)).

        Raises:
            ValueError: ``batches`` is not an int in ``[0, len(feeder))``, or a
                state loaded with :meth:`load_state_dict` already positions the
                next pass inside its epoch.
        """
        self._cursor.skip(batches, len(self), self._shard_now)

    # -- checkpoints ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the feeder stands, for a checkpoint: a small picklable dict.

        Taken between batches (before any pass, mid-pass or after one), it lets
        :meth:`load_state_dict` on a new feeder continue where this one stopped:
        the unfinished pass's epoch and the samples it delivered and skipped, the
        next epoch, and the settings that decide the output (see
        [Resume](../guides/resume.md) and its formats in [Web-scale
        datasets](../guides/web-scale.md#resume-state-of-constant-size)).
        """
        return self._cursor.state_dict(lambda: self.stats().skipped)

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Continue from :meth:`state_dict` of a feeder with the same source and settings.

        The next ``iter(feeder)`` finishes the saved unfinished pass (only the
        samples it had not delivered or skipped), then later passes continue the
        saved epoch numbering; ``set_epoch`` afterwards works as usual. ``state``
        may also be the list of every rank's state, to resume under another world
        size (see [Resume](../guides/resume.md#elastic-resume-another-number-of-ranks)).

        Raises:
            ValueError: the state is not one of these, or a setting that decides
                the order or the output differs (the [Resume](../guides/resume.md)
                guide lists them); the message names the field and both values.
        """
        self._cursor.load_state_dict(state)

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
        cfg = self.config
        return PassIterator(PassHooks(self._start_pass, self._engine.book,
                                      self._delivered, self.__len__,
                                      cfg.device.type == "cuda", cfg.timeout))

    def _delivered(self, info: BatchInfo) -> None:
        """Record the batch ``next()`` returns (``last_batch``), with each sample's
        source number when the source can say (a :class:`~feeder.Mixture`)."""
        source_of = getattr(self.source, "source_of", None)
        if source_of is not None:
            info = dataclasses.replace(info, sources=torch.from_numpy(source_of(info.indices.numpy())))
        self.last_batch = info

    def _shard_now(self) -> tuple[int, int]:
        """(rank, world_size) now, the seed agreed (a collective call: see :meth:`Ranks.for_pass`)."""
        return self._ranks.for_pass(len(self.source), self.config.batch_size, self.config.drop_last)

    def _next_pass_indices(self) -> Iterator[int]:
        """``iter(feeder.sampler)``: the sample indices the next pass dispatches on
        this rank, in order (after :meth:`skip` or :meth:`load_state_dict`, only
        those it has left). Not a collective call (see :meth:`Ranks.check_agreed`)."""
        self._ranks.check_agreed()
        self._shard_now()
        order = self._cursor.next_order()
        return (int(i) for chunk in order.chunks(4096) for i in chunk)

    def _start_pass(self) -> tuple[Pass, Progress]:
        """Start the next pass (the first ``next()`` of an iterator): take its epoch,
        resolve the ranks, agree on the seed, and start the threads."""
        rank, world_size = self._shard_now()
        return self._cursor.start(lambda epoch, done: self._engine.start_pass(
            self.seed, epoch, rank, world_size, done))

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

    @property
    def worker_pid(self) -> int | None:
        """The process id of the worker process with ``isolation="process"`` (for
        ``py-spy dump --pid``, ``top -p``, or a test that kills it); None with
        threads and once the feeder is closed."""
        process = getattr(self._engine, "process", None)
        return None if process is None or self.closed else process.pid

    def __enter__(self) -> "Feeder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> Stats:
        """A snapshot of where the pipeline's time went (prints as a table)."""
        return self._engine.stats()

    def __repr__(self) -> str:
        cfg = self.config
        return (f"Feeder({self.source!r}, batch_size={cfg.batch_size}, image_size={self.image_size}, "
                f"decode_threads={cfg.decode_threads}, augment_threads={cfg.augment_threads}, "
                f"device={str(cfg.device)!r})")


def _check_batch_fits(batch_size: int, image_size: tuple[int, int]) -> None:
    """Refuse, when the feeder is built, a batch whose uint8 images alone exceed the
    machine's memory (a batch buffer holds them; it is allocated at the first
    pass, where torch's allocator would say it in its own words)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return
    need = batch_size * image_size[0] * image_size[1] * 3
    if memory > 0 and need > memory:
        raise ValueError(f"batch_size={batch_size} of {image_size[0]}x{image_size[1]} images "
                         f"needs {need / 2**30:,.1f} GiB for one batch buffer, more than this "
                         f"machine's {memory / 2**30:,.1f} GiB of memory")
