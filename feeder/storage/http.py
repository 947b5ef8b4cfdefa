"""Verified HTTP requests for remote shards: what the server answered is checked
against what was asked before its bytes are used.

fsspec's HTTP file system returns a body whatever the status: a server that
ignores ``Range`` (``python -m http.server``, many proxies) answers ``200``
with the whole file, and a reader taking its first bytes as the sample
delivers wrong data. So the range reads, whole-file copies and small fetches
of :mod:`feeder.storage.remote` go through here, on fsspec's own aiohttp session and
event loop (its connection pool and ``storage_options`` are kept), and each
answer is checked:

- a range read needs ``206`` with a ``Content-Range`` naming exactly the bytes
  asked for (or fewer at the end of the file) and a body of that length; a
  ``200`` means the server ignores ranges (:class:`RangesIgnored`), anything
  else is an error carrying its status;
- a whole copy needs ``200`` and a body of its ``Content-Length``;
- every answer's ``ETag``, ``Last-Modified`` and total size are returned as a
  :class:`Validator`, which the caller compares with what it saw before (a
  shard re-published under the same URL changes them);
- ``Accept-Encoding: identity`` is sent so sizes are the stored bytes' sizes.

Requests run on fsspec's event loop and are cancelled when the caller's stop
event is set or its deadline passes, so no thread waits on a stalled server
beyond the bound it was given.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")
# How often a waiting thread looks at its stop event and deadline (seconds).
_POLL_S = 0.25
_CHUNK = 1 << 20


class HTTPStatusError(OSError):
    """The server answered an HTTP error status (``status`` holds it)."""

    def __init__(self, status: int, reason: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}".strip())
        self.status = status


class RedirectLoop(OSError):
    """The server redirected more often than the client follows (a loop)."""


class RangesIgnored(OSError):
    """A range request was answered with the whole file (status 200)."""


class BadAnswer(OSError):
    """An answer that does not match the request: a wrong ``Content-Range``, a
    body shorter than announced. Transient: a proxy that cut a body may not cut
    the next one."""


@dataclass(frozen=True)
class Validator:
    """What identifies one version of a remote file: its size (bytes) and the
    server's ``ETag`` and ``Last-Modified`` (None where not sent)."""

    size: int | None = None
    etag: str | None = None
    modified: str | None = None

    def change_from(self, old: "Validator") -> str | None:
        """How this version differs from ``old`` (None: no difference seen).
        Only what both know is compared."""
        diffs = []
        for name, label in (("size", "size"), ("etag", "ETag"), ("modified", "Last-Modified")):
            a, b = getattr(old, name), getattr(self, name)
            if a is not None and b is not None and a != b:
                diffs.append(f"{label} {a!r} -> {b!r}")
        return ", ".join(diffs) or None

    def merged(self, other: "Validator") -> "Validator":
        """Fields of ``other`` filling the ones this lacks."""
        return Validator(*(getattr(self, f) if getattr(self, f) is not None else getattr(other, f)
                           for f in ("size", "etag", "modified")))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "Validator | None":
        if not isinstance(d, dict):
            return None
        size = d.get("size")
        etag = d.get("etag")
        modified = d.get("modified")
        if not (size is None or (isinstance(size, int) and size >= 0)):
            return None
        if not all(v is None or isinstance(v, str) for v in (etag, modified)):
            return None
        return cls(size, etag, modified)


def _validator(headers: Any, size: int | None) -> Validator:
    etag = headers.get("ETag")
    if etag is not None and etag.startswith("W/"):
        etag = None  # a weak ETag may stay the same across different bytes
    return Validator(size, etag, headers.get("Last-Modified"))


def _length(headers: Any) -> int | None:
    value = headers.get("Content-Length")
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise BadAnswer(f"Content-Length {value!r} is not a number") from None
    if n < 0:
        raise BadAnswer(f"negative Content-Length {n}")
    return n


def _url(fs: Any, url: str) -> Any:
    """The URL to request. One holding ``%`` escapes was encoded by whoever made it
    (a presigned URL's signature is): sent exactly as given, since decoding and
    re-encoding it could change the signed bytes."""
    if "%" in url:
        import yarl  # noqa: PLC0415 - aiohttp's URL type

        return yarl.URL(url, encoded=True)
    return fs.encode_url(url)


def _raise_for(r: Any) -> None:
    if r.status >= 300:
        raise HTTPStatusError(r.status, r.reason or "")


async def _range(fs: Any, url: str, start: int, end: int) -> tuple[bytes, Validator]:
    session = await fs.set_session()
    kw = fs.kwargs.copy()
    headers = dict(kw.pop("headers", None) or {})
    headers.update({"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
    async with session.get(_url(fs, url), headers=headers, **kw) as r:
        if r.status == 200:
            raise RangesIgnored(f"asked for bytes {start}-{end - 1}, got status 200 (the whole file)")
        if r.status == 416:
            raise HTTPStatusError(416, "Range Not Satisfiable: the file ends before byte "
                                       f"{start} (it is shorter than its index says)")
        _raise_for(r)
        if r.status != 206:
            raise BadAnswer(f"asked for bytes {start}-{end - 1}, got status {r.status}")
        m = _CONTENT_RANGE.match(r.headers.get("Content-Range", "").strip())
        if m is None:
            raise BadAnswer(f"206 without a valid Content-Range "
                            f"({r.headers.get('Content-Range')!r})")
        a, b = int(m.group(1)), int(m.group(2))
        total = None if m.group(3) == "*" else int(m.group(3))
        # Fewer bytes than asked only at the end of the file.
        if a != start or b > end - 1 or b < a or (b < end - 1 and (total is None or b != total - 1)):
            raise BadAnswer(f"asked for bytes {start}-{end - 1}, the server sent "
                            f"{m.group(0)!r}")
        body = await r.read()
        if len(body) != b - a + 1:
            raise BadAnswer(f"Content-Range {m.group(0)!r} but a body of {len(body)} bytes")
        return body, _validator(r.headers, total)


async def _whole(fs: Any, url: str, out: BinaryIO | None, limit: int | None,
                 stop: threading.Event) -> tuple[bytes | None, Validator, str]:
    session = await fs.set_session()
    kw = fs.kwargs.copy()
    headers = dict(kw.pop("headers", None) or {})
    headers["Accept-Encoding"] = "identity"
    digest = hashlib.sha256()
    async with session.get(_url(fs, url), headers=headers, **kw) as r:
        _raise_for(r)
        if r.status != 200:
            raise BadAnswer(f"asked for the whole file, got status {r.status}")
        announced = _length(r.headers)
        if limit is not None and announced is not None and announced > limit:
            raise TooLarge(announced, limit)
        got = 0
        parts = []
        while True:
            if stop.is_set():
                raise InterruptedError("stopped (closing)")
            chunk = await r.content.read(_CHUNK)
            if not chunk:
                break
            got += len(chunk)
            if limit is not None and got > limit:
                raise TooLarge(got, limit)
            digest.update(chunk)
            if out is None:
                parts.append(chunk)
            else:
                out.write(chunk)
        if announced is not None and got != announced:
            raise BadAnswer(f"the body ended after {got} of the {announced} bytes its "
                            f"Content-Length announced")
        return (b"".join(parts) if out is None else None), _validator(r.headers, got), digest.hexdigest()


class DeadlinePassed(TimeoutError):
    """The caller's deadline passed before the server answered."""


class TooLarge(OSError):
    """A file larger than the caller's bound (``size`` and ``limit`` in bytes)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes, more than the bound of {limit}")
        self.size = size
        self.limit = limit


def _run(fs: Any, coro: Any, stop: threading.Event, deadline: float | None) -> Any:
    """Run ``coro`` on fsspec's loop; cancel it when ``stop`` is set or ``deadline``
    (``time.monotonic()``) passes (then TimeoutError)."""
    import concurrent.futures  # noqa: PLC0415

    fut = asyncio.run_coroutine_threadsafe(coro, fs.loop)
    while True:
        wait = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
        # Wait for the future itself, not for its result: on Python 3.11+ the
        # result's "not done yet" (concurrent.futures.TimeoutError) is the
        # built-in TimeoutError, which the request's own errors (aiohttp's
        # socket read timeout) also are; catching it here took a server that
        # stopped answering for a request still under way, forever.
        if concurrent.futures.wait([fut], wait).done:
            return fut.result()  # the value, or the request's own error
        if stop.is_set():
            fut.cancel()
            raise InterruptedError("stopped (closing)")
        if deadline is not None and time.monotonic() >= deadline:
            fut.cancel()
            raise DeadlinePassed("no answer within the deadline")


def _redirects(exc: BaseException) -> BaseException:
    import aiohttp  # noqa: PLC0415

    if isinstance(exc, aiohttp.TooManyRedirects):
        return RedirectLoop(f"redirect loop: more than {len(exc.history)} redirects "
                            f"({' -> '.join(str(h.url) for h in exc.history[:3])} ...)")
    return exc


def read_range(fs: Any, url: str, start: int, end: int, stop: threading.Event,
               deadline: float | None = None) -> tuple[bytes, Validator]:
    """Bytes ``[start, end)`` of ``url`` (fewer only at the end of the file), with
    the file's validator.

    Raises:
        RangesIgnored: the server answered with the whole file.
        BadAnswer: the answer does not match the request.
        HTTPStatusError: an error status.
    """
    try:
        return _run(fs, _range(fs, url, start, end), stop, deadline)
    except Exception as exc:
        raise _redirects(exc) from exc


def read_whole(fs: Any, url: str, stop: threading.Event, *, out: BinaryIO | None = None,
               limit: int | None = None, deadline: float | None = None
               ) -> tuple[bytes | None, Validator, str]:
    """The whole of ``url``: ``(bytes or None when written to out, validator, sha256 hex)``.

    Raises:
        TooLarge: more than ``limit`` bytes (announced or received).
        BadAnswer: a body shorter than its ``Content-Length``.
        HTTPStatusError: an error status.
    """
    try:
        return _run(fs, _whole(fs, url, out, limit, stop), stop, deadline)
    except Exception as exc:
        raise _redirects(exc) from exc


def is_http(fs: Any) -> bool:
    protocol = getattr(fs, "protocol", None)
    if isinstance(protocol, str):
        return protocol in ("http", "https")
    return isinstance(protocol, tuple) and ("http" in protocol or "https" in protocol)
