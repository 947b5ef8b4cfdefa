"""The packer behind :func:`feeder.pack.pack`: the source's samples read in a
thread pool (:class:`_Samples`), written in order into shards of at most
``shard_size`` bytes (:func:`_write_shards`, with
:class:`feeder.storage.packout.ShardWriter`), after the shards an interrupted
run completed, then the shard list. The layout is described in
:mod:`feeder.pack`.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..sources import ImageFolder
from ..storage.packinput import read_input, read_list_lines, regular_files
from ..storage.packout import ShardWriter, complete_shards, sha256, write_atomic
from ..storage.packsample import PackError, image_ext, name_sample, sample_members, shrink

_MANIFEST_KIND = "wids-shard-index-v1"


@dataclass
class PackResult:
    """What a pack wrote.

    Attributes:
        shards: Shard paths, in order.
        samples: Samples in all shards.
        resumed: Shards found complete from an earlier run (not rewritten).
        reencoded: Images re-encoded for ``max_side``.
        kept: Images kept as they were because they could not be decoded for
            ``max_side`` (they will fail when read for training, as the original
            would): their paths, or a source's descriptions of its samples.
        manifest: The shard list's path.
        skipped: Files of an ImageFolder or file list passed over because they
            are not regular files (a FIFO, a device, a socket named ``.jpg``),
            each with what it is: ``"path (FIFO)"``. They are never opened.
    """

    shards: list[str]
    samples: int
    resumed: int
    reencoded: int
    kept: list[str]
    manifest: str
    skipped: list[str] = field(default_factory=list)


def pack(source: Any, out_dir: str, *, shard_size: int = 64_000_000, name: str = "train",
         max_side: int | None = None, quality: int = 90, workers: int | None = None,
         overwrite: bool = False, progress: bool = False) -> PackResult:
    """Pack ``source`` into shards in ``out_dir``.

    Args:
        source: An ImageFolder root or a file list (paths), or any feeder source
            (an object with ``__len__`` and ``read``), pairs or dict samples
            (see :func:`sample_members` for how fields are stored).

    See the module docstring for the layout. Safe to rerun after an interruption
    (a source object is recognised by its class and length).

    Raises:
        PackError: ``out_dir`` holds a pack of this name made with other settings
            (and ``overwrite`` is false), or the source or one of its samples
            is unusable (naming the sample and the field).
        OSError: a source file cannot be read (the message names it).
    """
    _check_args(out_dir, name, max_side, quality, workers)
    samples = _Samples(source, max_side, quality)
    os.makedirs(out_dir, exist_ok=True)
    settings = {"source": samples.origin, "samples": samples.count, "shard_size": shard_size,
                "max_side": max_side, "quality": quality if max_side else None}
    manifest_path = os.path.join(out_dir, f"{name}.json")
    _claim(out_dir, name, settings, manifest_path, overwrite)
    # Shards complete from an earlier run: their indices say how many samples they hold.
    done = complete_shards(out_dir, name)
    shards, counts = [s for s, _ in done], [n for _, n in done]
    start = sum(counts)
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=samples.count, initial=start, unit="img", desc=f"feeder-pack {name}",
                   dynamic_ncols=True)
    loaded = samples.loaded(start, workers)
    try:
        _write_shards(loaded, out_dir, name, shard_size, shards, counts, bar)
    finally:
        loaded.close()  # on an error, the reads in flight end before it is raised
        if bar is not None:
            bar.close()
    manifest = {
        "__kind__": _MANIFEST_KIND, "wids_version": 1, "name": name,
        # filesize and sha256 let a reader check a copy of each shard (TarShards
        # does, for remote shards, before using a copy).
        # The image sizes are in each shard's index, not here: the list stays
        # small at any scale (see feeder.storage.tarindex).
        "shardlist": [{"url": os.path.basename(s), "nsamples": n, "filesize": os.path.getsize(s),
                       "sha256": sha256(s)}
                      for s, n in zip(shards, counts)],
        "classes": samples.classes,
        "feeder_pack": {**settings, "index_format": "dali-wds2idx-v1.2"},
    }
    write_atomic(manifest_path, json.dumps(manifest, indent=1))
    return PackResult(shards, sum(counts), len(done), samples.reencoded, samples.kept,
                      manifest_path, samples.skipped)


def _check_args(out_dir: str, name: str, max_side: int | None, quality: int,
                workers: int | None) -> None:
    """Refuse the settings a pack cannot run with, naming the option."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", name):
        # No dot: DALI's wds2idx names an index after the shard's name up to its first dot.
        raise PackError(f"--name {name!r}: use letters, digits, '_' and '-'")
    if max_side is not None and max_side < 1:
        raise PackError(f"--max-side must be positive, got {max_side}")
    if not 1 <= quality <= 100:
        raise PackError(f"--quality must be in 1..100, got {quality}")
    if workers is not None and (isinstance(workers, bool) or workers < 1):
        raise PackError(f"--workers must be >= 1, got {workers}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise PackError(f"OUT_DIR {out_dir!r} is a file, not a folder")


def _claim(out_dir: str, name: str, settings: dict, manifest_path: str, overwrite: bool) -> None:
    """Make ``out_dir`` this pack's: refuse a pack of this name made with other
    settings or by another command (unless ``overwrite``, which removes it),
    record the settings, and remove a killed run's shard in progress."""
    state_path = os.path.join(out_dir, f".{name}-pack.json")
    existing = sorted(f for f in os.listdir(out_dir)
                      if re.fullmatch(re.escape(name) + r"-\d{6}\.(tar|idx)", f)
                      or re.fullmatch(r"\." + re.escape(name) + r"-\d{6}\.(tar|idx)\.part", f))
    if overwrite:
        for f in existing + [os.path.basename(manifest_path)]:
            try:
                os.unlink(os.path.join(out_dir, f))
            except FileNotFoundError:
                pass
        existing = []
    elif os.path.exists(state_path):
        with open(state_path, encoding="utf-8") as f:
            before = json.load(f)
        diff = [k for k in settings if before.get(k) != settings[k]]
        if diff:
            raise PackError(
                f"{out_dir} holds a pack named {name!r} made with other settings ("
                + ", ".join(f"{k}: {before.get(k)!r} then, {settings[k]!r} now" for k in diff)
                + "); pass --overwrite to replace it, or choose another --name or OUT_DIR")
    elif any(not f.startswith(".") for f in existing) or os.path.exists(manifest_path):
        raise PackError(f"{out_dir} already holds shards named {name}-*.tar that this command "
                        f"did not start; pass --overwrite to replace them")
    write_atomic(state_path, json.dumps(settings, indent=1))
    for f in existing:
        if f.endswith(".part"):  # a killed run's shard in progress
            os.unlink(os.path.join(out_dir, f))


class _Samples:
    """The samples to pack: a source object's, or an ImageFolder's or a file
    list's files (the regular ones), each read as its tar members; counts the
    images re-encoded for ``max_side`` and those kept as they were.

    Raises:
        PackError: ``source`` is none of those, or has no sample.
    """

    def __init__(self, source: Any, max_side: int | None, quality: int) -> None:
        self.max_side, self.quality = max_side, quality
        self.obj: Any = None
        self.paths: list[str] = []
        self.labels: list[int] = []
        self.skipped: list[str] = []
        self.reencoded = 0
        self.kept: list[str] = []
        if hasattr(source, "read") and hasattr(source, "__len__") and not isinstance(source, type):
            self.obj = source
            self.count = len(source)
            classes = getattr(source, "classes", None)
            self.classes = list(classes) if isinstance(classes, (list, tuple)) and all(
                isinstance(c, str) for c in classes) else None
            self.origin = f"{type(source).__module__}.{type(source).__qualname__}"
        else:
            self._files(source)
        if not self.count:
            skipped = self.skipped
            raise PackError(f"{self.origin}: the source has no sample"
                            + (f" (skipped, not regular files: {', '.join(skipped[:5])}"
                               f"{', ...' if len(skipped) > 5 else ''})" if skipped else ""))

    def _files(self, source: Any) -> None:
        if not isinstance(source, (str, os.PathLike)):
            raise PackError(f"cannot pack {source!r}: give an ImageFolder directory, a file list, "
                            f"or a source (an object with __len__ and read)")
        if os.path.isdir(source):
            folder = ImageFolder(source)
            paths, labels, self.classes = folder.paths, folder.labels, folder.classes
        elif os.path.isfile(source):
            paths, labels, numbers = read_list_lines(source)
            self.classes = None
            for path, no in zip(paths, numbers):
                if not os.path.lexists(path):
                    raise PackError(f"{source}:{no}: lists {path!r}, which does not exist (read as a "
                                    f"file list: one 'path [label]' per line)")
        else:
            raise PackError(f"{source!r} is neither an ImageFolder directory nor a file list")
        self.paths, self.labels, self.skipped = regular_files(list(paths), list(labels))
        self.count = len(self.paths)
        self.origin = os.path.abspath(source)

    def load(self, i: int) -> tuple[list[tuple[str, bytes]], str]:
        """Sample ``i``'s members and whether its image was re-encoded
        (``"reencoded"``), kept as it was (``"kept"``) or had no need (``"same"``)."""
        obj = self.obj
        if obj is not None:
            try:
                return sample_members(obj, i, self.max_side, self.quality)
            except OSError as exc:
                if exc.filename is not None:
                    raise
                # The source's read failed without saying on what (os.read's
                # errors name no file): name the sample.
                what = f"reading {name_sample(obj, i)}: {exc.strerror or exc}"
                # OSError(None, text) would print as "[Errno None] text"
                raise (OSError(exc.errno, what) if exc.errno is not None
                       else OSError(what)) from exc
        path = self.paths[i]
        data = read_input(path)
        if image_ext(data) is None:
            # As a source's sample that is no image (a 0-byte or text file named
            # .jpg): an error naming it now, not a shard member that fails later.
            raise PackError(f"{path}: not an image feeder reads (first bytes {bytes(data[:8])!r})")
        ext = os.path.splitext(path)[1].lower().lstrip(".") or "jpg"
        status = "same"
        if self.max_side is not None:
            small = shrink(data, ext, self.max_side, self.quality)
            if small is None:
                status = "kept"
            elif small is not data:
                data, status = small, "reencoded"
        fields = [(ext, data)]
        if self.labels[i] >= 0:
            fields.append(("cls", str(self.labels[i]).encode("ascii")))
        return fields, status

    def loaded(self, start: int,
               workers: int | None) -> Generator[tuple[int, list[tuple[str, bytes]]], None, None]:
        """``(i, members)`` of samples ``start``... in order, read by ``workers``
        threads, a bounded window ahead; counts re-encoded and kept images."""
        n_workers = workers or min(8, os.cpu_count() or 1)
        window = 4 * n_workers
        with ThreadPoolExecutor(n_workers, thread_name_prefix="feeder-pack") as pool:
            pending = []
            nxt = start
            while nxt < self.count or pending:
                while nxt < self.count and len(pending) < window:
                    pending.append((nxt, pool.submit(self.load, nxt)))
                    nxt += 1
                i, future = pending.pop(0)
                fields, status = future.result()
                if status == "reencoded":
                    self.reencoded += 1
                elif status == "kept":
                    self.kept.append(self.paths[i] if self.obj is None
                                     else name_sample(self.obj, i))
                yield i, fields


def _write_shards(samples: Iterator[tuple[int, list[tuple[str, bytes]]]], out_dir: str, name: str,
                  shard_size: int, shards: list[str], counts: list[int], bar: Any) -> None:
    """Write ``samples`` into shards after ``shards`` (whose sample counts are
    ``counts``; both gain the shards written), a new one started when the next
    sample would take one past ``shard_size`` bytes. A shard left unfinished by
    an error is removed."""
    writer: ShardWriter | None = None
    try:
        for i, fields in samples:
            size = sum(tarfile.BLOCKSIZE + -(-len(d) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                       for _, d in fields)
            # The end-of-archive blocks and the padding to a whole tar record follow.
            closing = 2 * tarfile.BLOCKSIZE + tarfile.RECORDSIZE
            if writer is not None and writer.samples and writer.size + size + closing > shard_size:
                writer.finish()
                shards.append(writer.path)
                counts.append(writer.samples)
                writer = None
            if writer is None:
                writer = ShardWriter(out_dir, name, len(shards))
            writer.add(f"{i:09d}", fields)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(shards=len(shards) + 1, refresh=False)
        if writer is not None:
            writer.finish()
            shards.append(writer.path)
            counts.append(writer.samples)
            writer = None
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise
