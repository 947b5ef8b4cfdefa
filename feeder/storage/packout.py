"""What ``feeder-pack`` writes, safely: each shard under a temporary name, its
index beside it, both renamed once whole (:class:`ShardWriter`); small files
replaced atomically (:func:`write_atomic`); write errors as errors naming the
file and the output folder (:func:`output_error`); the shards an interrupted
pack completed, found again to resume after them (:func:`complete_shards`).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import tarfile
from collections.abc import Sequence

import numpy as np

from .packsample import PackError, image_size_of
from .tar import IMAGE_EXTS, ShardIndex, index_path


def output_error(exc: OSError, path: str, out_dir: str) -> OSError:
    """``exc`` (from writing ``path``) as an error naming the file and the output folder."""
    hint = {errno.ENOSPC: "the output folder's file system is full",
            errno.EROFS: "the output folder is on a read-only file system",
            errno.EDQUOT: "the disk quota of the output folder is exceeded"}.get(exc.errno)
    what = exc.strerror or str(exc)
    return OSError(exc.errno, f"writing to output folder {out_dir}: {what}"
                   + (f" ({hint}; nothing partial is left under a final name)" if hint else ""),
                   path)


def shard_paths(out_dir: str, name: str, k: int) -> tuple[str, str, str, str]:
    """(shard, index, temporary shard, temporary index) paths of shard ``k``."""
    shard = os.path.join(out_dir, f"{name}-{k:06d}.tar")
    idx = index_path(shard)
    return shard, idx, os.path.join(out_dir, f".{name}-{k:06d}.tar.part"), \
        os.path.join(out_dir, f".{name}-{k:06d}.idx.part")


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".part"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        remove(tmp)
        raise output_error(exc, path, os.path.dirname(path) or ".") from exc


def fsync_dir(folder: str) -> None:
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


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # absent, or a read-only folder: nothing more to do on the way out
        pass


def stored_sizes(shard: str, ix: ShardIndex) -> tuple[list[tuple[int, int]], list[bool]]:
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


def write_index(ix: ShardIndex, path: str) -> None:
    text = ix.to_text()
    assert text is not None  # keys and extensions hold no whitespace
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class ShardWriter:
    """One shard being written: a tar under a temporary name, and its index."""

    def __init__(self, out_dir: str, name: str, k: int) -> None:
        self.out_dir = out_dir
        self.path, self.idx, self.tmp, self.tmp_idx = shard_paths(out_dir, name, k)
        try:
            self.file = open(self.tmp, "wb")
        except OSError as exc:
            raise output_error(exc, self.tmp, out_dir) from exc
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
            raise output_error(exc, self.tmp, self.out_dir) from exc

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
            raise output_error(exc, exc.filename or self.tmp, self.out_dir) from exc

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
        write_index(ix, self.tmp_idx)
        os.replace(self.tmp_idx, self.idx)
        os.replace(self.tmp, self.path)
        fsync_dir(self.out_dir)

    def abandon(self) -> None:
        for f in (self.tar, self.file):
            try:
                f.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        for p in (self.tmp, self.tmp_idx):
            remove(p)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def complete_shards(out_dir: str, name: str) -> list[tuple[str, int]]:
    """The shards of pack ``name`` an earlier run completed in ``out_dir``, in
    order, with their sample counts (their indices say); an earlier version's
    index gains what this version writes; shards past the first gap are removed.

    Raises:
        PackError: a shard does not continue the samples before it.
    """
    done: list[tuple[str, int]] = []
    start = 0
    while True:
        shard, idx, _, tmp_idx = shard_paths(out_dir, name, len(done))
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
                sizes, transposed = stored_sizes(shard, ix)
                ix.image_sizes = np.asarray(sizes, np.int64).reshape(-1, 2)
                ix.image_transposed = np.asarray(transposed, bool)
            ix.shard_size = os.path.getsize(shard)
            write_index(ix, tmp_idx)
            os.replace(tmp_idx, idx)
        done.append((shard, len(ix)))
        start += len(ix)
    for k in range(len(done), 10**6):  # stale shards past the resume point
        shard, idx, _, _ = shard_paths(out_dir, name, k)
        if not (os.path.exists(shard) or os.path.exists(idx)):
            break
        for p in (shard, idx):
            if os.path.exists(p):
                os.unlink(p)
    return done
