"""The offset index of a tar shard (:class:`ShardIndex`): where each sample's
members are, grouped by key (:func:`split_name`), read from and written to the
text index of DALI's ``wds2idx`` (``v1.2``), with feeder's own lines after the
samples' (image sizes, the shard's size) that DALI does not read. The format
and why it was chosen: docs/design/storage.md.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

INDEX_VERSION = "v1.2"


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name, or None for a name that holds no
    field (a hidden file such as ``._x.jpg``, a name without an extension)."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash or dot == len(name) - 1:
        return None
    return name[:dot], name[dot + 1:].lower()


def index_path(shard: str) -> str:
    """Where a shard's offset index lives: its name with ``.tar`` replaced by
    ``.idx`` (``d/train-000000.tar`` -> ``d/train-000000.idx``, as DALI's
    ``wds2idx`` names it); works for URLs too. Only the last extension is
    replaced, so ``a.v1-0.tar`` and ``a.v2-0.tar`` never share an index (DALI's
    tool would cut both at the first dot)."""
    return (shard[:-4] if shard.endswith(".tar") else shard) + ".idx"


#: How the index's image sizes line starts (see the module docstring).
SIZES_LINE = "# image_sizes"
#: How the index's shard size line starts (see the module docstring).
SHARD_SIZE_LINE = "# shard_size"
#: How the index's line of EXIF-transposed images starts (see the module docstring).
TRANSPOSED_LINE = "# image_transposed"

class ShardFormatError(ValueError):
    """A shard or its index cannot be understood (the message names the file)."""



@dataclass
class ShardIndex:
    """Where the fields of one shard's samples are.

    Members of sample ``s`` are ``start[s]:start[s + 1]`` of the member arrays.

    Attributes:
        keys: Sample keys, in shard order.
        start: int64 ``[samples + 1]``: first member of each sample.
        exts: Each member's extension (lower case).
        offsets: int64: each member's data offset in the shard, bytes.
        sizes: int64: each member's size, bytes.
        names: Each member's name in the tar (for messages and the index file).
        end: Bytes the shard should hold, as far as the index knows (the end of
            its last member's data); a shard shorter than this is truncated.
    """

    keys: list[str]
    start: np.ndarray
    exts: list[str]
    offsets: np.ndarray
    sizes: np.ndarray
    names: list[str]
    #: int64 ``[samples, 2]``: each sample's image (height, width), -1 where
    #: unknown, when the index file carries them (``feeder-pack`` writes them).
    image_sizes: np.ndarray | None = None
    #: The size of the shard this index was made from, bytes (the index file's
    #: ``# shard_size`` line, or the bytes a scan read); None when not known.
    shard_size: int | None = None
    #: bool ``[samples]``: the images whose EXIF orientation swaps height and
    #: width (their sizes with ``exif_orientation=True``), when the index carries it.
    image_transposed: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def end(self) -> int:
        if not len(self.offsets):
            return 0
        return int((self.offsets + self.sizes).max())

    def members(self, sample: int) -> range:
        return range(int(self.start[sample]), int(self.start[sample + 1]))

    def count_with(self, ext: str) -> int:
        """Samples that have a field ``ext``."""
        found = set()
        for m, e in enumerate(self.exts):
            if e == ext:
                found.add(int(np.searchsorted(self.start, m, side="right")) - 1)
        return len(found)

    @classmethod
    def from_members(cls, members: Iterable[tuple[str, int, int]],
                     warn: Callable[[str], None] | None = None) -> "ShardIndex":
        """Group ``(name, data offset, size)`` members into samples by key.

        Members of one key need not be adjacent (tools write them in any
        order): they form one sample, placed where its key first appears. A
        second member with a key's extension is ignored, with a warning.
        """
        groups: dict[str, dict[str, tuple[int, int, str]]] = {}
        for name, offset, size in members:
            parts = split_name(name)
            if parts is None:
                continue
            key, ext = parts
            fields = groups.setdefault(key, {})
            if ext in fields:
                if warn is not None:
                    warn(f"duplicate member {name!r} for key {key!r} (kept the first, "
                         f"{fields[ext][2]!r})")
                continue
            fields[ext] = (offset, size, name)
        keys, start, exts, offsets, sizes, names = [], [0], [], [], [], []
        for key, fields in groups.items():
            keys.append(key)
            for ext, (offset, size, name) in fields.items():
                exts.append(ext)
                offsets.append(offset)
                sizes.append(size)
                names.append(name)
            start.append(len(exts))
        return cls(keys, np.asarray(start, np.int64), exts, np.asarray(offsets, np.int64),
                   np.asarray(sizes, np.int64), names)

    # -- the DALI v1.2 text format -----------------------------------------
    def to_text(self) -> str | None:
        """The index in DALI's ``v1.2`` text format, or None when a member name holds
        whitespace (the format has no way to write it)."""
        lines = [f"{INDEX_VERSION} {len(self.keys)}"]
        for s in range(len(self.keys)):
            parts = []
            for m in self.members(s):
                name = self.names[m]
                if not name or any(ch.isspace() for ch in name):
                    return None
                parts.append(f"{self.exts[m]} {int(self.offsets[m])} {int(self.sizes[m])} {name}")
            lines.append(" ".join(parts))
        if self.shard_size is not None:
            lines.append(f"{SHARD_SIZE_LINE} {self.shard_size}")
        if self.image_sizes is not None:
            lines.append(f"{SIZES_LINE} {encode_image_sizes(self.image_sizes)}")
        if self.image_transposed is not None:
            bits = np.packbits(np.asarray(self.image_transposed, bool)).tobytes()
            lines.append(f"{TRANSPOSED_LINE} {base64.b64encode(bits).decode('ascii')}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str, where: str) -> "ShardIndex":
        """Parse DALI's index format (``v1.2``, or ``v1.1`` and ``v1.0`` without member
        names). ``where`` names the index file in errors.

        Raises:
            ShardFormatError: naming the file and line.
        """
        lines = text.splitlines()
        if not lines:
            raise ShardFormatError(f"{where}: empty index file")
        head = lines[0].split()
        if len(head) != 2 or head[0] not in ("v1.0", "v1.1", "v1.2"):
            raise ShardFormatError(f"{where}: line 1 must be 'v1.2 <samples>' (DALI wds2idx "
                                   f"index), got {lines[0][:80]!r}")
        try:
            count = int(head[1])
        except ValueError:
            raise ShardFormatError(f"{where}: line 1: sample count {head[1]!r} is not an int") from None
        width = 4 if head[0] == "v1.2" else 3
        body = [line for line in lines[1:] if line.strip()]
        # Lines after the announced samples' lines: feeder's own (# image_sizes);
        # other comment lines are skipped, anything else is an error.
        image_sizes = transposed = None
        shard_size = None
        while len(body) > count and body[-1].startswith("#"):
            extra = body.pop()
            if extra.startswith(SHARD_SIZE_LINE + " "):
                value = extra[len(SHARD_SIZE_LINE) + 1:].strip()
                if not (value.isascii() and value.isdigit()) or len(value) > 20:
                    raise ShardFormatError(f"{where}: line {len(body) + 2} (shard size): "
                                           f"{value[:40]!r} is not a size in bytes")
                shard_size = int(value)
            elif extra.startswith(SIZES_LINE + " "):
                try:
                    image_sizes = decode_image_sizes(extra[len(SIZES_LINE) + 1:].strip(), count)
                except ValueError as exc:
                    raise ShardFormatError(f"{where}: line {len(body) + 2} (image sizes): "
                                           f"{exc}") from None
            elif extra.startswith(TRANSPOSED_LINE + " "):
                try:
                    transposed = decode_bits(extra[len(TRANSPOSED_LINE) + 1:].strip(), count)
                except ValueError as exc:
                    raise ShardFormatError(f"{where}: line {len(body) + 2} (transposed "
                                           f"images): {exc}") from None
        if len(body) != count:
            raise ShardFormatError(f"{where}: line 1 announces {count} samples but the index "
                                   f"has {len(body)} lines")
        members = []
        for no, line in enumerate(body, start=2):
            parts = line.split()
            if not parts or len(parts) % width:
                raise ShardFormatError(f"{where}: line {no}: expected groups of {width} values "
                                       f"(ext offset size{' name' if width == 4 else ''}), "
                                       f"got {len(parts)} values")
            key = f"sample{no - 2:09d}"
            for g in range(0, len(parts), width):
                ext = parts[g].lower()
                try:
                    offset, size = int(parts[g + 1]), int(parts[g + 2])
                except ValueError:
                    raise ShardFormatError(f"{where}: line {no}: offset/size of field {ext!r} "
                                           f"are not ints: {parts[g + 1]!r} {parts[g + 2]!r}") from None
                if offset < 0 or size < 0:
                    raise ShardFormatError(f"{where}: line {no}: negative offset or size "
                                           f"for field {ext!r}")
                name = parts[g + 3] if width == 4 else f"{key}.{ext}"
                members.append((name, offset, size))
        index = cls.from_members(members)
        if len(index) != count:
            raise ShardFormatError(f"{where}: {count} index lines but {len(index)} distinct keys "
                                   f"in their member names")
        index.image_sizes = image_sizes
        index.image_transposed = transposed
        index.shard_size = shard_size
        if shard_size is not None and index.end > shard_size:
            raise ShardFormatError(f"{where}: its members end at byte {index.end}, past the "
                                   f"{shard_size} bytes of the shard it says it was made from")
        return index


def encode_image_sizes(sizes: Any) -> str:
    """A shard's image sizes (``[n, 2]`` height, width; -1 where unreadable) as its
    index stores them (and shard lists of earlier versions did): base64 of
    little-endian int32 pairs (8 bytes a sample, 11 in base64)."""
    return base64.b64encode(np.asarray(sizes, "<i4").reshape(-1, 2).tobytes()).decode("ascii")


def decode_bits(value: Any, nsamples: int) -> np.ndarray:
    """One bit per sample as an index stores it (base64 of numpy's packbits) as a
    bool array, checked.

    Raises:
        ValueError: not base64 of ``ceil(nsamples / 8)`` bytes, or a padding bit set.
    """
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) != (nsamples + 7) // 8:
        raise ValueError(f"not base64 of one bit per sample ({nsamples} samples)")
    bits = np.unpackbits(np.frombuffer(raw, np.uint8)).astype(bool)
    if bits[nsamples:].any():
        raise ValueError(f"a bit is set past the last of the {nsamples} samples")
    return bits[:nsamples]


def decode_image_sizes(value: Any, nsamples: int | None) -> np.ndarray:
    """Image sizes as :func:`encode_image_sizes` writes them (an index's sizes line,
    or an earlier version's shard list entry) as int64 ``[n, 2]``, checked.

    Raises:
        ValueError: not base64 of one (height, width) int32 pair per sample, or a
            size that is neither positive nor -1.
    """
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) % 8 or (nsamples is not None and len(raw) != 8 * nsamples):
        raise ValueError(f"image_sizes is not base64 of (height, width) int32 pairs, one per "
                         f"sample ({nsamples} samples)")
    sizes = np.frombuffer(raw, "<i4").reshape(-1, 2).astype(np.int64)
    if ((sizes < -1) | (sizes == 0)).any():
        raise ValueError("image_sizes holds a size that is neither positive nor -1")
    return sizes
