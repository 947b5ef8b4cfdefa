"""Each Feeder option's check: the values it takes and the error naming it
otherwise, for the option table (:class:`feeder.engine.config.Config`), and the
answers to keywords that are DataLoader's."""

from __future__ import annotations

import difflib
import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import field
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..ops.base import foreign_transform
from ..ops.chain import image_size_pair

# Logged under the option table's name, as before these checks had a module of their own.
log = logging.getLogger("feeder.engine.config")

ON_ERROR = ("raise", "skip")


def check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_memory_bytes(name: str, value: object) -> int:
    """A number of bytes of this machine's memory (0 allowed)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}")
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such figure here
        ram = 1 << 48
    if value > ram:
        raise ValueError(f"{name} must be at most this machine's memory ({ram / 2**30:.1f} GiB), "
                         f"got {value!r} bytes")
    return value


def check_flag(name: str, value: object) -> bool:
    # bool("False") is True: a string or a number here is a mistake, not a flag.
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


# What the transfer stage can produce faithfully: uint8 as decoded, or a floating
# dtype scaled to [0, 1]. Other integer dtypes would wrap, bool would be all True.
_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_timeout(value: object) -> float | None:
    if value is None:
        return None
    if value == 0 and not isinstance(value, bool):
        # DataLoader's default, which means "no limit" there: a port passes it.
        raise ValueError("timeout=0 is DataLoader's 'no limit'; feeder's is timeout=None (the "
                         "default), and a positive number of seconds sets a limit")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"timeout must be None or a positive number of seconds, got {value!r}")
    return float(value)


def parse_device(device: str | torch.device) -> torch.device:
    """Check ``device`` (``"cpu"``, ``"cuda"`` or ``"cuda:N"``) without initializing CUDA.

    ``"cuda"`` keeps no index: it is resolved by :func:`resolve_device` when each
    pass starts, so a feeder built before ``torch.cuda.set_device(local_rank)``
    (the usual torchrun script: data first, model second) delivers on the rank's
    device, not on GPU 0 (tests/engine/test_cuda_logic.py, scripts/gpu-check "set_device
    after build"). Resolving here would also initialize CUDA, after which an
    isolated feeder's "auto" start method can no longer fork
    (tests/isolation/test_isolation_start.py).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def resolve_device(device: torch.device) -> torch.device:
    """The device a pass delivers to: ``device`` itself when it has an index (or is
    the CPU); for ``"cuda"``, the current device of the thread starting the pass
    (its first ``next()``), as ``torch.cuda.set_device`` left it."""
    if device.type != "cuda" or device.index is not None:
        return device
    index = torch.cuda.current_device()
    if not check_local_rank(index):
        check_thread(index)
    return torch.device("cuda", index)


_warned_ranks: set[tuple[Any, Any]] = set()


def check_local_rank(index: int) -> bool:
    """Warn (once per pair) when ``"cuda"`` resolves to a GPU other than the one
    torchrun's ``LOCAL_RANK`` names: a rank that iterates before its
    ``set_device(local_rank)``, or from a thread of its own (the current device
    is per thread), would otherwise deliver every batch to that GPU silently.
    Only where ``LOCAL_RANK`` indexes a visible GPU: a rank that sees one GPU
    (``CUDA_VISIBLE_DEVICES`` per rank) has it as GPU 0.

    Returns:
        Whether ``LOCAL_RANK`` names a visible GPU (then it alone is checked).
    """
    try:
        local = int(os.environ.get("LOCAL_RANK", ""))
    except ValueError:
        return False
    if not 0 <= local < torch.cuda.device_count():
        return False
    if local == index or (local, index) in _warned_ranks:
        return True
    _warned_ranks.add((local, index))
    log.warning(
        "device='cuda' resolved to cuda:%d, but LOCAL_RANK=%d: this thread's current device is "
        "not the rank's GPU (call torch.cuda.set_device(local_rank) before iterating, in the "
        "thread that iterates, or pass device=f'cuda:{local_rank}')", index, local)
    return True


def check_thread(index: int) -> None:
    """Warn (once per thread name) when ``"cuda"`` resolves to GPU 0 in a thread other
    than the main one on a machine with several GPUs: the current device is per
    thread, so a loop run from a helper thread gets GPU 0 whatever the main thread
    chose with ``set_device`` (without ``LOCAL_RANK`` to tell which GPU was meant)."""
    thread = threading.current_thread()
    if index != 0 or thread is threading.main_thread() or torch.cuda.device_count() < 2:
        return
    if ("thread", thread.name) in _warned_ranks:
        return
    _warned_ranks.add(("thread", thread.name))
    log.warning(
        "device='cuda' resolved to cuda:0 in thread %r, not the main thread: the current device "
        "is per thread, so torch.cuda.set_device in another thread does not apply here (call it "
        "in this thread, or pass device='cuda:N')", thread.name)


def option(default: Any, check: Callable[[str, Any], Any]) -> Any:
    """A Feeder option: its default and the check that validates (and resolves) a value."""
    return field(default=default, metadata={"check": check})


#: The most threads one pool may have: each is an OS thread with its own stack,
#: and even reads from high-latency storage want tens in flight, not thousands.
MAX_POOL_THREADS = 1024


def check_threads(minimum: int, tune: bool = False) -> Callable[[str, Any], Any]:
    """A thread count, or "auto" (resolved by Config.resolved, from the cores); with
    ``tune``, also "tune" (the "auto" count, parked and woken while it runs)."""
    def check(name: str, value: object) -> Any:
        if value == "auto" or (tune and value == "tune"):
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "a positive int" if minimum else "an int >= 0"
            choices = "'auto' or 'tune'" if tune else "'auto'"
            raise ValueError(f"{name} must be {kind}, {choices}, got {value!r}"
                             if tune else f"{name} must be {kind} or 'auto', got {value!r}")
        if value > MAX_POOL_THREADS:
            raise ValueError(f"{name}={value} is more than the {MAX_POOL_THREADS} threads a pool "
                             f"may have (each is an OS thread with its own stack)")
        return value
    return check


def check_shuffle(name: str, value: object) -> bool | str:
    if value == "shards" and isinstance(value, str):
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True, False or 'shards', got {value!r}")
    return bool(value)


def check_choice(*allowed: str) -> Callable[[str, Any], str]:
    def check(name: str, value: object) -> str:
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        return value  # type: ignore[return-value]
    return check


START_METHODS = ("auto", "fork", "forkserver", "spawn")


def check_start_method(name: str, value: object) -> str:
    if not isinstance(value, str) or value not in START_METHODS:
        raise ConfigError(f"{name} must be one of {START_METHODS} (how isolation='process' "
                          f"starts its worker), got {value!r}")
    return value


def check_optional_positive(name: str, value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
    return value


def check_optional_count(name: str, value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    return value


def check_dtype(name: str, value: object) -> torch.dtype | None:
    if value is not None and value not in _DTYPES:
        raise ValueError(f"{name} must be None, torch.uint8 or a floating dtype (float16, bfloat16, "
                         f"float32, float64), got {value!r}")
    return value  # type: ignore[return-value]


def check_normalize(name: str, value: object) -> Any:
    if value is None:
        return None
    try:
        mean, std = value  # type: ignore[misc]
        mean = tuple(float(m) for m in mean)
        std = tuple(float(s) for s in std)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be (mean, std) with 3 values each, got {value!r}") from exc
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"{name} must be (mean, std) with 3 values each, got {value!r}")
    for channel, (m, s) in enumerate(zip(mean, std)):
        if s == 0 or not math.isfinite(s):
            raise ValueError(f"{name}: std of channel {channel} must be finite and non-zero, "
                             f"got {s!r} (std={std})")
        if not math.isfinite(m):
            raise ValueError(f"{name}: mean of channel {channel} must be finite, got {m!r} "
                             f"(mean={mean})")
    return mean, std


def check_normalize_range(mean: tuple[float, ...], std: tuple[float, ...],
                           dtype: torch.dtype) -> None:
    """Refuse a ``(mean, std)`` whose conversion would give inf, NaN or zeros.

    The conversion computes ``x * (1 / (255 * std)) + (-mean / std)`` in float32
    (float64 for a float64 output) and rounds the result to ``dtype``: a std that
    is denormal or underflows there (1e-300 is 0 in float32) gives inf and NaN
    pixels, and an output range beyond ``dtype``'s largest value gives inf.
    """
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    work, out = torch.finfo(compute), torch.finfo(dtype)
    for channel, (m, s) in enumerate(zip(mean, std)):
        scale, shift = 1.0 / (255.0 * s), -m / s
        if abs(s) < work.tiny or not (work.tiny <= abs(scale) <= work.max) or abs(shift) > work.max:
            raise ValueError(f"normalize: std {s!r} of channel {channel} is out of {compute}'s "
                             f"normal range ({work.tiny:.3g} to {work.max:.3g}), where the "
                             f"conversion computes (x / 255 - mean) / std: the pixels would be "
                             f"inf or NaN")
        widest = max(abs(m / s), abs((1.0 - m) / s))  # the images' values span [0, 1] before
        if widest > out.max:
            raise ValueError(f"normalize: (mean {m!r}, std {s!r}) of channel {channel} maps "
                             f"[0, 1] pixels to values up to {widest:.3g}, beyond {dtype}'s "
                             f"largest {out.max:.3g}: the pixels would be inf")


def check_seed(name: str, value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value < 2**64):  # keys fold the seed to 64 bits
        raise ValueError(f"{name} must be None or an int in [0, 2**64), got {value!r}")
    return value


def check_optional_rank(name: str, value: object) -> int | None:
    minimum = 1 if name == "world_size" else 0
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"need 0 <= rank < world_size, got {name}={value!r}")
    return value


# torch's names for the two layouts, accepted as well as the strings.
_MEMORY_FORMATS = {"channels_last": "channels_last", torch.channels_last: "channels_last",
                   "contiguous": "contiguous", torch.contiguous_format: "contiguous"}


def check_memory_format(name: str, value: object) -> str:
    try:
        return _MEMORY_FORMATS[value]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(f"{name} must be 'channels_last' or 'contiguous' (or torch.channels_last, "
                         f"torch.contiguous_format), got {value!r}") from None


def check_batch_transforms(name: str, value: object) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of callables fn(images, labels, generator) -> "
                         f"(images, labels), got {value!r}")
    transforms = tuple(value)  # type: ignore[arg-type]
    for i, t in enumerate(transforms):
        foreign = foreign_transform(t, f"{name}[{i}]", batch=True)
        if foreign is not None:
            raise TypeError(foreign)
        if not callable(t):
            raise ValueError(f"{name}[{i}] must be callable fn(images, labels, generator) -> "
                             f"(images, labels), got {t!r}")
    return transforms


def check_image_size_option(name: str, value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        return image_size_pair(value)
    except ValueError:
        raise ValueError(f"{name} must be (height, width), two positive ints; got {value!r}") from None


def check_max_image_size(name: str, value: object) -> tuple[int, int] | str | None:
    # "auto": the transforms' largest output, resolved with the chain (Feeder).
    if isinstance(value, str) and value == "auto":
        return value
    try:
        return check_image_size_option(name, value)
    except ValueError:
        raise ValueError(f"{name} must be (height, width), two positive ints, or 'auto'; "
                         f"got {value!r}") from None


def check_mask_fill(name: str, value: object) -> int:
    # The padding of the mask planes: 255 is the ignore index of the
    # segmentation references (and of CrossEntropyLoss(ignore_index=255)); up
    # to 65535 for 16-bit masks whose classes include 255 (a padded batch's
    # masks then come as int64, as 16-bit masks do).
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= 65535:
        raise ValueError(f"{name} must be an int in [0, 65535] (the value of padded mask pixels), "
                         f"got {value!r}")
    return int(value)


# torchvision's detection reference: ``--aspect-ratio-group-factor 3`` (bins at
# 2 ** linspace(-1, 1, 2 * 3 + 1)), the value True stands for.
DEFAULT_GROUP_FACTOR = 3


def check_group_option(name: str, value: object) -> int | None:
    """False/None: no grouping; True: torchvision's default factor; an int k >= 0: its
    ``create_aspect_ratio_groups(k)`` bins (k=0: landscape vs portrait)."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_GROUP_FACTOR
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_) and 0 <= value <= 64:
        return int(value)
    raise ValueError(f"{name} must be True, False or a group factor k in [0, 64] (bins at "
                     f"2 ** linspace(-1, 1, 2k + 1) of width / height, as torchvision's "
                     f"create_aspect_ratio_groups), got {value!r}")


# DataLoader's keywords that are not feeder options, each with feeder's way of
# doing the same (docs/from-dataloader.md's table says the same at length): a
# port passes them first, and a list of 34 options does not say which to use.
DATALOADER_KEYWORDS = {
    "num_workers": "feeder uses threads: decode_threads=N (or 'auto', the default), and "
                   "isolation='process' to move the pipeline out of the training process",
    "pin_memory": "device='cuda' pins the batches and copies them on a side stream: they "
                  "arrive on the GPU",
    "pin_memory_device": "device='cuda:N' names the GPU the batches are copied to",
    "collate_fn": "feeder batches the fields itself: return a dict of fields from the "
                  "source's read (boxes become lists of per-image tensors), and pass "
                  "batch_transforms=[fn(images, labels, generator)] for work on whole batches",
    "sampler": "feeder orders the samples itself: shuffle, seed, rank/world_size (found "
               "from torch.distributed) and group_by_aspect_ratio",
    "batch_sampler": "feeder forms the batches itself: batch_size, drop_last, shuffle, seed, "
                     "rank/world_size (found from torch.distributed) and group_by_aspect_ratio",
    "generator": "seed=N fixes the order and every random transform",
    "worker_init_fn": "nothing runs per worker: feeder's threads share this process, so "
                      "set things up before building the Feeder",
    "prefetch_factor": "queue_size=N is the number of finished batches buffered ahead "
                       "of the training loop",
    "persistent_workers": "a Feeder keeps its buffers (and isolation='process''s worker) "
                          "across epochs until close(); its threads start with each pass, "
                          "without a process's start-up cost",
    "multiprocessing_context": "start_method='fork', 'spawn' or 'forkserver' says how "
                               "isolation='process' starts its one worker process",
    "in_order": "ordered=False delivers batches in completion order (the same samples)",
}


def unknown_options_message(unknown: list[str], known: list[str]) -> str:
    """The TypeError's text for keywords that are not options: DataLoader's are
    each answered with feeder's equivalent, others get a "did you mean"."""
    lines = [f"Feeder() got unexpected keyword argument(s): {', '.join(unknown)}"]
    strangers = False
    for name in unknown:
        if name in DATALOADER_KEYWORDS:
            lines.append(f"{name} is DataLoader's; {DATALOADER_KEYWORDS[name]}")
            continue
        strangers = True
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            lines.append(f"{name}: did you mean {close[0]}?")
    if strangers:
        lines.append(f"the options are: {', '.join(known)}")
    return "\n".join(lines)
