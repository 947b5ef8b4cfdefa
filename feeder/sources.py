"""Where samples come from.

A source is any object with ``__len__`` and ``read(index)`` returning
``(image, label)`` or a dict of fields with the image under ``"image"``
(``"mask"``, ``"boxes"``, ``"box_labels"``, ``"label"``, anything else: see
:mod:`feeder.sample` and :func:`feeder.check_sample`). The image is the
encoded file's bytes, or an image already decoded: a uint8 numpy array (HWC),
a uint8 tensor (CHW, as torchvision's) or a PIL image. It may also
define ``describe(index) -> str`` (a path, a key) that error messages use to
point at the bad sample, and ``reads_may_block`` (a bool): False when reads
are local and fast, so that the decode threads read themselves
(``read_threads="auto"`` then adds no read stage); a source without it is read
in threads of its own, in case its reads wait on storage, until its reads are
measured as fast (see ``Feeder``'s ``read_threads``). ``read`` is called from several decode threads at
once, so it must be thread-safe; plain file reads are. A sample that cannot be
read should raise (it is then skipped under ``on_error="skip"``); returning
anything else than a sample is a mistake in the source, always an error.

Here: the protocol, and the sources of image files (:class:`FileList`,
:class:`ImageFolder`); :class:`DatasetSource`, which reads a torch ``Dataset``,
is in :mod:`feeder.dataset_source` and named here too.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import stat
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .dataset_source import TORCHVISION_PER_BOX, DatasetSource  # noqa: F401  (named here too)
from .decode.extension import jpeg as _extension
from .errors import name_tuple
from .storage.local import on_network_storage

__all__ = ["DatasetSource", "FileList", "ImageFolder", "IMG_EXTENSIONS", "Source", "describe"]

log = logging.getLogger(__name__)

# torchvision's accepted image extensions (datasets.folder.IMG_EXTENSIONS).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@runtime_checkable
class Source(Protocol):
    """The interface the feeder reads samples through."""

    def __len__(self) -> int: ...

    def read(self, index: int) -> tuple[bytes, Any] | dict[str, Any]:
        """Return the image (encoded bytes, or a decoded uint8 array, tensor or
        PIL image) and the label of sample ``index``, or a dict of its fields with
        the image under ``"image"``."""
        ...


def describe(source: object, index: int) -> str:
    """How error messages name sample ``index`` of ``source``.

    The result is the source's own string (for files, the path as given, which
    may hold surrogate escapes when the name is not valid UTF-8) so that it can
    be used to open the file; messages and logs show it through
    :func:`feeder.errors.safe_text`."""
    fn = getattr(source, "describe", None)
    if fn is not None:
        try:
            return str(fn(index))
        except Exception:  # describing must never mask the real error
            pass
    return f"{type(source).__name__}[{index}]"


def _labels(labels: Any) -> Any:
    """FileList's labels: a list of Python ints when they are all integers (pairs with
    int labels take the engine's fastest path), else one numeric numpy array."""
    if type(labels).__module__ == "torch":
        labels = labels.detach().cpu().numpy()
    if not isinstance(labels, np.ndarray):
        labels = list(labels)
        for k, x in enumerate(labels):
            if isinstance(x, (str, bytes)) or x is None:
                raise ValueError(f"FileList: label {k} is {x!r}; labels must be numbers or "
                                 f"fixed-shape numeric arrays")
    if len(labels) == 0:
        return []
    try:
        arr = np.asarray(labels)
    except ValueError:
        arr = None
    if arr is None or arr.dtype.kind not in "biuf":
        sizes = {np.shape(x) for x in labels}
        raise ValueError(f"FileList: labels must be numbers or numeric arrays of one shape; got "
                         f"shapes {sorted(sizes)[:4]}" if len(sizes) > 1 else
                         f"FileList: labels must be numbers or fixed-shape numeric arrays; got "
                         f"{type(labels[0]).__name__} values")
    if arr.ndim == 1 and arr.dtype.kind in "iu":
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 1 << 63:
            raise ValueError(f"FileList: label {int(arr.argmax())} = {int(arr.max())} does not fit int64")
        return [int(x) for x in arr]
    if arr.ndim == 0:
        raise ValueError("FileList: labels must be a sequence, one label per path")
    return arr


#: The extension's whole-file read (open, fstat, read and close without the GIL,
#: which a sample's four system calls would each let go of and wait to take back
#: behind the other threads' Python), or None: the Python way below.
_native_read = getattr(_extension, "read_file", None)

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def _read_file(path: str) -> bytes:
    """The whole file, as ``open(path, "rb").read()`` returns it, with errors that
    name ``path``.

    Called once per sample with the GIL held between system calls: ``open()``
    builds a FileIO and a BufferedReader per file and reads until an empty read,
    where this makes one bytes object and three system calls. Asking for a byte
    more than ``fstat`` reports, a regular file that returns exactly its size
    has reached its end; anything else (a short read, a file that grew, a
    pipe) reads on until an empty read.

    With feeder's C extension built, the extension reads it the same way in one
    call that releases the GIL once instead of four times (``_native_read``).
    """
    if _native_read is not None:
        return _native_read(path)
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        size = st.st_size
        try:
            data = os.read(fd, size + 1)
            if len(data) == size and size > 0 and stat.S_ISREG(st.st_mode):
                return data
            parts = [data]
            while parts[-1]:
                parts.append(os.read(fd, max(size, 1 << 16)))
        except OSError as exc:
            # os.read's errors do not name the file; the sample's error must.
            raise OSError(exc.errno, exc.strerror, path) from exc
        return b"".join(parts)
    finally:
        os.close(fd)


class FileList:
    """Samples given as explicit lists of file paths and labels.

    Args:
        paths: Image file paths.
        labels: One label per path; ``None`` labels every sample ``-1``. Integer
            labels are delivered as int64, float labels as float (a list of
            Python numbers with any float in it is float64; a numpy array keeps
            its float dtype), and labels of one fixed shape (a ``[N, K]`` array,
            a list of equal-length lists: multi-hot, soft or vector targets) as
            ``[B, K]`` tensors. Nothing is truncated or rounded.

    Raises:
        ValueError: the lists differ in length, or a label is not a number or
            labels differ in shape (names the first offending label).
    """

    def __init__(self, paths: Sequence[str | os.PathLike], labels: Sequence[Any] | None = None) -> None:
        if isinstance(paths, (str, bytes, os.PathLike)):
            raise TypeError(f"FileList: paths must be a list of paths, got one path "
                            f"{os.fsdecode(paths)!r}; for one file pass [path]")
        self.paths = [os.fspath(p) for p in paths]
        self.labels: Any
        if labels is None:
            self.labels = [-1] * len(self.paths)
        else:
            self.labels = _labels(labels)
            if len(self.labels) != len(self.paths):
                raise ValueError(
                    f"FileList: {len(self.paths)} paths but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, index: int) -> tuple[bytes, int]:
        return _read_file(self.paths[index]), self.labels[index]

    def path_label(self, index: int) -> tuple[str | bytes, Any]:
        """What :meth:`read` reads and returns with it: the path and the label.
        The engine's read step uses it to have the region decoder read the file
        in the call that decodes it (one GIL hand-off less per sample), where
        :meth:`read` is this class's own."""
        return self.paths[index], self.labels[index]

    def describe(self, index: int) -> str:
        return self.paths[index]

    @property
    def reads_may_block(self) -> bool:
        """Whether reads may wait on a network or FUSE file system (NFS, SMB,
        Lustre, s3fs...), judged from the file systems of up to 64 of the paths
        spread over the list. feeder then reads in threads of their own
        (``read_threads="auto"``); on a local disk the decode threads read,
        which costs less CPU per sample."""
        cached = getattr(self, "_reads_may_block", None)
        if cached is None:
            n = len(self.paths)
            k = min(n, 64)
            picks = sorted({os.path.dirname(self.paths[i * n // k]) or "." for i in range(k)})
            cached = self._reads_may_block = on_network_storage(picks)
        return cached

    def __repr__(self) -> str:
        return f"FileList({len(self)} files)"


def _walk_once(top: str) -> list[tuple[str, list[str]]]:
    """``(folder, names of its non-folder entries)`` for every folder under ``top``
    (``top`` included), sorted by folder path, each folder listed once.

    Folders are told apart by ``(st_dev, st_ino)``. The real sub-folders are
    walked first; then the links to folders, smallest path first. A link to a
    folder already walked, or to a folder that contains ``top`` (a loop), adds
    nothing.
    """
    seen = set()
    folder = os.path.realpath(top)
    while True:  # top and every folder above it
        try:
            st = os.stat(folder)
        except OSError:
            return []
        seen.add((st.st_dev, st.st_ino))
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    found: list[tuple[str, list[str]]] = []
    pending = [top]
    links: list[str] = []  # a heap: links are followed in sorted order
    while True:
        while pending:
            folder = pending.pop()
            try:
                with os.scandir(folder) as it:
                    entries = list(it)
            except OSError:  # unreadable: passed over, as os.walk does
                continue
            files = []
            for e in entries:
                try:
                    is_dir = e.is_dir()  # follows links: a link to a file is a file
                except OSError:
                    is_dir = False
                if not is_dir:
                    files.append(e.name)
                elif e.is_symlink():
                    heapq.heappush(links, e.path)
                else:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:  # removed while listing
                        continue
                    key = (st.st_dev, st.st_ino)
                    if key not in seen:
                        seen.add(key)
                        pending.append(e.path)
            found.append((folder, files))
        if not links:
            break
        link = heapq.heappop(links)
        try:
            st = os.stat(link)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:
            log.debug("ImageFolder: not following %r: its folder is already listed", link)
            continue
        seen.add(key)
        pending.append(link)
    found.sort(key=lambda item: item[0])
    return found


class ImageFolder(FileList):
    """A ``root/<class>/**/<image>`` tree, with torchvision's conventions.

    Classes are the sorted names of the sub-folders of ``root`` and their
    indices are positions in that order; files are found recursively and kept
    when their extension (any case) is in ``extensions``, in sorted path order.

    Links are followed (a dataset often links its data in from elsewhere), but
    each folder is listed at most once per class, so a link loop cannot repeat
    images: the real sub-folders of the class come first, then links to folders
    in sorted order of their paths; a link to a folder already listed (reached
    by a real path or an earlier link) or to one that contains the class folder
    (``root`` itself, for one) is skipped. So
    when two links point to the same folder, its images appear once, under the
    link whose path sorts first. Links to files are kept, wherever they point.

    Args:
        root: The dataset folder.
        extensions: Accepted file extensions with the dot, in any case (a
            string: that one extension).
        allow_empty: Accept class folders without any image (otherwise an error).

    Raises:
        FileNotFoundError: ``root`` is missing, has no class folders, or a class
            folder has no image and ``allow_empty`` is false.
    """

    def __init__(self, root: str | os.PathLike, extensions: Sequence[str] = IMG_EXTENSIONS,
                 allow_empty: bool = False) -> None:
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"ImageFolder: {self.root!r} is not a directory")
        with os.scandir(self.root) as it:
            self.classes = sorted(e.name for e in it if e.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"ImageFolder: no class folders in {self.root!r}")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        exts = tuple(e.lower() for e in name_tuple(extensions, "ImageFolder: extensions"))
        paths: list[str] = []
        labels: list[int] = []
        empty = []
        for cls in self.classes:
            found = 0
            for dirpath, filenames in _walk_once(os.path.join(self.root, cls)):
                for name in sorted(filenames):
                    if name.lower().endswith(exts):
                        paths.append(os.path.join(dirpath, name))
                        labels.append(self.class_to_idx[cls])
                        found += 1
            if not found:
                empty.append(cls)
        if empty and not allow_empty:
            raise FileNotFoundError(
                f"ImageFolder: no image in class folder(s) {', '.join(empty)} under {self.root!r} "
                f"(accepted extensions: {', '.join(exts)}); pass allow_empty=True to accept them")
        super().__init__(paths, labels)

    def __repr__(self) -> str:
        return f"ImageFolder({self.root!r}, {len(self)} images, {len(self.classes)} classes)"
