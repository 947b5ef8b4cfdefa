"""Indexing a tar shard from its headers (:func:`scan`): one 512-byte block per
member, plus long-name and pax records, are read; no sample's data is. A
corrupt header is passed over to the next valid one, with a warning; a shard
cut short is told from a whole one by its end-of-archive marker.
:func:`index_mismatch` checks an index file against the headers it points past.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from dataclasses import dataclass

from .tarindex import ShardFormatError, ShardIndex

BLOCK = 512
# The largest long-name or pax header record read while indexing, bytes: real
# ones hold a path and a few numbers.
MAX_RECORD_BYTES = 1 << 20

# Regular file members (tarfile's REGTYPE, AREGTYPE and CONTTYPE).
_FILE_TYPES = (b"0", b"\0", b"7")


#: Members whose tar headers :func:`index_mismatch` reads: the first, the last and
#: evenly between.
CHECKED_MEMBERS = 8


def index_mismatch(index: ShardIndex, size: int, pread: Callable[[int, int], bytes],
                   members: int = CHECKED_MEMBERS) -> str | None:
    """Why an index file does not describe the shard of ``size`` bytes that ``pread``
    reads (None: it does, as far as a few of its headers tell).

    Its members must end within the shard, and of the tar headers before up to
    ``members`` of them (at least 2: the first and the last), none may give another size or name than the
    index does, and one at least must agree: an index written for another
    version of the shard points at other bytes. A header that is not one at all
    is damage the index reads past (a shard is read by its index, not its
    headers), unless no header agrees."""
    if index.end > size:
        return f"its members end at byte {index.end}, the shard holds {size} bytes"
    if index.shard_size is not None and index.shard_size != size:
        return f"it was made from a shard of {index.shard_size} bytes, the shard holds {size}"
    n = len(index.offsets)
    members = max(2, members)
    picks = sorted({round(k * (n - 1) / (members - 1)) for k in range(members)}) if n else []
    agree = 0
    for m in picks:
        offset, length, name = int(index.offsets[m]), int(index.sizes[m]), index.names[m]
        block = pread(BLOCK, offset - BLOCK) if offset >= BLOCK else b""
        if len(block) < BLOCK or not _valid_header(block):
            continue
        why = header_disagrees(block, name, length, offset)
        if why is not None:
            return why
        agree += 1
    if picks and not agree:
        return f"none of the {len(picks)} members checked has its tar header before it"
    return None


def header_disagrees(block: bytes, name: str, length: int, offset: int) -> str | None:
    """Why the tar header ``block`` (the 512 bytes before a member's data at
    ``offset``) does not describe the member an index names ``name`` of ``length``
    bytes (None: it does): not a header at all, another size, another name."""
    if len(block) < BLOCK or not _valid_header(block):
        return f"the {BLOCK} bytes before member {name!r} (data at byte {offset}) are no tar header"
    stored = _octal(block[124:136])
    stored_name = block[:100].rstrip(b"\0").decode("utf-8", "surrogateescape")
    # Past 8 GiB a pax record holds the size, and the header's field may not;
    # a long name is in a record before the header, which holds its start.
    if stored != length and length < 8 ** 11:
        return (f"the tar header before member {name!r} (data at byte {offset}) gives "
                f"{stored} bytes, the index {length}")
    if block[345:346] == b"\0" and not (stored_name == name or (len(stored_name) >= 99
                                                                 and name.startswith(stored_name))):
        return (f"the tar header before member {name!r} (data at byte {offset}) names "
                f"{stored_name!r}")
    return None


def _octal(field: bytes) -> int:
    # tarfile.nti handles octal and GNU base-256 numbers.
    return tarfile.nti(field)


def _pax_records(data: bytes, where: str) -> dict[str, str]:
    """``length key=value\\n`` records of a pax extended header."""
    out = {}
    pos = 0
    while pos < len(data):
        if data[pos] == 0:
            break
        space = data.find(b" ", pos)
        if space < 0:
            raise ShardFormatError(f"{where}: malformed pax record at +{pos}")
        try:
            length = int(data[pos:space])
        except ValueError:
            raise ShardFormatError(f"{where}: malformed pax record length at +{pos}") from None
        if length <= 0 or pos + length > len(data):
            raise ShardFormatError(f"{where}: pax record length {length} out of range")
        record = data[space + 1:pos + length - 1]
        key, _, value = record.partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def _valid_header(block: bytes) -> bool:
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        return True
    except tarfile.HeaderError:
        return False


def scan_members(pread: Callable[[int, int], bytes], size: int, where: str,
                 warn: Callable[[str], None], strict: bool = False) -> "Scanned":
    """The members a tar shard's headers give, and how the shard ends (see
    :func:`scan` for the arguments).

    Raises:
        ShardFormatError: the file is empty or holds no tar header at all, or a
            header record claims more than :data:`MAX_RECORD_BYTES`; with
            ``strict``, a member cut short by the end of the file.
    """
    if size == 0:
        raise ShardFormatError(f"{where}: empty file (0 bytes), not a tar shard")
    walk = _HeaderWalk(pread, size, where, warn, strict)
    walk.run()
    if not walk.valid and not walk.ended:
        head = pread(min(size, 32), 0)
        raise ShardFormatError(f"{where}: not a tar shard: no valid tar header in its {size} "
                               f"bytes (it starts with {head!r})")
    return Scanned(walk.members, size, walk.ended, walk.cut)


class _HeaderWalk:
    """One walk through a shard's headers, from the first to the end-of-archive
    marker or the end of the file (:func:`scan_members`)."""

    def __init__(self, pread: Callable[[int, int], bytes], size: int, where: str,
                 warn: Callable[[str], None], strict: bool) -> None:
        self.pread, self.size, self.where, self.warn, self.strict = pread, size, where, warn, strict
        self.members: list[tuple[str, int, int]] = []
        self.long_name: str | None = None  # from a GNU long-name record, for the next header
        self.pax: dict[str, str] = {}  # from a pax record, for the next header
        self.global_pax: dict[str, str] = {}
        self.ended = False  # the end-of-archive marker was seen
        self.cut = False  # the last member runs past the end of the file
        self.valid = 0  # valid headers seen

    def run(self) -> None:
        pread, size, where = self.pread, self.size, self.where
        pos = 0
        while pos + BLOCK <= size:
            block = pread(BLOCK, pos)
            if len(block) < BLOCK:
                break
            if block == bytes(BLOCK):
                self.ended = True
                break  # the end-of-archive marker
            if not _valid_header(block):
                pos = self._skip_corrupt(pos)
                continue
            self.valid += 1
            kind = block[156:157]
            length = _octal(block[124:136])
            if length < 0:  # a GNU base-256 size can be negative: the scan would go backwards
                raise ShardFormatError(f"{where}: the tar header at byte {pos} gives its member a "
                                       f"negative size ({length}): the shard is corrupt")
            if kind in (b"x", b"g", b"L", b"K"):
                if not self._record(kind, length, pos):
                    break
                pos += BLOCK + -(-length // BLOCK) * BLOCK
                continue
            pos = self._member(block, kind, length, pos)

    def _skip_corrupt(self, bad: int) -> int:
        """Past the corrupt header at ``bad`` to the next valid one (or the end)."""
        pos = bad + BLOCK
        while pos + BLOCK <= self.size and not _valid_header(self.pread(BLOCK, pos)):
            pos += BLOCK
        self.warn(f"{self.where}: corrupt tar header at byte {bad}; skipped {pos - bad} bytes to "
                  f"{'the next valid header' if pos + BLOCK <= self.size else 'the end of the shard'} "
                  f"(samples stored there are lost)")
        self.long_name, self.pax = None, {}
        return pos

    def _record(self, kind: bytes, length: int, pos: int) -> bool:
        """Read the long-name or pax record of the header at ``pos``; False when the
        shard ends inside it."""
        where = self.where
        if length > MAX_RECORD_BYTES:
            raise ShardFormatError(f"{where}: the {kind.decode()!r} header record at byte {pos} "
                                   f"claims {length} bytes (at most {MAX_RECORD_BYTES} are "
                                   f"read): not a shard feeder can index")
        data = self.pread(length, pos + BLOCK)
        if len(data) < length:
            self.warn(f"{where}: shard ends inside a {kind.decode()!r} header record at byte {pos}")
            return False
        if kind == b"x":
            self.pax = _pax_records(data, where)
        elif kind == b"g":
            self.global_pax.update(_pax_records(data, where))
        elif kind == b"L":
            self.long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
        return True

    def _member(self, block: bytes, kind: bytes, length: int, pos: int) -> int:
        """Note the member whose header is ``block`` at ``pos`` (a regular file's);
        where the next header is."""
        where = self.where
        data_at = pos + BLOCK
        name = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape").name
        if self.long_name is not None:
            name = self.long_name
        merged = {**self.global_pax, **self.pax}
        if "path" in merged:
            name = merged["path"]
        if "size" in merged:
            try:
                length = int(merged["size"])
            except ValueError:
                raise ShardFormatError(f"{where}: pax size {merged['size']!r} is not an int") from None
            if length < 0:
                raise ShardFormatError(f"{where}: the pax record before the tar header at byte "
                                       f"{pos} gives member {name!r} a negative size ({length}): "
                                       f"the shard is corrupt")
        self.long_name, self.pax = None, {}
        if kind in _FILE_TYPES:
            if data_at + length > self.size:
                self.cut = True
                if self.strict:
                    raise ShardFormatError(
                        f"{where}: ends inside member {name!r} (needs bytes up to "
                        f"{data_at + length}, the copy has {self.size}): the shard or its copy is "
                        f"truncated")
                self.warn(f"{where}: shard ends inside member {name!r} (needs bytes up to "
                          f"{data_at + length}, the shard has {self.size}): the shard is truncated")
            self.members.append((name, data_at, length))
        return data_at + -(-length // BLOCK) * BLOCK


@dataclass
class Scanned:
    """What :func:`scan_members` found in a shard's headers.

    Attributes:
        members: ``(name, data offset, size)`` of each regular file member.
        size: The shard's size, bytes.
        ended: The end-of-archive marker was found.
        cut: The last member runs past the end of the file.
    """

    members: list[tuple[str, int, int]]
    size: int
    ended: bool
    cut: bool

    def index(self, where: str, warn: Callable[[str], None]) -> ShardIndex:
        """The shard's index.

        Raises:
            ShardFormatError: the shard ends after a complete member without the
                end-of-archive marker (cut short: whatever followed is lost, and
                nothing else would say so).
        """
        if not self.ended and not self.cut:
            members = self.members
            last = f"after member {members[-1][0]!r}" if members else "before any member"
            raise ShardFormatError(
                f"{where}: ends at byte {self.size} {last} without the tar end-of-archive "
                f"marker: the shard is cut short and the samples stored after that point are "
                f"lost (copy or re-pack it whole)")
        index = ShardIndex.from_members(self.members, lambda msg: warn(f"{where}: {msg}"))
        index.shard_size = self.size
        return index


def scan(pread: Callable[[int, int], bytes], size: int, where: str,
         warn: Callable[[str], None], strict: bool = False) -> ShardIndex:
    """Index a tar shard from its headers (:func:`scan_members`, then
    :meth:`Scanned.index`).

    Args:
        pread: ``pread(length, offset) -> bytes`` on the shard.
        size: The shard's size, bytes.
        where: The shard's name, for messages.
        warn: Called with a message for each damaged spot (the scan goes on past it).
        strict: A member cut short by the end of the file is an error too (a copy
            of a remote shard: the copy, not the shard, may have been cut).

    Returns:
        The index (its ``shard_size`` is ``size``). A member cut short by the
        end of the shard stays in it (reading it fails, naming the shard and
        key); after a corrupt header the scan looks for the next valid header
        and warns how many bytes it passed over.

    Raises:
        ShardFormatError: the file is empty or holds no tar header at all (an
            error page, another format), it ends after a complete member
            without the end-of-archive marker, or a header record (long name,
            pax) claims more than :data:`MAX_RECORD_BYTES`.
    """
    return scan_members(pread, size, where, warn, strict).index(where, warn)
