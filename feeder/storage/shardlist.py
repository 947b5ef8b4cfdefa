"""Shard lists: what names a set of tar shards (a folder, a pattern with
``{000000..000099}`` braces, a path or URL, a list of them, or a ``train.json``
shard list in the ``wids`` format with each shard's sample count, size and
hash) and what the list says of each shard (:func:`resolve`, for
:class:`feeder.shards.TarShards`)."""

from __future__ import annotations

import collections
import glob
import json
import logging
import os
import posixpath
import re
from collections.abc import Iterable
from typing import Any

from .tar import MAX_LIST_BYTES, ShardFormatError, decode_image_sizes, read_bounded
from ..errors import safe_text

log = logging.getLogger("feeder.shards")

_BRACE = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{000..127}`` (zero-padded to the first bound's width) and ``{a,b}``
    groups, left to right: ``train-{000000..000002}.tar`` gives three names.

    Raises:
        ValueError: a range whose bounds are not integers, or that runs backwards.
    """
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    if ".." in body:
        lo, _, hi = body.partition("..")
        if not (lo.strip().isdigit() and hi.strip().isdigit()):
            raise ValueError(f"shard pattern {pattern!r}: range {{{body}}} needs integer bounds")
        a, b = int(lo), int(hi)
        if b < a:
            raise ValueError(f"shard pattern {pattern!r}: range {{{body}}} runs backwards")
        width = len(lo.strip())
        choices = [str(n).zfill(width) for n in range(a, b + 1)]
    else:
        choices = body.split(",")
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [head + c + rest for c in choices for rest in expand_braces(tail)]


def is_url(name: str) -> bool:
    return "://" in name and not name.startswith("file://")


def _local(name: str) -> str:
    return name[len("file://"):] if name.startswith("file://") else name


class ListEntry(dict):
    """What a shard list says of one shard: ``nsamples``, ``sha256`` (hex) and
    ``filesize`` (bytes), each only when the list gives it."""


_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_PLAIN_ENTRY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._\-/]*\Z")
_ODD_SEGMENT = re.compile(r"(^|/)\.{1,2}(/|$)|//")


def _join_remote(base_url: str, entry: str, where: str) -> str:
    """A remote shard list's entry as a URL: relative names resolve against the
    list's own location; local paths and ``file://`` are refused (a list fetched
    from a server must not make this process open its local files)."""
    from urllib.parse import urljoin  # noqa: PLC0415

    if _PLAIN_ENTRY.match(entry) and not _ODD_SEGMENT.search(entry) and "?" not in base_url \
            and "#" not in base_url and base_url.count("/") >= 3:
        # A plain relative name (letters, digits, ._-/ and no '.' or '..' segment):
        # what urljoin gives, at a fraction of its cost (urljoin took most of the
        # construction of a list of 10^5 shards).
        return base_url.rsplit("/", 1)[0] + "/" + entry
    if entry.startswith("file:") or os.path.isabs(entry) or entry.startswith("~") or "\0" in entry:
        raise ShardFormatError(f"{where}: entry {entry!r} names a local file; a remote shard "
                               f"list may name only remote shards (relative names or URLs)")
    if is_url(entry):
        return entry
    if ":" in entry.split("/", 1)[0]:
        raise ShardFormatError(f"{where}: entry {entry!r}: not a relative name or a URL")
    scheme, _, rest = base_url.split("?", 1)[0].partition("://")
    if scheme in ("http", "https"):
        return urljoin(base_url, entry)
    # urljoin knows only the schemes of the web: join other ones (s3://, gs://...)
    # the same way, '..' staying inside the bucket.
    host, _, path = rest.partition("/")
    joined = posixpath.normpath(posixpath.join("/" + posixpath.dirname(path), entry)).lstrip("/")
    return f"{scheme}://{host}/{joined}"


#: The most samples a shard list may say one shard holds (a tar member takes 512
#: bytes at least: 2 TiB of empty members).
MAX_SHARD_SAMPLES = 1 << 32


def _manifest(text: str, where: str) -> tuple[list[str], list[str] | None, dict[str, ListEntry]]:
    """Shard names, classes and per-shard facts of a shard list
    (``wids-shard-index-v1`` JSON, as ``feeder-pack`` writes it), names relative
    to the list's own location."""
    try:
        doc = json.loads(text)
        shards = [entry["url"] for entry in doc["shardlist"]]
        if not all(isinstance(u, str) and u for u in shards):
            raise TypeError("every 'url' must be a non-empty string")
    except RecursionError:
        raise ShardFormatError(f"{where}: not a shard list: JSON nested too deeply") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ShardFormatError(f"{where}: not a shard list (JSON with a 'shardlist' of "
                               f"{{'url': ...}} entries): {exc}") from exc
    remote = is_url(where)
    base = where.rsplit("/", 1)[0] if "/" in where else ""
    out = []
    facts: dict[str, ListEntry] = {}
    # Plain relative names join by concatenation (see _join_remote), the list's
    # folder computed once: a third of urljoin's time per entry.
    plain_base = (where.rsplit("/", 1)[0] + "/" if remote and "?" not in where and "#" not in where
                  and where.count("/") >= 3 else None)
    for s, entry in zip(shards, doc["shardlist"]):
        if plain_base is not None and _PLAIN_ENTRY.match(s) and not _ODD_SEGMENT.search(s):
            name = plain_base + s
        elif remote:
            name = _join_remote(where, s, where)
        elif is_url(s) or os.path.isabs(s) or not base:
            name = _local(s)
        else:
            name = f"{base}/{s}"
        out.append(name)
        fact = ListEntry()
        for key, kind in (("nsamples", int), ("filesize", int), ("sha256", str)):
            value = entry.get(key)
            if value is None:
                continue
            ok = (isinstance(value, kind) and not isinstance(value, bool)
                  and (kind is str or value >= 0))
            if kind is str:
                ok = ok and _HEX64.fullmatch(value) is not None
            if not ok:
                raise ShardFormatError(f"{where}: shard {s!r}: {key} {value!r} is not "
                                       f"{'a sha256 hex digest' if kind is str else 'an int >= 0'}")
            fact[key] = value.lower() if kind is str else value
        count = fact.get("nsamples")
        if count is not None:
            # Every sample is at least one member, and every member a 512-byte
            # header: a count past that is no real shard's (and a sum of such
            # counts could pass the 64-bit sample numbers).
            size = fact.get("filesize")
            most = MAX_SHARD_SAMPLES if size is None else min(MAX_SHARD_SAMPLES, size // 512)
            if count > most:
                raise ShardFormatError(
                    f"{where}: shard {s!r}: nsamples {count} is more than "
                    + (f"a shard of {size} bytes can hold (one 512-byte tar header per member: "
                       f"at most {most})" if size is not None and most < MAX_SHARD_SAMPLES
                       else f"a shard holds (at most {MAX_SHARD_SAMPLES})"))
        sizes = entry.get("image_sizes")
        if sizes is not None:
            try:
                fact["image_sizes"] = decode_image_sizes(sizes, None)
            except ValueError as exc:
                raise ShardFormatError(f"{where}: shard {s!r}: {exc}") from None
            if fact.get("nsamples") is not None and len(fact["image_sizes"]) != fact["nsamples"]:
                # The sizes are a hint for grouping; the count is checked against
                # the shard's own index (naming what is wrong) when it is read.
                log.warning("%s: shard %r: image_sizes holds %d sizes for nsamples %d; not used",
                            safe_text(where), s, len(fact["image_sizes"]), fact["nsamples"])
                del fact["image_sizes"]
        facts[name] = fact
    classes = doc.get("classes")
    return out, list(classes) if isinstance(classes, list) else None, facts


def resolve(spec: Any, options: dict | None = None, deadline: float | None = None
            ) -> tuple[list[str], list[str] | None, dict[str, ListEntry]]:
    """The shard names of ``spec``, the class names of its shard list, if any, and
    what the list says of each shard (sample count, size, hash).

    Args:
        spec: A directory (its ``*.tar``, sorted), a shard path or URL, a brace
            pattern, a local glob, a shard list (``.json``), or a list of these.

    Raises:
        FileNotFoundError: a directory without shards, a glob matching nothing.
        ValueError: a shard named twice (its samples would come twice an epoch,
            and a list's facts, ``nsamples`` among them, are the shard's).
    """
    names, classes, facts = _resolve(spec, options, deadline)
    if len(set(names)) != len(names):
        twice = next(name for name, n in collections.Counter(names).items() if n > 1)
        raise ValueError(f"TarShards: {spec!r} names shard {twice} more than once (entries "
                         f"{[k for k, name in enumerate(names) if name == twice]}): every sample "
                         f"must come once an epoch; list each shard once")
    return names, classes, facts


def _resolve(spec: Any, options: dict | None, deadline: float | None
             ) -> tuple[list[str], list[str] | None, dict[str, ListEntry]]:
    if isinstance(spec, (str, os.PathLike)):
        name = os.fspath(spec)
        if _BRACE.search(name):
            return expand_braces(name), None, {}
        if name.split("?", 1)[0].endswith(".json"):
            if is_url(name):
                from .fetch import fetch_small  # noqa: PLC0415 - fsspec only when remote

                raw = fetch_small(name, options=options, deadline=deadline)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ShardFormatError(f"{name}: not a shard list: not UTF-8 ({exc})") from None
                return _manifest(text, name)
            path = _local(name)
            try:
                text = read_bounded(path, MAX_LIST_BYTES, "shard list").decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ShardFormatError(f"{path}: not a shard list: not UTF-8 ({exc})") from None
            return _manifest(text, path)
        if is_url(name):
            return [name], None, {}
        path = _local(name)
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(glob.escape(path), "*.tar")))
            if not found:
                raise FileNotFoundError(f"TarShards: no *.tar shard in directory {path!r}")
            return found, None, {}
        if any(ch in path for ch in "*?["):
            found = sorted(glob.glob(path))
            if not found:
                raise FileNotFoundError(f"TarShards: no file matches {path!r}")
            return found, None, {}
        return [path], None, {}
    if isinstance(spec, Iterable):
        names: list[str] = []
        for item in spec:
            if not isinstance(item, (str, os.PathLike)):
                raise TypeError(f"TarShards: shard names must be str or path-like, got {item!r}")
            name = os.fspath(item)
            names.extend(expand_braces(name) if _BRACE.search(name) else [_local(name)])
        return names, None, {}
    raise TypeError(f"TarShards: expected a directory, a shard path or URL, a pattern or a "
                    f"list of them, got {spec!r}")
