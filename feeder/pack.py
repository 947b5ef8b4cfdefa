"""``feeder-pack``: write an image dataset into WebDataset tar shards with offset indices.

::

    feeder-pack SOURCE_DIR OUT_DIR [--shard-size 64MB] [--name train] [--max-side N] [--quality Q]
    python -m feeder.pack ...

``SOURCE_DIR`` is an ImageFolder (``root/<class>/**/<image>``) or a file list
(a text file, one ``path [label]`` per line, paths relative to the list's
folder), or ``module:name`` naming any feeder source (``pack(source, ...)``
from Python). Each sample becomes ``<key>.<ext>`` with the image's bytes (``ext`` is
the file's own extension, lower case, or the format's for a source's bytes) and
``<key>.cls`` with the class index in ASCII (no ``.cls`` for unlabeled samples),
keys numbering the samples (``000000042``). A dict sample's other fields become
members too (:func:`sample_members`: ``mask.png``, ``boxes.npy``,
``box_labels.npy``, ``<name>.npy``/``.txt``/``.bin``/``.json``), which
:class:`feeder.TarShards` reads back to the same sample. ``OUT_DIR`` receives:

* ``<name>-000000.tar``, ... (each at most ``--shard-size``, unless one image is larger),
* ``<name>-000000.idx``, ...: the offset index of each shard, in DALI's
  ``wds2idx`` ``v1.2`` format (see :mod:`feeder.storage.tar`),
* ``<name>.json``: the shard list (``wids-shard-index-v1``: ``url`` and
  ``nsamples`` per shard) with the class names (``classes``) and the pack's settings.

Output is atomic: a shard is written under a hidden temporary name and renamed
once complete, after its index; the shard list is written last. A pack that is
killed leaves complete shards and a temporary file; running the same command
again removes the temporary file and continues after the last complete shard.
Running it with other settings refuses, naming them (``--overwrite`` starts over).

``--max-side N`` re-encodes images whose longer side exceeds ``N`` down to it
(area interpolation; JPEG and WebP at ``--quality``, PNG losslessly); others
keep their bytes. Re-encoded images lose their metadata (EXIF orientation
included: pixels stay as stored, feeder's default reading). A dict sample's
mask is resized with its image (nearest neighbour, re-encoded as a lossless
PNG: class ids are never blended) and its boxes scaled by the same factors.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import io
import json
import logging
import os
import re
import stat
import sys
import tarfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import UserCodeError, call_user, error_line
from .storage.packsample import PackError, name_sample, shrink, image_ext, image_size_of, sample_members
from .storage.tar import IMAGE_EXTS, ShardIndex, index_path
from .storage.sizes import parse_size
from .sources import ImageFolder

__all__ = ["PackError", "PackResult", "image_ext", "main", "pack", "parse_size", "sample_members"]

logger = logging.getLogger(__name__)

_MANIFEST_KIND = "wids-shard-index-v1"


def read_list(path: str) -> tuple[list[str], list[int]]:
    """A file list: one ``path [label]`` per line (``#`` starts a comment)."""
    base = os.path.dirname(os.path.abspath(path))
    paths, labels = [], []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, rest = line.rpartition(" ") if "\t" not in line else line.rpartition("\t")
            label = -1
            if name and rest.lstrip("-").isdigit():
                label = int(rest)
            else:
                name = line
            if label < -1:
                raise PackError(f"{path}:{no}: label {label} is negative")
            paths.append(name if os.path.isabs(name) else os.path.join(base, name))
            labels.append(label)
    if not paths:
        raise PackError(f"{path}: the file list has no entry")
    return paths, labels


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


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISDIR, "directory")):
        if test(mode):
            return kind
    return "not a regular file"


def _regular_files(paths: list[str], labels: list[int]) -> tuple[list[str], list[int], list[str]]:
    """The paths that are regular files (links followed), their labels, and the
    others as ``"path (kind)"``. Decided from ``os.stat`` before any is opened:
    opening a FIFO blocks until a writer comes, which may be never. A path that
    cannot be stat'ed stays: reading it fails with an error naming it."""
    keep_paths, keep_labels, skipped = [], [], []
    for path, label in zip(paths, labels):
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if stat.S_ISREG(mode):
            keep_paths.append(path)
            keep_labels.append(label)
        else:
            skipped.append(f"{path} ({_file_kind(mode)})")
            logger.warning("feeder-pack: skipping %s: not a regular file (%s)", path, _file_kind(mode))
    return keep_paths, keep_labels, skipped


def _read_input(path: str) -> bytes:
    """The bytes of the input file ``path``; errors name it.

    Opened without blocking: a path replaced by a FIFO since it was listed would
    otherwise block the open until a writer comes. Then refused unless it is a
    regular file (checked on the open descriptor, so no later swap can fool it).

    Raises:
        PackError: ``path`` is not a regular file any more.
        OSError: opening or reading failed (EIO...), with ``path`` as its filename.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PackError(f"{path}: input is not a regular file ({_file_kind(mode)}); it was one "
                            f"when the files were listed: rerun the pack")
        with open(fd, "rb", closefd=False) as f:
            try:
                return f.read()
            except OSError as exc:
                # A read's error has no filename: the packer's must say which input failed.
                raise OSError(exc.errno, f"reading input file: {exc.strerror}", path) from exc
    finally:
        os.close(fd)


def _output_error(exc: OSError, path: str, out_dir: str) -> OSError:
    """``exc`` (from writing ``path``) as an error naming the file and the output folder."""
    hint = {errno.ENOSPC: "the output folder's file system is full",
            errno.EROFS: "the output folder is on a read-only file system",
            errno.EDQUOT: "the disk quota of the output folder is exceeded"}.get(exc.errno)
    what = exc.strerror or str(exc)
    return OSError(exc.errno, f"writing to output folder {out_dir}: {what}"
                   + (f" ({hint}; nothing partial is left under a final name)" if hint else ""),
                   path)


def _names(out_dir: str, name: str, k: int) -> tuple[str, str, str, str]:
    """(shard, index, temporary shard, temporary index) paths of shard ``k``."""
    shard = os.path.join(out_dir, f"{name}-{k:06d}.tar")
    idx = index_path(shard)
    return shard, idx, os.path.join(out_dir, f".{name}-{k:06d}.tar.part"), \
        os.path.join(out_dir, f".{name}-{k:06d}.idx.part")


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".part"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        _remove(tmp)
        raise _output_error(exc, path, os.path.dirname(path) or ".") from exc


def _fsync_dir(folder: str) -> None:
    """Make the renames in ``folder`` durable (a crash after the rename could
    otherwise leave the old names); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder: the data is synced
        pass
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # absent, or a read-only folder: nothing more to do on the way out
        pass


def _stored_sizes(shard: str, ix: ShardIndex) -> tuple[list[tuple[int, int]], list[bool]]:
    """The image sizes of a shard written by an earlier run of a version that kept
    them in the shard list, or did not record the EXIF-transposed images (a
    resumed pack), read from the images' headers in the shard itself: the sizes
    as stored, and whether each image's orientation swaps them."""
    sizes, transposed = [], []
    with open(shard, "rb") as f:
        for sample in range(len(ix)):
            fields = []
            for m in ix.members(sample):
                if ix.exts[m] in IMAGE_EXTS:
                    f.seek(int(ix.offsets[m]))
                    fields.append((ix.exts[m], f.read(int(ix.sizes[m]))))
                    break
            sizes.append(image_size_of(fields))
            transposed.append(is_transposed(fields))
    return sizes, transposed


def is_transposed(fields: Sequence[tuple[str, bytes]]) -> bool:
    """Whether the sample image's EXIF orientation swaps its height and width (its
    size with ``exif_orientation=True``: see ``TarShards.oriented_image_sizes``)."""
    stored = image_size_of(fields)
    return stored[0] != stored[1] and image_size_of(fields, True) == (stored[1], stored[0])


def _write_index(ix: ShardIndex, path: str) -> None:
    text = ix.to_text()
    assert text is not None  # keys and extensions hold no whitespace
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class _ShardWriter:
    """One shard being written: a tar under a temporary name, and its index."""

    def __init__(self, out_dir: str, name: str, k: int) -> None:
        self.out_dir = out_dir
        self.path, self.idx, self.tmp, self.tmp_idx = _names(out_dir, name, k)
        try:
            self.file = open(self.tmp, "wb")
        except OSError as exc:
            raise _output_error(exc, self.tmp, out_dir) from exc
        self.tar = tarfile.open(fileobj=self.file, mode="w", format=tarfile.USTAR_FORMAT)
        self.members: list[tuple[str, int, int]] = []
        self.samples = 0
        self.image_sizes: list[tuple[int, int]] = []  # for the index (see image_size_of)
        self.transposed: list[bool] = []  # for the index (see is_transposed)

    @property
    def size(self) -> int:
        return self.tar.offset

    def add(self, key: str, fields: Sequence[tuple[str, bytes]]) -> None:
        try:
            self._add(key, fields)
        except OSError as exc:
            raise _output_error(exc, self.tmp, self.out_dir) from exc

    def _add(self, key: str, fields: Sequence[tuple[str, bytes]]) -> None:
        for ext, data in fields:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            info.mode = 0o644
            # mtime 0 keeps shards identical across runs of the same pack.
            self.tar.addfile(info, io.BytesIO(data))
            data_at = self.tar.offset - -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            self.members.append((info.name, data_at, len(data)))
        self.image_sizes.append(image_size_of(fields))
        self.transposed.append(is_transposed(fields))
        self.samples += 1

    def finish(self) -> None:
        """Close the tar, write the index, then rename both: index first, so a
        shard under its final name always has its index."""
        try:
            self._finish()
        except OSError as exc:
            raise _output_error(exc, exc.filename or self.tmp, self.out_dir) from exc

    def _finish(self) -> None:
        self.tar.close()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        ix = ShardIndex.from_members(self.members)
        # Each image's size goes in the shard's index, read with it when the
        # shard is first read (aspect-ratio grouping reads no image header).
        ix.image_sizes = np.asarray(self.image_sizes, np.int64).reshape(-1, 2)
        ix.image_transposed = np.asarray(self.transposed, bool)
        # The reader checks the shard against this size before using the index.
        ix.shard_size = os.path.getsize(self.tmp)
        _write_index(ix, self.tmp_idx)
        os.replace(self.tmp_idx, self.idx)
        os.replace(self.tmp, self.path)
        _fsync_dir(self.out_dir)

    def abandon(self) -> None:
        for f in (self.tar, self.file):
            try:
                f.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        for p in (self.tmp, self.tmp_idx):
            _remove(p)


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
    obj = None
    if hasattr(source, "read") and hasattr(source, "__len__") and not isinstance(source, type):
        obj = source
        n_samples = len(obj)
        classes = getattr(obj, "classes", None)
        classes = list(classes) if isinstance(classes, (list, tuple)) and all(
            isinstance(c, str) for c in classes) else None
        origin = f"{type(obj).__module__}.{type(obj).__qualname__}"
    elif not isinstance(source, (str, os.PathLike)):
        raise PackError(f"cannot pack {source!r}: give an ImageFolder directory, a file list, or "
                        f"a source (an object with __len__ and read)")
    elif os.path.isdir(source):
        folder = ImageFolder(source)
        paths, labels, classes = folder.paths, folder.labels, folder.classes
    elif os.path.isfile(source):
        paths, labels = read_list(source)
        classes = None
    else:
        raise PackError(f"{source!r} is neither an ImageFolder directory nor a file list")
    skipped: list[str] = []
    if obj is None:
        paths, labels, skipped = _regular_files(list(paths), list(labels))
        n_samples = len(paths)
        origin = os.path.abspath(source)
    if not n_samples:
        raise PackError(f"{origin}: the source has no sample"
                        + (f" (skipped, not regular files: {', '.join(skipped[:5])}"
                           f"{', ...' if len(skipped) > 5 else ''})" if skipped else ""))
    os.makedirs(out_dir, exist_ok=True)
    settings = {"source": origin, "samples": n_samples, "shard_size": shard_size,
                "max_side": max_side, "quality": quality if max_side else None}
    state_path = os.path.join(out_dir, f".{name}-pack.json")
    manifest_path = os.path.join(out_dir, f"{name}.json")
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
    _write_atomic(state_path, json.dumps(settings, indent=1))
    for f in existing:
        if f.endswith(".part"):  # a killed run's shard in progress
            os.unlink(os.path.join(out_dir, f))

    # Shards complete from an earlier run: their indices say how many samples they hold.
    done_shards: list[tuple[str, int]] = []
    start = 0
    while True:
        shard, idx, _, tmp_idx = _names(out_dir, name, len(done_shards))
        if not (os.path.isfile(shard) and os.path.isfile(idx)):
            break
        with open(idx, encoding="utf-8") as f:
            ix = ShardIndex.from_text(f.read(), idx)
        if ix.keys[:1] != [f"{start:09d}"]:
            raise PackError(f"{shard} does not continue the pack (first key {ix.keys[:1]}, "
                            f"expected {start:09d}); pass --overwrite to start over")
        if ix.image_sizes is None or ix.image_transposed is None or ix.shard_size is None:
            # An earlier version's shard: its index gains what this version writes.
            if ix.image_sizes is None or ix.image_transposed is None:
                sizes, transposed = _stored_sizes(shard, ix)
                ix.image_sizes = np.asarray(sizes, np.int64).reshape(-1, 2)
                ix.image_transposed = np.asarray(transposed, bool)
            ix.shard_size = os.path.getsize(shard)
            _write_index(ix, tmp_idx)
            os.replace(tmp_idx, idx)
        done_shards.append((shard, len(ix)))
        start += len(ix)
    for k in range(len(done_shards), 10**6):  # stale shards past the resume point
        shard, idx, _, _ = _names(out_dir, name, k)
        if not (os.path.exists(shard) or os.path.exists(idx)):
            break
        for p in (shard, idx):
            if os.path.exists(p):
                os.unlink(p)

    reencoded = 0
    kept: list[str] = []

    def load(i: int) -> tuple[int, list[tuple[str, bytes]], str]:
        if obj is not None:
            try:
                members, status = sample_members(obj, i, max_side, quality)
            except OSError as exc:
                if exc.filename is not None:
                    raise
                # The source's read failed without saying on what (os.read's
                # errors name no file): name the sample.
                what = f"reading {name_sample(obj, i)}: {exc.strerror or exc}"
                # OSError(None, text) would print as "[Errno None] text"
                raise (OSError(exc.errno, what) if exc.errno is not None else OSError(what)) from exc
            return i, members, status
        path = paths[i]
        data = _read_input(path)
        ext = os.path.splitext(path)[1].lower().lstrip(".") or "jpg"
        status = "same"
        if max_side is not None:
            small = shrink(data, ext, max_side, quality)
            if small is None:
                status = "kept"
            elif small is not data:
                data, status = small, "reencoded"
        fields = [(ext, data)]
        if labels[i] >= 0:
            fields.append(("cls", str(labels[i]).encode("ascii")))
        return i, fields, status

    def loaded() -> Iterator[tuple[int, list[tuple[str, bytes]], str]]:
        n_workers = workers or min(8, os.cpu_count() or 1)
        window = 4 * n_workers
        with ThreadPoolExecutor(n_workers, thread_name_prefix="feeder-pack") as pool:
            pending = []
            nxt = start
            while nxt < n_samples or pending:
                while nxt < n_samples and len(pending) < window:
                    pending.append(pool.submit(load, nxt))
                    nxt += 1
                yield pending.pop(0).result()

    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=n_samples, initial=start, unit="img", desc=f"feeder-pack {name}",
                   dynamic_ncols=True)
    shards = [s for s, _ in done_shards]
    counts = [n for _, n in done_shards]
    writer: _ShardWriter | None = None
    try:
        for i, fields, status in loaded():
            if status == "reencoded":
                reencoded += 1
            elif status == "kept":
                kept.append(paths[i] if obj is None else name_sample(obj, i))
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
                writer = _ShardWriter(out_dir, name, len(shards))
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
    finally:
        if bar is not None:
            bar.close()
    manifest = {
        "__kind__": _MANIFEST_KIND, "wids_version": 1, "name": name,
        # filesize and sha256 let a reader check a copy of each shard (TarShards
        # does, for remote shards, before using a copy).
        # The image sizes are in each shard's index, not here: the list stays
        # small at any scale (see feeder.storage.tar).
        "shardlist": [{"url": os.path.basename(s), "nsamples": n, "filesize": os.path.getsize(s),
                       "sha256": _sha256(s)}
                      for s, n in zip(shards, counts)],
        "classes": classes,
        "feeder_pack": {**settings, "index_format": "dali-wds2idx-v1.2"},
    }
    _write_atomic(manifest_path, json.dumps(manifest, indent=1))
    return PackResult(shards, sum(counts), len(done_shards), reencoded, kept, manifest_path, skipped)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_source(spec: str) -> Any:
    """The source named by ``module:name`` (``name`` an object with ``__len__`` and
    ``read``, or a class or function making one without arguments), imported with the
    current directory on the path, as ``python -m`` would.

    Raises:
        PackError: the module or the name cannot be found, or it is not a source.
        UserCodeError: the module, class or function named raised.
    """
    import importlib  # noqa: PLC0415

    module, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise PackError(f"{spec!r}: cannot find the source ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # the module's own code failed: the user's, said as such
        raise UserCodeError(f"SOURCE {spec}: importing {module!r} raised {type(exc).__name__}: "
                            f"{exc}") from exc
    if isinstance(obj, type) or (callable(obj) and not (hasattr(obj, "read")
                                                         and hasattr(obj, "__len__"))):
        obj = call_user(f"SOURCE {spec}", obj)  # a class, or a function making the source
    if not (hasattr(obj, "read") and hasattr(obj, "__len__")):
        raise PackError(f"{spec!r} is {type(obj).__name__}, not a source (an object with __len__ "
                        f"and read(index))")
    return obj


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="feeder-pack",
        description="Pack an ImageFolder, a file list or any feeder source (module:name; dict "
                    "samples keep their masks, boxes and other fields) into WebDataset tar "
                    "shards with offset indices (DALI wds2idx v1.2) and a shard list (<name>.json).")
    p.add_argument("source", metavar="SOURCE_DIR",
                   help="ImageFolder root (root/<class>/<image>), a text file of 'path [label]' "
                        "lines, or module:name of a feeder source (or of a function returning "
                        "one), whose dict samples keep all their fields")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where the shards go")
    p.add_argument("--shard-size", default="64MB", type=parse_size,
                   help="most bytes per shard (default 64MB; k/M/G = 1000s, KiB/MiB/GiB = 1024s)")
    p.add_argument("--name", default="train", help="shard name prefix (default train)")
    p.add_argument("--max-side", type=int, default=None,
                   help="re-encode images whose longer side exceeds N pixels down to N")
    p.add_argument("--quality", type=int, default=90,
                   help="JPEG/WebP quality of re-encoded images (default 90)")
    p.add_argument("--workers", type=int, default=None,
                   help="threads reading (and re-encoding) images (default: cores, at most 8)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a pack of this name in OUT_DIR instead of resuming it")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the full traceback instead of one line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The ``feeder-pack`` command; returns the exit status: 0, 2 for a pack that
    cannot run as asked (or unreadable input), 1 for another failure (the
    source's own code raising). An error is one line on stderr naming what is at
    fault (``--debug``: the traceback instead)."""
    args = build_parser().parse_args(argv)
    try:
        source: Any = args.source
        if not os.path.exists(source) and re.fullmatch(r"[\w.]+:[\w.]+", source):
            source = load_source(source)
        result = pack(source, args.out_dir, shard_size=args.shard_size, name=args.name,
                      max_side=args.max_side, quality=args.quality, workers=args.workers,
                      overwrite=args.overwrite, progress=not args.quiet)
    except Exception as exc:
        if args.debug:
            raise
        sys.stderr.write(f"feeder-pack: error: {error_line(exc)}\n")
        # what the pack was asked, or its input, cannot work; anything else is a failure
        return 2 if isinstance(exc, (PackError, OSError, ValueError)) else 1
    out = sys.stdout
    out.write(f"{result.samples} samples in {len(result.shards)} shards in {args.out_dir}"
              + (f" ({result.resumed} shards kept from an earlier run)" if result.resumed else "")
              + "\n")
    if args.max_side:
        out.write(f"{result.reencoded} images re-encoded to at most {args.max_side} px (with "
                  f"their masks and boxes)\n")
    for path in result.kept:
        out.write(f"kept as is (could not decode to re-encode): {path}\n")
    for path in result.skipped:
        out.write(f"skipped, not a regular file: {path}\n")
    out.write(f"shard list: {result.manifest}\n")
    out.write(f"train with: TarShards({result.manifest!r})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
