"""The feeder's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ._decode import DEFAULT_MAX_PIXELS
from ._threads import auto_threads, available_cores

_ON_ERROR = ("raise", "skip")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _flag(name: str, value: object) -> bool:
    # bool("False") is True: a string or a number here is a mistake, not a flag.
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


# What the transfer stage can produce faithfully: uint8 as decoded, or a floating
# dtype scaled to [0, 1]. Other integer dtypes would wrap, bool would be all True.
_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _threads(name: str, value: object, auto: int, minimum: int = 1) -> int:
    if value == "auto":
        return auto
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive int" if minimum else "an int >= 0"
        raise ValueError(f"{name} must be {kind} or 'auto', got {value!r}")
    return value


def _timeout(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"timeout must be None or a positive number of seconds, got {value!r}")
    return float(value)


def parse_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s)")
    return dev


@dataclass(frozen=True)
class Config:
    """Validated feeder settings (``"auto"`` already resolved). See :class:`feeder.Feeder`."""

    batch_size: int
    decode_threads: int
    augment_threads: int
    queue_size: int
    device: torch.device
    dtype: torch.dtype | None
    normalize: tuple[tuple[float, float, float], tuple[float, float, float]] | None
    shuffle: bool
    drop_last: bool
    ordered: bool
    on_error: str
    max_skipped: int | None
    max_pixels: int
    timeout: float | None
    exif_orientation: bool

    @classmethod
    def build(cls, *, batch_size, decode_threads, augment_threads, queue_size, device, dtype,
              normalize, shuffle, drop_last, ordered, on_error, max_skipped, max_pixels,
              timeout, exif_orientation) -> "Config":
        auto_decode, auto_augment = auto_threads(available_cores())
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
        if max_skipped is not None and (isinstance(max_skipped, bool) or not isinstance(max_skipped, int)
                                        or max_skipped < 0):
            raise ValueError(f"max_skipped must be None or an int >= 0, got {max_skipped!r}")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype must be None, torch.uint8 or a floating dtype (float16, bfloat16, "
                             f"float32, float64), got {dtype!r}")
        if normalize is not None:
            try:
                mean, std = normalize
                mean = tuple(float(m) for m in mean)
                std = tuple(float(s) for s in std)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"normalize must be (mean, std) with 3 values each, got {normalize!r}") from exc
            if len(mean) != 3 or len(std) != 3:
                raise ValueError(f"normalize must be (mean, std) with 3 values each, got {normalize!r}")
            if any(s == 0 or not math.isfinite(s) for s in std):
                raise ValueError(f"normalize: std must be finite and non-zero, got {std}")
            if not all(math.isfinite(m) for m in mean):
                raise ValueError(f"normalize: mean must be finite, got {mean}")
            normalize = (mean, std)
            if dtype is None:
                dtype = torch.float32
        if dtype is not None and normalize is not None and not dtype.is_floating_point:
            raise ValueError(f"normalize needs a floating dtype, got {dtype}")
        return cls(
            batch_size=_positive("batch_size", batch_size),
            decode_threads=_threads("decode_threads", decode_threads, auto_decode),
            augment_threads=_threads("augment_threads", augment_threads, auto_augment, minimum=0),
            queue_size=_positive("queue_size", queue_size),
            device=parse_device(device),
            dtype=None if dtype == torch.uint8 else dtype,
            normalize=normalize,
            shuffle=_flag("shuffle", shuffle),
            drop_last=_flag("drop_last", drop_last),
            ordered=_flag("ordered", ordered),
            on_error=on_error,
            max_skipped=max_skipped,
            max_pixels=_positive("max_pixels", max_pixels),
            timeout=_timeout(timeout),
            exif_orientation=_flag("exif_orientation", exif_orientation),
        )

    # Queue capacities. Each pool needs a few items queued per thread so a
    # thread never idles between items; more only adds latency and memory.
    @property
    def decode_queue(self) -> int:
        return 4 * self.decode_threads

    @property
    def inline_augment(self) -> bool:
        """``augment_threads=0``: each decode thread runs the transforms on what it decoded."""
        return self.augment_threads == 0

    @property
    def augment_queue(self) -> int:
        return 4 * self.augment_threads

    @property
    def num_buffers(self) -> int:
        """Most batch buffers in the pool: ``queue_size`` finished batches waiting for
        the training loop, the batches being filled (enough to cover every sample
        that can be in flight, plus one), one being transferred and one held by the
        loop. The pool reaches it only while the loop is slower than the pipeline
        (see ``BufferPool.acquire``)."""
        in_flight = (self.decode_queue + self.augment_queue + self.decode_threads
                     + self.augment_threads)
        filling = 1 + -(-in_flight // self.batch_size)
        return self.queue_size + filling + 2


DEFAULTS = dict(decode_threads="auto", augment_threads="auto", queue_size=4, device="cpu",
                dtype=None, normalize=None, shuffle=True, drop_last=False, ordered=True,
                on_error="raise", max_skipped=None, max_pixels=DEFAULT_MAX_PIXELS, timeout=None,
                exif_orientation=False)
