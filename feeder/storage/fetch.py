"""Remote objects through fsspec: the errors, the retries of transient
failures (:class:`Retrier`, see :mod:`feeder.storage.remote`), one file system per
protocol and options, and whole small files read within a bound (an index, a
shard list)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from . import http as _http
from .http import Validator
from .tar import MAX_INDEX_BYTES, MAX_LIST_BYTES, ShardFormatError, index_path

# The records keep the logger of the module these came from.
log = logging.getLogger("feeder.storage.remote")

T = TypeVar("T")

_MAX_BACKOFF_S = 10.0
_TRANSIENT_STATUS = {408, 425, 429}


class RemoteError(OSError):
    """A remote read failed (the message names the URL and what happened)."""


class HashMismatch(_http.BadAnswer):
    """A copy whose hash is not the shard list's (fetched again, as a cut copy is)."""


class ShardChangedError(RemoteError):
    """A remote shard is not the version its index was read from (re-published
    under the same URL, or cut), or a cached copy of it is damaged."""


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    if isinstance(exc, FileNotFoundError):
        return 404
    if isinstance(exc, PermissionError):
        return 403
    return None


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, _http.BadAnswer):
        return True  # a proxy that cut one body may not cut the next
    if isinstance(exc, (_http.RedirectLoop, _http.RangesIgnored, _http.TooLarge, _http.DeadlinePassed,
                        InterruptedError, ShardChangedError, ShardFormatError)):
        return False
    status = _status(exc)
    if status is not None:
        return status >= 500 or status in _TRANSIENT_STATUS
    try:
        import aiohttp  # noqa: PLC0415

        if isinstance(exc, aiohttp.ClientError):
            return True
    except ImportError:
        pass
    return isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError, OSError))


class Retrier:
    """Runs a request, retrying transient failures with exponential backoff.

    Args:
        retries: Retries after the first try.
        backoff_s: The first wait, seconds (doubled each retry, +-50% jitter).
        stop: Set to cut the waits short (the reader is closing).
    """

    def __init__(self, retries: int, backoff_s: float, stop: threading.Event) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if not backoff_s >= 0:
            raise ValueError(f"backoff_s must be >= 0 seconds, got {backoff_s!r}")
        self.retries = retries
        self.backoff_s = backoff_s
        self.stop = stop

    def __call__(self, url: str, what: str, fn: Callable[[], T], deadline: float | None = None) -> T:
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                status = _status(exc)
                if isinstance(exc, (ShardChangedError, ShardFormatError)):
                    raise  # says what is wrong and where already
                if isinstance(exc, _http.DeadlinePassed):
                    raise RemoteError(f"{url}: {what} stalled: no answer before the deadline "
                                      f"(TarShards(deadline_s=...))") from exc
                if not _transient(exc):
                    code = f"HTTP {status}" if status is not None else type(exc).__name__
                    msg = f"{url}: {what} failed: {code}: {exc}"
                    if status == 404:
                        raise FileNotFoundError(errno.ENOENT, msg) from exc
                    raise RemoteError(msg) from exc
                if attempt == self.retries or self.stop.is_set():
                    raise RemoteError(f"{url}: {what} failed after {attempt + 1} tries: "
                                      f"{type(exc).__name__}: {exc}") from exc
                wait = min(_MAX_BACKOFF_S, self.backoff_s * 2 ** attempt * random.uniform(0.5, 1.5))
                if deadline is not None and time.monotonic() + wait >= deadline:
                    raise RemoteError(f"{url}: {what} failed and the deadline leaves no time "
                                      f"to retry (TarShards(deadline_s=...)): "
                                      f"{type(exc).__name__}: {exc}") from exc
                log.debug("%s: %s failed (%s), retry %d in %.2f s", url, what, exc, attempt + 1, wait)
                self.stop.wait(wait)
        raise AssertionError("unreachable")


_fs_lock = threading.Lock()
_fs_cache: dict[tuple[str, str], Any] = {}


def filesystem(url: str, options: dict | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path)`` for ``url``.

    Raises:
        ImportError: fsspec (or the URL's backend) is not installed; says what to install.
    """
    try:
        import fsspec  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(f"reading {url} needs fsspec and aiohttp: pip install 'feeder[remote]'") from exc

    options = dict(options or {})
    protocol = url.split("://", 1)[0]
    if protocol in ("http", "https"):
        import aiohttp  # noqa: PLC0415

        # A stalled server must fail (and be retried), not hang a read forever.
        options.setdefault("client_kwargs", {"timeout": aiohttp.ClientTimeout(
            total=None, sock_connect=30, sock_read=60)})
    key = (protocol, repr(sorted(options.items())))
    with _fs_lock:
        fs = _fs_cache.get(key)
        if fs is None or getattr(fs, "_feeder_pid", None) != os.getpid():
            fs = fsspec.filesystem(protocol, **options)
            fs._feeder_pid = os.getpid()
            _fs_cache[key] = fs
    return fs, url if protocol in ("http", "https") else fs._strip_protocol(url)


def _split_query(url: str) -> tuple[str, str]:
    """``(url without its query, "?query" or "")``: a presigned URL's query is
    its credentials, kept on the request but not part of the file's name."""
    base, sep, query = url.partition("?")
    return base, sep + query


def remote_index_url(url: str) -> str:
    """The index URL of a remote shard: ``.tar`` replaced by ``.idx`` in the path,
    the query (a presigned URL's signature) kept."""
    base, query = _split_query(url)
    return index_path(base) + query


def fetch_bounded(url: str, limit: int, retrier: Retrier, options: dict | None = None,
                  deadline: float | None = None) -> tuple[bytes, Validator | None]:
    """The whole of a small remote file (a shard list, an index), at most ``limit``
    bytes, and its validator (None where the back-end gives none).

    Raises:
        RemoteError: larger than ``limit`` (naming it), or the read failed.
        FileNotFoundError: it does not exist (404).
    """
    fs, path = filesystem(url, options)

    def get() -> tuple[bytes, Validator | None]:
        if _http.is_http(fs):
            data, seen, _ = _http.read_whole(fs, path, retrier.stop, limit=limit, deadline=deadline)
            return data, seen  # type: ignore[return-value]
        size = fs.size(path)
        if size is not None and size > limit:
            raise _http.TooLarge(size, limit)
        data = fs.cat_file(path)
        if len(data) > limit:
            raise _http.TooLarge(len(data), limit)
        return data, None

    try:
        return retrier(url, "read", get, deadline)
    except RemoteError as exc:
        if isinstance(exc.__cause__, _http.TooLarge):
            raise RemoteError(f"{url}: {exc.__cause__.size} bytes, more than the {limit} "
                              f"bytes such a file may hold: not an index or shard list") from None
        raise


def fetch_small(url: str, retrier: Retrier | None = None, options: dict | None = None,
                limit: int = MAX_LIST_BYTES, deadline: float | None = None) -> bytes:
    """The whole of a small remote file (a shard list), at most ``limit`` bytes."""
    retrier = retrier or Retrier(5, 0.2, threading.Event())
    return fetch_bounded(url, limit, retrier, options, deadline)[0]


def _after_fork_in_child() -> None:
    global _fs_lock
    _fs_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
