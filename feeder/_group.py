"""Aspect-ratio grouping (``Feeder(group_by_aspect_ratio=...)``): each pass's order
regrouped so that every batch holds images of one aspect-ratio group, as
torchvision's ``GroupedBatchSampler`` does, so variable-size batches carry
little padding.

The groups are torchvision's ``create_aspect_ratio_groups(k)``: width / height
quantized at the bins ``2 ** linspace(-1, 1, 2k + 1)`` (k=0: one bin at 1,
landscape vs portrait). The sizes come from ``source.image_sizes()`` when the
source has it (``feeder-pack``'s shards store them in their index), else from
each image's header, read once per source and process (cached with the source,
only for the samples a rank reads). A sample whose header cannot be read gets a
group of its own: decoding it fails the usual way (raised, or skipped and
counted under ``on_error="skip"``).

The regrouping is a permutation of the rank's samples for the epoch, a pure
function of that order and the sizes: every sample still exactly once,
deterministic in (seed, epoch, rank), and a resumed pass filters it as any other.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ._decode import header_size
from .sources import describe

log = logging.getLogger(__name__)

# Reads of headers run in a few threads: a read may wait on storage.
_READ_THREADS = 8
_UNKNOWN = -1

_cache: "weakref.WeakKeyDictionary[Any, np.ndarray]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _encoded(sample: Any) -> Any:
    """The encoded image of what ``source.read`` returned (a pair or a dict)."""
    if isinstance(sample, dict):
        return sample.get("image")
    if isinstance(sample, tuple) and len(sample) == 2:
        return sample[0]
    return None


def _read_size(source: Any, index: int, exif_orientation: bool) -> tuple[int, int]:
    try:
        data = _encoded(source.read(index))
        if not isinstance(data, (bytes, bytearray, memoryview)):
            return _UNKNOWN, _UNKNOWN
        return header_size(data, exif_orientation)
    except Exception as exc:  # noqa: BLE001 - the decode step reports it, naming the sample
        log.debug("aspect-ratio grouping: no size for sample %d (%s): %s", index,
                  describe(source, index), exc)
        return _UNKNOWN, _UNKNOWN


def image_sizes(source: Any, indices: Any, exif_orientation: bool = False) -> np.ndarray:
    """int64 ``[len(source), 2]`` (height, width) of the images, known at least at
    ``indices`` (-1 where unreadable or not asked for yet). From
    ``source.image_sizes()`` when the source has it, else read from the headers
    once and cached with the source."""
    given = getattr(source, "image_sizes", None)
    if callable(given):
        sizes = given()
        if sizes is not None:
            sizes = np.asarray(sizes, dtype=np.int64)
            if sizes.shape != (len(source), 2):
                raise ValueError(f"{type(source).__name__}.image_sizes() must give (height, width) "
                                 f"for each of its {len(source)} samples, got shape {sizes.shape}")
            return sizes
    try:
        with _lock:
            sizes = _cache.get(source)
            if sizes is None or len(sizes) != len(source):
                sizes = _cache[source] = np.full((len(source), 2), _UNKNOWN - 1, np.int64)
    except TypeError:  # a source that cannot be weakly referenced: read each pass
        sizes = np.full((len(source), 2), _UNKNOWN - 1, np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    missing = indices[sizes[indices, 0] < _UNKNOWN] if len(indices) else indices
    if len(missing):
        log.debug("aspect-ratio grouping: reading %d image headers", len(missing))
        with ThreadPoolExecutor(min(_READ_THREADS, len(missing)),
                                thread_name_prefix="feeder-sizes") as pool:
            found = list(pool.map(lambda i: _read_size(source, int(i), exif_orientation), missing))
        sizes[missing] = np.asarray(found, dtype=np.int64)
    return sizes


def group_ids(sizes: np.ndarray, factor: int) -> np.ndarray:
    """Each image's aspect-ratio group: the bin of width / height (torchvision's
    ``_quantize`` of ``create_aspect_ratio_groups(factor)``), -1 for an unknown size."""
    bins = 2 ** np.linspace(-1, 1, 2 * factor + 1) if factor > 0 else np.array([1.0])
    h, w = sizes[:, 0], sizes[:, 1]
    known = (h > 0) & (w > 0)
    ratio = np.where(known, w / np.where(known, h, 1), 1.0)
    groups = np.searchsorted(bins, ratio, side="right")  # bisect_right, as torchvision
    return np.where(known, groups, -1)


def aspect_ratio_groups(source: Any, factor: int, indices: Any,
                        exif_orientation: bool = False) -> np.ndarray:
    """The group of each sample of ``source`` (valid at ``indices``)."""
    return group_ids(image_sizes(source, indices, exif_orientation), factor)


def grouped_order(order: list[int], groups: np.ndarray, batch_size: int) -> list[int]:
    """``order`` regrouped into batches of one group (``GroupedBatchSampler``): walking
    ``order``, each group collects samples until it has ``batch_size``, which then
    form the next batch. What is left in the groups at the end follows, by group,
    in the last batches (torchvision repeats samples there instead; here every
    sample is delivered exactly once)."""
    pending: dict[int, list[int]] = {}
    out: list[int] = []
    for index in order:
        group = pending.setdefault(int(groups[index]), [])
        group.append(index)
        if len(group) == batch_size:
            out.extend(group)
            group.clear()
    for g in sorted(pending):
        out.extend(pending[g])
    return out


def group_pass_order(order: list[int], source: Any, factor: int, batch_size: int,
                     exif_orientation: bool = False) -> list[int]:
    """A pass's ``order`` regrouped by aspect ratio (the one place both the pass and
    the feeder's resume checks compute it)."""
    return grouped_order(order, aspect_ratio_groups(source, factor, order, exif_orientation),
                         batch_size)


def group_sequence(order: Any, source: Any, cfg: Any) -> Any:
    """A pass's :class:`~feeder._order.Order` regrouped when ``cfg`` (a Config or
    PassSettings) asks for grouping, else ``order`` itself: the one function the
    pass and the feeder's resume and skip use, so their positions agree.
    Grouping needs every size of the rank's samples, so it holds the rank's order
    as an array (sources of images to group are far below the lazy orders' sizes)."""
    factor = cfg.group_by_aspect_ratio
    if factor is None:
        return order
    from ._order import ArrayOrder

    grouped = group_pass_order(order[:], source, factor, cfg.batch_size, cfg.exif_orientation)
    return ArrayOrder(np.asarray(grouped, dtype=np.int64))
