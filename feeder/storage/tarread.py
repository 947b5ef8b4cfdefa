"""Reading one sample's members from a tar shard, for :class:`feeder.shards.TarShards`.

:class:`MemberReader` holds the source's limits and field names; given a shard,
its index and the sample's member numbers, it bounds each member's size before
reading (sizes come from tar headers or an index file), reads the members with
one call when the gaps between them are small, checks nothing was cut short,
and decodes members into fields (:meth:`MemberReader.read_dict`). Errors name
the shard, the key and the field (also as the error's ``field``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .fields import field_of, json_value, make_plan, npy_array
from .tar import ShardFormatError, ShardIndex
from .tarscan import BLOCK, header_disagrees

# A sample's members are read with one call (one request, remotely) when the
# gaps between them (tar headers, fields not asked for) add at most this much.
SPAN_SLACK = 64 << 10


def field_error(where: str, ext: str, name: str, what: str) -> ShardFormatError:
    """The error for field ``name`` (member ``.ext``) of the sample ``where``
    (``shard:key``), with the field as its ``field``."""
    exc = ShardFormatError(f"{where}: field {name!r} (.{ext}) {what}")
    exc.field = name  # type: ignore[attr-defined]
    return exc


def decode_field(raw: bytes, where: str, ext: str, name: str, fmt: str) -> Any:
    """One member's bytes as its field's value (see :func:`field_of`)."""
    if fmt == "bytes":
        return raw
    try:
        if fmt == "cls":
            return int(raw.decode("ascii").strip())
        if fmt == "txt":
            return raw.decode("utf-8")
        if fmt == "json":
            return json_value(raw)
        return npy_array(raw)
    except (UnicodeDecodeError, ValueError, OSError, EOFError, RecursionError) as exc:
        what = {"cls": "is not an integer", "txt": "is not UTF-8 text",
                "json": "is not JSON", "npy": "is not a .npy array"}[fmt]
        raise field_error(where, ext, name, f"{what} ({type(exc).__name__}: {exc}): "
                                            f"{raw[:40]!r}") from None


def plan_fields(fields: Any, entries: list[tuple], n: int, where: str, source: str,
                image_exts: Sequence[str], label: str | None) -> dict[str, tuple[str, str]] | None:
    """What a sample read gives, decided from the member table's ``entries`` (of
    the shards checked, named by ``where``; ``source`` names the whole source, of
    ``n`` samples): ``{extension: (field name, format)}`` of a dict sample's
    members besides its image (see ``TarShards(fields=)``), or None for pairs.

    Raises:
        ValueError: no sample has an image, or a label when they are pairs;
            ``fields`` asks for what no sample has.
    """
    exts_seen: set[str] = set()
    for e in entries:
        exts_seen.update(e[0].exts)
    found = ", ".join(sorted(exts_seen)) or "none"
    if n and not any(m >= 0 for e in entries for m in e[1]):
        raise ValueError(f"TarShards: none of the {n} samples in {where} has an image "
                         f"field ({', '.join(image_exts)}); fields found: {found}; "
                         f"give image_exts=")
    plan = make_plan(fields, exts_seen, found, tuple(image_exts), label, source)
    if n and plan is None and label is not None and not any(m >= 0 for e in entries for m in e[2]):
        raise ValueError(f"TarShards: none of the {n} samples in {where} has a "
                         f".{label} field holding its label; fields found: {found}; "
                         f"give label=None for unlabeled data (labels -1), or label='<ext>' "
                         f"naming the field that holds the class index")
    return plan


class MemberReader:
    """Reads and decodes a sample's members within a source's limits.

    Args:
        image_exts: The extensions that hold the image.
        label: The label's extension (None: unlabeled).
        max_image_bytes: The largest image member read, bytes.
        max_field_bytes: The largest other member read, bytes.
    """

    def __init__(self, image_exts: Sequence[str], label: str | None, max_image_bytes: int,
                 max_field_bytes: int) -> None:
        self.image_exts = image_exts
        self.label = label
        self.max_image_bytes = max_image_bytes
        self.max_field_bytes = max_field_bytes

    def read(self, shard: Any, ix: ShardIndex, j: int, members: list[int], all_offs: Any,
             all_sizes: Any) -> list[bytes]:
        """The bytes of ``members`` (member numbers of ``ix``) of sample ``j`` of
        ``shard``, whose members' offsets and sizes are ``all_offs`` and ``all_sizes``."""
        offs = [all_offs[m] for m in members]
        sizes = [all_sizes[m] for m in members]
        for m, n in zip(members, sizes):
            # Sizes come from tar headers or an index: bound them before reading.
            if n > self.max_field_bytes:
                ext = ix.exts[m]
                limit, opt = ((self.max_image_bytes, "max_pixels") if ext in self.image_exts
                              else (self.max_field_bytes, "max_field_bytes"))
                if n > limit:
                    name = "image" if ext in self.image_exts else field_of(ext, self.label)[0]
                    raise field_error(f"{shard.name}:{ix.keys[j]}", ext, name,
                                      f"holds {n} bytes, more than the {limit} this source "
                                      f"reads (TarShards({opt}=...))")
        lo = min(offs)
        hi = max(o + n for o, n in zip(offs, sizes))
        # A shard whose index was not checked against it (a remote one: see
        # RemoteShard.check_headers) has the tar header before the sample's first
        # member read with it, in the same request, and checked.
        head = BLOCK if getattr(shard, "check_headers", False) and lo >= BLOCK else 0
        if hi - lo <= sum(sizes) + SPAN_SLACK:
            blob = shard.pread(hi - lo + head, lo - head)
            header, blob = blob[:head], blob[head:]
            pieces = [blob[o - lo:o - lo + n] for o, n in zip(offs, sizes)]
        else:
            first = offs.index(lo)
            pieces = [shard.pread(n + head, o - head) if k == first else shard.pread(n, o)
                      for k, (o, n) in enumerate(zip(offs, sizes))]
            header, pieces[first] = pieces[first][:head], pieces[first][head:]
        if head:
            m = members[offs.index(lo)]
            why = header_disagrees(header, ix.names[m], int(all_sizes[m]), lo)
            if why is not None:
                raise ShardFormatError(
                    f"{shard.name}:{ix.keys[j]}: {why}: the shard's index does not describe it (the "
                    f"index of another shard, or the shard re-packed after its index was written): "
                    f"write its index again (feeder-pack)")
        for m, o, n, piece in zip(members, offs, sizes, pieces):
            if len(piece) != n:
                raise ShardFormatError(
                    f"{shard.name}:{ix.keys[j]}: truncated shard: member {ix.names[m]!r} needs "
                    f"bytes [{o}, {o + n}) but the shard ends before byte {o + n}")
        return pieces

    def record_plan(self, ix: ShardIndex, j: int) -> dict[str, tuple[str, str]]:
        """The plan of :meth:`read_dict` that gives every member of sample ``j``,
        named and decoded by its extension (:func:`field_of`)."""
        images = set(self.image_exts)
        plan = {}
        for m in ix.members(j):
            e = ix.exts[m]
            if e not in images and not (self.label is None and e == "cls"):
                plan[e] = field_of(e, self.label)
        return plan

    def parse_label(self, raw: bytes, where: str) -> int:
        """The label member's bytes (ASCII digits) as an int."""
        try:
            return int(raw.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise ShardFormatError(f"{where}: .{self.label} field is not an integer: "
                                   f"{raw[:40]!r}") from None

    def read_dict(self, shard: Any, ix: ShardIndex, j: int, img: int,
                  plan: dict[str, tuple[str, str]], required: bool, all_offs: Any,
                  all_sizes: Any) -> dict[str, Any]:
        """Sample ``j`` as a dict: its image (member ``img``) and the members
        ``plan`` names, decoded (``{extension: (field name, format)}``; the name
        ``"*"`` spreads a JSON object's keys). ``required``: a member of ``plan``
        the sample lacks is an error."""
        members = [img]
        exts = []
        for m in ix.members(j):
            e = ix.exts[m]
            if e in plan and e not in exts:
                members.append(m)
                exts.append(e)
        pieces = self.read(shard, ix, j, members, all_offs, all_sizes)
        where = f"{shard.name}:{ix.keys[j]}"
        if required and len(exts) < len(plan):
            missing = next(e for e in plan if e not in exts)
            raise field_error(where, missing, plan[missing][0],
                              f"missing (fields= asks for it); the sample has: "
                              f"{', '.join(ix.exts[m] for m in ix.members(j))}")
        out: dict[str, Any] = {"image": pieces[0]}
        for ext, raw in zip(exts, pieces[1:]):
            name, fmt = plan[ext]
            value = decode_field(raw, where, ext, name, fmt)
            if name != "*":
                out[name] = value
                continue
            if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
                raise field_error(where, ext, ext, f"is {type(value).__name__}, not a JSON "
                                                   f"object, so its keys cannot become fields")
            for k, v in value.items():
                if k in out or any(plan[e][0] == k for e in exts):
                    raise field_error(where, ext, k, "is both a key of this JSON object and "
                                                     "another field of the sample")
                out[k] = v
        return out
