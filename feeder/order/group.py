"""Aspect-ratio grouping (``Feeder(group_by_aspect_ratio=...)``): each pass's order
regrouped so that every batch holds images of one aspect-ratio group, as
torchvision's ``GroupedBatchSampler`` does, and, when the transforms can plan
each sample's size, of similar sizes, so variable-size batches carry little
padding. Still a permutation of the rank's samples, a pure function of the
order, the sizes (from the source, else each image's header: :func:`image_sizes`)
and the sample keys. The rules: docs/design/orders.md.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..decode import header_size
from ..sample import pixels_size
from ..sample.rng import epoch_key, index_key
from ..sources import describe

log = logging.getLogger(__name__)

# Reads of headers run in a few threads: a read may wait on storage.
_READ_THREADS = 8
_UNKNOWN = -1
# A size not read: not asked for yet, or the storage's answer was that the
# sample is absent (read again at the next need).
_NOT_READ = _UNKNOWN - 1
# The storage's own answer about one sample, not a failure of the storage: the
# decode step reports it naming the sample (a counted skip under
# on_error="skip"), as it does without grouping.
_ABSENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
#: Batches' worth of samples of one aspect group sorted by planned size at a time.
#: Larger windows pad less but let size, more than the epoch's order, decide who
#: shares a batch; 8 cuts most of the padding of detection's scale jitter (shorter
#: side 480..800) left by aspect groups alone (bench/experiments/variable_size.py
#: --padding; the figures: bench/results/variable_size_padding.txt).
SIZE_WINDOW = 8

# Header sizes read by the scan, per source and per exif_orientation (the sizes
# depend on both): {source: {exif_orientation: int64 [index_count(source), 2]}}.
_cache: "weakref.WeakKeyDictionary[Any, dict[bool, np.ndarray]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()
# Reads of one sample the scan tries before it fails: an OSError may be a
# transient storage failure, and a size it left unknown would change the order.
READ_ATTEMPTS = 3
# Seconds the scan's caller waits between looks at the stop flag.
_POLL_S = 0.05


class ScanError(RuntimeError):
    """The header scan could not read a sample's size (a storage failure)."""


class ScanStopped(Exception):
    """The header scan ended early: its ``stopped()`` became true (the pass stopped)."""


def _encoded(sample: Any) -> Any:
    """The image of what ``source.read`` returned (a pair or a dict)."""
    if isinstance(sample, dict):
        return sample.get("image")
    if isinstance(sample, tuple) and len(sample) == 2:
        return sample[0]
    return None


def _read_size(source: Any, index: int, exif_orientation: bool,
               give_up: threading.Event) -> tuple[int, int]:
    """The size of sample ``index`` from its header, (-1, -1) when its bytes hold
    no readable image (decoding it then fails the usual way, naming it): that
    depends on the bytes alone. A read that fails with another OSError is tried
    again and then raised as a :class:`ScanError`, never taken as an unknown size: the
    grouped order would then depend on the storage's luck in this process. A
    sample the storage says is absent (see :data:`_ABSENT`) is left unread
    (-2, -2): the pass reports it when it reads it, and a later scan reads it
    again."""
    for attempt in range(READ_ATTEMPTS):
        try:
            sample = source.read(index)
        except _ABSENT as exc:
            log.debug("aspect-ratio grouping: no size for sample %d (%s): %s", index,
                      describe(source, index), exc)
            return _NOT_READ, _NOT_READ
        except OSError as exc:
            if attempt + 1 == READ_ATTEMPTS or give_up.wait(0.1 * 2 ** attempt):
                raise ScanError(f"aspect-ratio grouping: reading sample {index} "
                                f"({describe(source, index)}) for its image size failed "
                                f"{attempt + 1} times: {type(exc).__name__}: {exc}; the grouped "
                                f"order needs every size (give the source image_sizes(), or "
                                f"fix the storage)") from exc
            continue
        except Exception as exc:  # noqa: BLE001 - the decode step reports it, naming the sample
            log.debug("aspect-ratio grouping: no size for sample %d (%s): %s", index,
                      describe(source, index), exc)
            return _UNKNOWN, _UNKNOWN
        break
    try:
        data = _encoded(sample)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            size = pixels_size(data)  # an image given decoded: its shape says
            return size if size is not None else (_UNKNOWN, _UNKNOWN)
        return header_size(data, exif_orientation)
    except Exception as exc:  # noqa: BLE001 - the decode step reports it, naming the sample
        log.debug("aspect-ratio grouping: no size for sample %d (%s): %s", index,
                  describe(source, index), exc)
        return _UNKNOWN, _UNKNOWN


def _scan(source: Any, missing: np.ndarray, exif_orientation: bool,
          stopped: Callable[[], bool]) -> np.ndarray:
    """The sizes of the samples ``missing``, read in a few daemon threads (interpreter
    exit never waits for them) that stop taking samples once ``stopped()`` is
    true or the caller leaves (an exception, Ctrl-C).

    Raises:
        ScanStopped: ``stopped()`` became true before the scan finished.
        ScanError: a sample could not be read (see :func:`_read_size`).
    """
    found = np.full((len(missing), 2), _NOT_READ, np.int64)
    give_up = threading.Event()
    errors: list[BaseException] = []
    taken = iter(range(len(missing)))
    take_lock = threading.Lock()

    def work() -> None:
        while not give_up.is_set():
            with take_lock:
                k = next(taken, None)
            if k is None:
                return
            try:
                found[k] = _read_size(source, int(missing[k]), exif_orientation, give_up)
            except BaseException as exc:  # noqa: BLE001 - handed to the scan's caller
                errors.append(exc)
                give_up.set()
                return

    threads = [threading.Thread(target=work, name=f"feeder-sizes-{i}", daemon=True)
               for i in range(min(_READ_THREADS, len(missing)))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                if stopped():
                    raise ScanStopped()
                t.join(_POLL_S)
    finally:
        give_up.set()  # the threads take no further sample: a read in progress ends alone
    if errors:
        raise errors[0]
    return found


def index_count(source: Any) -> int:
    """How many sample indices ``source`` has: ``len(source)``, or its
    ``index_count`` where an epoch is not one pass over them (a :class:`feeder.Mixture`)."""
    count = getattr(source, "index_count", None)
    return len(source) if count is None else int(count)


def _given_sizes(source: Any, exif_orientation: bool) -> np.ndarray | None:
    """The sizes the source gives itself: ``image_sizes()`` (as stored), or with
    ``exif_orientation`` ``oriented_image_sizes()`` (as oriented); None when it
    has no such method or it answers None."""
    name = "oriented_image_sizes" if exif_orientation else "image_sizes"
    given = getattr(source, name, None)
    if not callable(given):
        return None
    sizes = given()
    if sizes is None:
        return None
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.shape != (index_count(source), 2):
        raise ValueError(f"{type(source).__name__}.{name}() must give (height, width) "
                         f"for each of its {index_count(source)} samples, got shape {sizes.shape}")
    return sizes


def image_sizes(source: Any, indices: Any, exif_orientation: bool = False,
                stopped: Callable[[], bool] | None = None) -> np.ndarray:
    """int64 ``[index_count(source), 2]`` (height, width) of the images as decoded (oriented
    when ``exif_orientation``), known at least at ``indices`` (-1 where the bytes
    hold no readable header, -2 where not read: not asked for yet, or absent from
    the storage, see :func:`_read_size`). From the source when it gives them
    (see :func:`_given_sizes`), else read from the headers once and cached with
    the source and ``exif_orientation``.

    Args:
        stopped: Ends the header scan early (the pass's stop flag).

    Raises:
        ScanStopped: ``stopped()`` became true during the scan.
        ScanError: a read failed with an OSError on every attempt.
    """
    given = _given_sizes(source, exif_orientation)
    if given is not None:
        return given
    try:
        with _lock:
            per_source = _cache.setdefault(source, {})
            sizes = per_source.get(exif_orientation)
            count = index_count(source)
            if sizes is None or len(sizes) != count:
                sizes = per_source[exif_orientation] = np.full((count, 2), _NOT_READ, np.int64)
    except TypeError:  # a source that cannot be weakly referenced: read each pass
        sizes = np.full((index_count(source), 2), _NOT_READ, np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    missing = indices[sizes[indices, 0] < _UNKNOWN] if len(indices) else indices
    if len(missing):
        log.debug("aspect-ratio grouping: reading %d image headers", len(missing))
        sizes[missing] = _scan(source, missing, exif_orientation,
                               stopped if stopped is not None else (lambda: False))
    return sizes


def largest_image(source: Any, exif_orientation: bool = False) -> tuple[int, int] | None:
    """The largest height and the largest width of the source's images as decoded (see
    :func:`image_sizes`: every header read once, unless the source gives its sizes),
    for ``max_image_size="auto"`` over transforms that keep the decoded size; None
    when no sample's size can be read."""
    count = index_count(source)
    if count and _given_sizes(source, exif_orientation) is None:
        log.info("max_image_size='auto': reading the image headers of %d samples for the "
                 "largest decoded size", count)
    sizes = image_sizes(source, np.arange(count), exif_orientation)
    known = sizes[(sizes[:, 0] > 0) & (sizes[:, 1] > 0)]
    if not len(known):
        return None
    return int(known[:, 0].max()), int(known[:, 1].max())


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


def planned_sizes(chain: Any, sizes: np.ndarray, indices: Any, seed: int,
                  epoch: int) -> np.ndarray | None:
    """int64 ``[len(sizes), 2]``: the (height, width) ``chain`` will produce for each
    sample at ``indices`` in ``epoch`` (0 for an unknown header size, or where
    planning raised: decoding that sample reports it), or None when the chain
    cannot plan some sample's size."""
    planned = np.zeros(sizes.shape, np.int64)
    pass_key = epoch_key(seed, epoch)
    plan = chain.planned_output_size
    for index in np.asarray(indices, dtype=np.int64).tolist():
        h, w = sizes[index]
        if h <= 0 or w <= 0:
            continue
        try:
            size = plan(int(h), int(w), index_key(pass_key, index))
        except Exception as exc:  # noqa: BLE001 - the transform fails on the decoded sample too
            log.debug("aspect-ratio grouping: no planned size for sample %d: %s", index, exc)
            continue
        if size is None:
            return None
        planned[index] = size
    return planned


def grouped_order(order: list[int], groups: np.ndarray, batch_size: int,
                  areas: np.ndarray | None = None, window: int = SIZE_WINDOW) -> list[int]:
    """``order`` regrouped into batches of one group (``GroupedBatchSampler``): walking
    ``order``, each group collects samples until it has ``batch_size``, which then
    form the next batch. What is left in the groups at the end follows, by group,
    in the last batches (torchvision repeats samples there instead; here every
    sample is delivered exactly once).

    With ``areas`` (each sample's planned output area), a group collects
    ``window * batch_size`` samples instead, sorts them by area (ties in
    ``order``'s order) and cuts them into ``window`` batches, delivered in the
    order of their earliest sample in ``order``; at the end each group's rest is
    sorted and cut the same way, and what does not fill a batch follows, by group."""
    out: list[int] = []
    if areas is None:
        pending: dict[int, list[int]] = {}
        for index in order:
            group = pending.setdefault(int(groups[index]), [])
            group.append(index)
            if len(group) == batch_size:
                out.extend(group)
                group.clear()
        for g in sorted(pending):
            out.extend(pending[g])
        return out

    def batches(members: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        ranked = sorted(members, key=lambda m: int(areas[m[1]]))  # stable: ties by position
        return [ranked[k:k + batch_size] for k in range(0, len(ranked), batch_size)]

    def deliver(full: list[list[tuple[int, int]]]) -> None:
        for batch in sorted(full, key=lambda b: min(position for position, _ in b)):
            out.extend(index for _, index in batch)

    waiting: dict[int, list[tuple[int, int]]] = {}
    size = window * batch_size
    for position, index in enumerate(order):
        group = waiting.setdefault(int(groups[index]), [])
        group.append((position, int(index)))
        if len(group) == size:
            deliver(batches(group))
            group.clear()
    rest: list[int] = []
    for g in sorted(waiting):
        cut = batches(waiting[g])
        if cut and len(cut[-1]) < batch_size:
            rest.extend(index for _, index in cut.pop())
        deliver(cut)
    return out + rest


def group_pass_order(order: list[int], source: Any, factor: int, batch_size: int,
                     exif_orientation: bool = False, chain: Any = None, seed: int = 0,
                     epoch: int = 0, stopped: Callable[[], bool] | None = None) -> list[int]:
    """A pass's ``order`` regrouped by aspect ratio, and by planned size when
    ``chain`` makes variable sizes it can plan (the one place both the pass and the
    feeder's resume checks compute it). ``stopped`` ends a header scan early."""
    sizes = image_sizes(source, order, exif_orientation, stopped)
    areas = None
    if chain is not None and getattr(chain, "max_image_size", None) is not None:
        planned = planned_sizes(chain, sizes, order, seed, epoch)
        if planned is None:
            log.debug("aspect-ratio grouping: the transforms cannot plan every output size; "
                      "grouping by aspect ratio alone")
        else:
            areas = planned[:, 0] * planned[:, 1]
    return grouped_order(order, group_ids(sizes, factor), batch_size, areas)


def group_sequence(order: Any, source: Any, options: Any, chain: Any = None, seed: int = 0,
                   epoch: int = 0, stopped: Callable[[], bool] | None = None) -> Any:
    """A pass's :class:`~feeder.order.sequence.Order` regrouped when ``options`` (with
    ``group_by_aspect_ratio``, ``batch_size`` and ``exif_orientation``: the
    feeder's :class:`~feeder.order.plan.OrderOptions`) asks for grouping, else
    ``order`` itself. ``chain`` (the feeder's :class:`~feeder.ops.chain.Chain`),
    ``seed`` and ``epoch`` give the samples' planned sizes (see the module's
    docstring). Grouping needs every size of the rank's samples, so it holds the
    rank's order as an array (sources of images to group are far below the lazy
    orders' sizes). ``stopped`` (the pass's stop flag) ends a header scan early,
    raising :class:`ScanStopped`. Feeders call it through their
    :class:`~feeder.order.plan.EpochPlan`, which keeps the latest answers."""
    factor = options.group_by_aspect_ratio
    if factor is None:
        return order
    from .sequence import ArrayOrder

    grouped = np.asarray(group_pass_order(order[:], source, factor, options.batch_size,
                                          options.exif_orientation, chain, seed, epoch, stopped),
                         dtype=np.int64)
    grouped.flags.writeable = False
    return ArrayOrder(grouped)
