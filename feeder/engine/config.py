"""The feeder's configuration: the option table (one frozen dataclass), each
option's check (:mod:`feeder.engine.checks`) and the options that depend on each
other. What depends on the machine or the source (the thread counts' ``"auto"``
and ``"tune"``) is resolved where the pipeline is built: :meth:`Config.resolved`,
called by the engines, with :func:`~feeder.engine.threads.resolve_threads`.

The table is where options are declared and checked; the components read them
as small typed records, one per concern, made with the :class:`Config` (see
:data:`RECORDS`): each component is handed its own, never the whole table.
The design note ``docs/design/options.md`` walks some options to where they act."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from .checks import (DATALOADER_KEYWORDS, DEFAULT_GROUP_FACTOR, MAX_POOL_THREADS, ON_ERROR,
                     START_METHODS, check_batch_transforms, check_choice, check_dtype, check_flag,
                     check_group_option, check_image_size_option, check_mask_fill,
                     check_max_image_size, check_memory_bytes, check_memory_format, check_normalize,
                     check_normalize_range, check_optional_count, check_optional_positive,
                     check_optional_rank, check_positive, check_seed, check_shuffle,
                     check_start_method, check_threads, check_timeout, option, parse_device,
                     resolve_device, unknown_options_message)
from .on_device import OutputOptions
from .stage import ErrorOptions
from .threads import ThreadOptions, reads_may_block, resolve_threads
from ..decode.step import DecodeOptions
from ..errors import ConfigError
from ..order.plan import OrderOptions
from ..sample import DEFAULT_MAX_PIXELS
from ..sample.sizes import SizeOptions

# Names of the checks module that were this module's: still importable here.
__all__ = ["Config", "DATALOADER_KEYWORDS", "DEFAULTS", "DEFAULT_GROUP_FACTOR", "IsolationOptions",
           "MAX_POOL_THREADS", "RECORDS", "START_METHODS", "parse_device", "reads_may_block",
           "resolve_device", "unknown_options_message"]


@dataclass(frozen=True)
class IsolationOptions:
    """The feeder options that decide where the CPU stages run (see ``Feeder``'s
    arguments of the same names)."""

    isolation: str = "thread"
    start_method: str = "auto"


@dataclass(frozen=True)
class Config:
    """Every Feeder option, declared once: its name, default and check. ``Feeder``'s
    signature, its validation and :data:`DEFAULTS` are derived from these fields.
    Built by :meth:`build`; the thread counts as given until :meth:`resolved`.
    See :class:`feeder.Feeder`."""

    batch_size: int = option(None, check_positive)
    decode_threads: int | str = option("auto", check_threads(1, tune=True))
    augment_threads: int | str = option("auto", check_threads(0, tune=True))
    read_threads: int | str = option("auto", check_threads(0, tune=True))
    read_ahead_bytes: int = option(64 << 20, check_positive)
    queue_size: int = option(4, check_positive)
    device: torch.device = option("cpu", lambda name, v: parse_device(v))
    dtype: torch.dtype | None = option(None, check_dtype)
    normalize: tuple[tuple[float, float, float], tuple[float, float, float]] | None = option(None, check_normalize)
    memory_format: str = option("channels_last", check_memory_format)
    shuffle: bool | str = option(False, check_shuffle)
    shuffle_window: int = option(8192, check_positive)
    shuffle_shards: int | None = option(None, check_optional_positive)
    seed: int | None = option(None, check_seed)
    drop_last: bool = option(False, check_flag)
    ordered: bool = option(True, check_flag)
    on_error: str = option("raise", check_choice(*ON_ERROR))
    max_skipped: int | None = option(None, check_optional_count)
    rank: int | None = option(None, check_optional_rank)
    world_size: int | None = option(None, check_optional_rank)
    image_size: tuple[int, int] | None = option(None, check_image_size_option)
    max_image_size: tuple[int, int] | str | None = option(None, check_max_image_size)
    size_divisibility: int = option(1, check_positive)
    mask_fill: int = option(255, check_mask_fill)
    group_by_aspect_ratio: int | None = option(False, check_group_option)
    max_pixels: int = option(DEFAULT_MAX_PIXELS, check_positive)
    timeout: float | None = option(None, lambda name, v: check_timeout(v))
    exif_orientation: bool = option(False, check_flag)
    jpeg_verify: bool = option(True, check_flag)
    jpeg_index_bytes: int = option(128 << 20, check_memory_bytes)
    batch_transforms: tuple[Any, ...] = option((), check_batch_transforms)
    isolation: str = option("thread", check_choice("thread", "process"))
    start_method: str = option("auto", check_start_method)

    @classmethod
    def build(cls, **options: Any) -> "Config":
        """Check every option (unknown names are a TypeError, as for any call) and
        resolve the ones that depend only on other options. The thread counts stay
        as given (``"auto"``, ``"tune"``): see :meth:`resolved`."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(unknown_options_message(unknown, list(known)))
        values = {name: f.metadata["check"](name, options.get(name, f.default))
                  for name, f in known.items()}
        _resolve_output(values)
        _check_combinations(values, options)
        return cls(**values)

    def resolved(self, source: Any = None, *, reads_block: bool | None = True,
                 cores: int | None = None) -> "Config":
        """This configuration with its thread counts' ``"auto"`` and ``"tune"``
        resolved for ``source`` on this machine (see
        :func:`~feeder.engine.threads.resolve_threads`); itself when nothing is
        left to resolve. Without a source, ``reads_block`` says whether its reads
        may wait (see :func:`~feeder.engine.threads.reads_may_block`)."""
        if source is not None:
            reads_block = reads_may_block(source, windowed=self.shuffle_shards is not None)
        threads = resolve_threads(self.threads, reads_block, cores)
        if threads is self.threads:  # nothing was left to resolve
            return self
        return replace(self, decode_threads=threads.decode_threads,
                       augment_threads=threads.augment_threads,
                       read_threads=threads.read_threads)

    def __post_init__(self) -> None:
        # Every record is made with the Config (by build, and again by each
        # dataclasses.replace), so none is ever stale, and each mode is decided
        # once here: "variable size" is sizes.padding, a Padding or None.
        for name in RECORDS:
            getattr(self, name)

    # -- the records: each component's own options --------------------------------
    @functools.cached_property
    def threads(self) -> ThreadOptions:
        """The stages' thread counts and queue sizes."""
        return ThreadOptions(self.decode_threads, self.augment_threads, self.read_threads,
                             self.read_ahead_bytes, self.queue_size)

    @functools.cached_property
    def order(self) -> OrderOptions:
        """Which samples each pass dispatches, in which order and batches."""
        return OrderOptions(batch_size=self.batch_size, shuffle=self.shuffle,
                            shuffle_window=self.shuffle_window, shuffle_shards=self.shuffle_shards,
                            drop_last=self.drop_last, skip=self.on_error == "skip",
                            group_by_aspect_ratio=self.group_by_aspect_ratio,
                            exif_orientation=self.exif_orientation, ordered=self.ordered,
                            seed=self.seed, rank=self.rank, world_size=self.world_size)

    @functools.cached_property
    def decode(self) -> DecodeOptions:
        """How samples are decoded."""
        return DecodeOptions(self.max_pixels, self.exif_orientation, self.jpeg_verify,
                             self.jpeg_index_bytes)

    @functools.cached_property
    def sizes(self) -> SizeOptions:
        """The images' sizes; ``sizes.padding``: variable sizes, decided once."""
        return SizeOptions(self.image_size, self.max_image_size, self.size_divisibility,
                           self.mask_fill)

    @functools.cached_property
    def output(self) -> OutputOptions:
        """What a delivered batch is: device, dtype, layout, batch transforms."""
        return OutputOptions(self.device, self.dtype, self.normalize, self.memory_format,
                             self.batch_transforms)

    @functools.cached_property
    def errors(self) -> ErrorOptions:
        """What a failing sample or a stalled pass does."""
        return ErrorOptions(self.on_error, self.max_skipped, self.timeout)

    @functools.cached_property
    def placement(self) -> IsolationOptions:
        """Where the CPU stages run: threads here, or a worker process."""
        return IsolationOptions(self.isolation, self.start_method)

    # -- figures derived from the records (the thread ones also read here) ------------
    @property
    def tune(self) -> bool:
        """Some pool is ``"tune"``: its threads are parked and woken while a pass runs."""
        return self.threads.tune

    def tuned(self) -> tuple[str, ...]:
        """The stages whose thread count is tuned (``"tune"`` on a pool that exists)."""
        return self.threads.tuned()

    @property
    def read_queue(self) -> int:
        return self.threads.read_queue

    @property
    def decode_queue(self) -> int:
        return self.threads.decode_queue

    @property
    def augment_queue(self) -> int:
        return self.threads.augment_queue

    @property
    def num_buffers(self) -> int:
        """Most batch buffers in the pool: ``queue_size`` finished batches waiting for
        the training loop, the batches being filled (enough to cover every sample
        that can be in flight, plus one), one being transferred and one held by the
        loop. The pool reaches it only while the loop is slower than the pipeline
        (see ``BufferPool.acquire``)."""
        filling = 1 + -(-self.threads.in_flight() // self.batch_size)
        return self.queue_size + filling + 2


#: The records a :class:`Config` is read through, by attribute: every option is
#: a field of exactly one (tests/engine/test_config.py checks); a record's field whose
#: metadata says ``derived`` is decided by other options, not an option itself.
RECORDS = {"threads": ThreadOptions, "order": OrderOptions, "decode": DecodeOptions,
           "sizes": SizeOptions, "output": OutputOptions, "errors": ErrorOptions,
           "placement": IsolationOptions}


def _resolve_output(values: dict[str, Any]) -> None:
    """Resolve the output dtype from ``dtype`` and ``normalize`` (in ``values``), and
    refuse batch transforms that need floating images with uint8 output."""
    dtype = values["dtype"]
    if values["normalize"] is not None:
        if dtype is None:
            dtype = torch.float32
        elif not dtype.is_floating_point:
            raise ValueError(f"normalize needs a floating dtype, got {dtype}")
        check_normalize_range(*values["normalize"], dtype)
    values["dtype"] = None if dtype == torch.uint8 else dtype
    if values["dtype"] is None:
        for t in values["batch_transforms"]:
            # Mixing uint8 pixels would truncate every blend: refuse it here,
            # not on the first batch.
            if getattr(t, "needs_float", False):
                raise ValueError(f"batch_transforms: {t!r} needs floating images, but the "
                                 f"feeder outputs uint8; give dtype=torch.float32 (or another "
                                 f"floating dtype) or normalize=(mean, std)")


def _check_combinations(values: dict[str, Any], options: dict[str, Any]) -> None:
    """Refuse options that contradict each other, or that would be silently ignored
    without another (``options``: as given)."""
    if (values["rank"] is None) != (values["world_size"] is None):
        raise ValueError(f"give both rank and world_size, or neither (got rank={values['rank']}, "
                         f"world_size={values['world_size']})")
    if values["shuffle_shards"] is not None and values["shuffle"] != "shards":
        raise ValueError(f"shuffle_shards={values['shuffle_shards']} is the window of the "
                         f"block shuffle of shuffle='shards', but shuffle="
                         f"{values['shuffle']!r}; give shuffle='shards' or leave "
                         f"shuffle_shards=None")
    if (options.get("shuffle_window", DEFAULTS["shuffle_window"]) != DEFAULTS["shuffle_window"]
            and (values["shuffle"] != "shards" or values["shuffle_shards"] is not None)):
        # Set but unused, it would be silently ignored: say what it needs. (Its
        # default passed explicitly, as Config.build(**DEFAULTS) does, is no mistake.)
        raise ValueError(f"shuffle_window={values['shuffle_window']} is the sample window of "
                         f"shuffle='shards' without shuffle_shards, but shuffle="
                         f"{values['shuffle']!r} and shuffle_shards={values['shuffle_shards']!r}; "
                         f"leave shuffle_window out (shuffle_shards=K windows replace it)")
    if values["isolation"] == "thread" and values["start_method"] != "auto":
        # A start method with threads would be silently ignored: say which option is missing.
        raise ConfigError(f"start_method={values['start_method']!r} applies to the worker "
                          f"process of isolation='process', but isolation='thread'; give "
                          f"isolation='process' or leave start_method at 'auto'")
    if values["max_image_size"] is None:
        # Both only shape variable-size batches: given alone they would do nothing.
        for name, default in (("size_divisibility", 1), ("mask_fill", 255)):
            if values[name] != default:
                raise ConfigError(f"{name}={values[name]!r} applies to variable-size batches: "
                                  f"give max_image_size=(height, width) too, or leave {name} "
                                  f"at {default}")
    else:
        for i, t in enumerate(values["batch_transforms"]):
            # A transform that would move images out of their "size" region.
            check = getattr(t, "check_variable_size", None)
            if check is not None:
                try:
                    check()
                except ValueError as exc:
                    raise ConfigError(f"batch_transforms[{i}]: {exc}") from None
    if values["max_image_size"] is not None and values["image_size"] is not None:
        raise ConfigError(f"give image_size (every image that size) or max_image_size "
                          f"(variable sizes up to it), not both; got image_size="
                          f"{values['image_size']}, max_image_size={values['max_image_size']}")
    if values["rank"] is not None and values["rank"] >= values["world_size"]:
        raise ValueError(f"need 0 <= rank < world_size, got rank={values['rank']}, "
                         f"world_size={values['world_size']}")


# The options' defaults, derived from the table above.
DEFAULTS = {f.name: f.default for f in fields(Config) if f.name != "batch_size"}
