"""A small range-capable HTTP file server on the loopback interface, with injected
latency and failures and a count of requests: the remote storage of feeder's
tests and of ``feeder-bench remote``.

Why not nginx: the tests need, per request, a chosen status (503, 404), a
connection dropped mid-body, a delay, and an exact count of the requests made
(to show that the second epoch reads from the local cache); nginx gives none of
these without scripting modules, and is not on every machine that runs the
tests. What the client sees is real HTTP/1.1 over a real socket: persistent
connections, ``Range: bytes=a-b`` answered with ``206 Partial Content`` and
``Content-Range``, ``416`` past the end, ``HEAD`` with ``Content-Length`` and
``Accept-Ranges`` (what fsspec's HTTP file system relies on), bodies streamed
in chunks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
CONTROL = "/__feeder__/"


@dataclass
class Request:
    """One request the server answered: method, path, the Range header (or None),
    and the status it got."""

    method: str
    path: str
    range: str | None
    status: int


@dataclass
class Resource:
    """What a path serves: its kind (``"tar"``, ``"idx"``, ``"list"``, ``"file"``:
    the counts' keys), size, validators, and its bytes as chunks.

    ``chunks(start, end, step)`` yields bytes ``[start, end)`` in pieces of at
    most ``step`` bytes (bytes or memoryviews: a memoryview of a buffer held in
    memory goes to the socket without a copy).
    """

    kind: str
    size: int
    etag: str
    modified: float | None
    chunks: Callable[[int, int, int], Iterator[Any]]


class Store(Protocol):
    """Where a :class:`FileServer`'s resources come from."""

    def resource(self, path: str) -> Resource | None:
        """The resource at URL path ``path`` (no query), or None (a 404)."""


def kind_of(name: str) -> str:
    """The counts' key for a file name: shards, indices, shard lists, the rest."""
    for ext, kind in ((".tar", "tar"), (".idx", "idx"), (".json", "list")):
        if name.endswith(ext):
            return kind
    return "file"


class Folder:
    """The files under ``root``, as they are on disk."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.fspath(root)

    def resource(self, path: str) -> Resource | None:
        full = os.path.realpath(os.path.join(self.root, path.lstrip("/")))
        if not full.startswith(os.path.realpath(self.root) + os.sep) or not os.path.isfile(full):
            return None
        st = os.stat(full)

        def chunks(start: int, end: int, step: int) -> Iterator[bytes]:
            with open(full, "rb") as f:
                f.seek(start)
                left = end - start
                while left > 0:
                    chunk = f.read(min(left, step))
                    if not chunk:
                        return
                    left -= len(chunk)
                    yield chunk

        # As nginx does: the ETag from the modification time and size.
        return Resource(kind_of(full), st.st_size, f'"{st.st_mtime_ns:x}-{st.st_size:x}"',
                        st.st_mtime, chunks)


def memory_chunks(data: bytes | bytearray | memoryview) -> Callable[[int, int, int], Iterator[Any]]:
    """``Resource.chunks`` for bytes held in memory: slices of one memoryview, no copies."""
    view = memoryview(data)

    def chunks(start: int, end: int, step: int) -> Iterator[memoryview]:
        for a in range(start, end, step):
            yield view[a:min(end, a + step)]

    return chunks


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class name
        pass  # quiet: the tests read the request log instead

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    def _record(self, status: int) -> None:
        self.server.owner._record(Request(self.command, self.path, self.headers.get("Range"), status))

    def _empty(self, status: int, **headers: str) -> None:
        self._record(status)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _control(self, body: bool) -> bool:
        """Answer the control paths of a server in another process (not counted)."""
        owner = self.server.owner
        what = self.path[len(CONTROL):]
        if what == "count":
            payload = str(owner.count()).encode()
        elif what in ("counts", "reset"):
            payload = json.dumps(owner.counts(reset=what == "reset")).encode()
            if what == "reset":
                owner.reset_counts()
        else:
            return False
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)
        return True

    def _serve(self, body: bool) -> None:
        owner = self.server.owner
        if self.path.startswith(CONTROL) and self._control(body):
            return
        if owner.latency_s:
            time.sleep(owner.latency_s)  # the storage's answer time
        fault = owner._take_fault(self.path, self.command == "GET" and "Range" not in self.headers)
        if fault == "stall":
            # No answer until the server closes (a stalled storage back-end).
            self._record(0)
            owner._closing.wait(60)
            self.close_connection = True
            return
        if fault == "redirect":  # a loop: the path redirects to itself
            return self._empty(302, Location=self.path)
        if fault == "reset":
            self._record(0)
            self.close_connection = True
            self.connection.close()
            return
        if isinstance(fault, int):
            return self._empty(fault)
        res = owner.store.resource(self.path.split("?", 1)[0])
        if res is None:
            owner._tally("other", 0, False)
            return self._empty(404)
        size = res.size
        start, end, status = 0, size, 200
        header = None if owner.ignore_ranges else self.headers.get("Range")
        if header:
            m = _RANGE.match(header.strip())
            if m is None or (not m.group(1) and not m.group(2)):
                owner._tally(res.kind, 0, False)
                return self._empty(416, Content_Range=f"bytes */{size}")
            if m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:  # a suffix: the last N bytes
                start = max(0, size - int(m.group(2)))
            if start >= size or start >= end:
                owner._tally(res.kind, 0, False)
                return self._empty(416, Content_Range=f"bytes */{size}")
            status = 206
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        if not owner.ignore_ranges:
            self.send_header("Accept-Ranges", "bytes")
        if owner.validators:
            self.send_header("ETag", res.etag)
            if res.modified is not None:
                self.send_header("Last-Modified", self.date_time_string(int(res.modified)))
        cut = fault in ("truncate", "shortlen")
        if fault == "shortlen":  # a proxy that cut the body and its length alike
            end = start + (end - start) // 2
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        sent = 0
        if body:
            stop = start + (end - start) // 2 if fault == "truncate" else end
            # A bandwidth limit sends small chunks, each once the shared budget allows.
            for chunk in res.chunks(start, stop, 1 << 20 if not owner.bandwidth else 16 << 10):
                owner._throttle(len(chunk))
                self.wfile.write(chunk)
                sent += len(chunk)
        owner._tally(res.kind, sent, body and status == 200)
        if cut:  # the connection drops mid-body
            self.close_connection = True
            self.wfile.flush()
            self.connection.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: "FileServer"

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that closes its connection (a source closed mid-copy) is no
        # server error; anything else is printed as http.server does.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class FileServer:
    """Serves the files under ``root`` (or a :class:`Store`'s resources) at
    ``http://127.0.0.1:<port>/``.

    Faults: :meth:`fail` queues what the next requests for a path get: an HTTP
    status (503, 404...), ``"reset"`` (the connection closes with no answer),
    ``"truncate"`` (half the body, then the connection closes), ``"shortlen"``
    (half the body with a ``Content-Length`` saying so: a cut that looks
    complete), ``"redirect"`` (a redirect to the same path: a loop) or
    ``"stall"`` (no answer until the server closes).

    Counts: :meth:`count` over the request log (:attr:`requests`), and
    :meth:`counts`, the requests and body bytes sent by kind of resource
    (``tar_requests``, ``tar_bytes``, ``idx_...``, ``list_...``, ``other_...``
    for 404s; shards also as ``tar_whole_...`` and ``tar_range_...``).

    Args:
        root: The folder served (or None with ``store``).
        latency_s: Delay before every answer, seconds.
        ignore_ranges: Answer every request with the whole file (status 200), as
            ``python -m http.server`` does.
        validators: Send ``ETag`` and ``Last-Modified`` (from the file's
            modification time and size, as nginx does).
        bandwidth: Bytes per second of response bodies, shared by every
            connection (a saturated link or a throttled bucket); 0: no limit.
        store: Where the resources come from instead of ``root`` (e.g. shards
            synthesized from their names, :mod:`feeder.bench.synth`).
        log: Keep the log of every request (:attr:`requests`); a long benchmark
            keeps the counts alone.
    """

    def __init__(self, root: str | os.PathLike | None = None, latency_s: float = 0.0,
                 ignore_ranges: bool = False, validators: bool = True, bandwidth: float = 0.0,
                 store: Store | None = None, log: bool = True) -> None:
        if bandwidth < 0:
            raise ValueError(f"bandwidth must be >= 0 bytes/s, got {bandwidth!r}")
        if (root is None) == (store is None):
            raise ValueError("FileServer serves a root folder or a store: give one of them")
        self.bandwidth = bandwidth
        # When the link is next free (perf_counter seconds): each chunk books its
        # share of it under the lock, then waits outside it.
        self._link_free = 0.0
        self.root = None if root is None else os.fspath(root)
        self.store: Store = store if store is not None else Folder(root)  # type: ignore[arg-type]
        self.latency_s = latency_s
        self.ignore_ranges = ignore_ranges
        self.validators = validators
        self.log = log
        self._closing = threading.Event()
        self.requests: list[Request] = []
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._faults: list[tuple[Callable[[str], bool], Any, bool]] = []
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="test-http-server", daemon=True)
        self._thread.start()

    def _throttle(self, size: int) -> None:
        """Wait until ``size`` more bytes fit the bandwidth, over every connection."""
        if not self.bandwidth:
            return
        with self._lock:
            now = time.perf_counter()
            start = max(now, self._link_free)
            self._link_free = start + size / self.bandwidth
            until = self._link_free
        delay = until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def fail(self, match: str | Callable[[str], bool], *faults: Any, whole: bool = False) -> None:
        """The next ``len(faults)`` requests whose path ends with ``match`` (or for
        which ``match(path)`` is true) get these faults, in order; with ``whole``,
        only GETs of the whole file (no ``Range``) count."""
        test = match if callable(match) else (lambda p, m=match: p.split("?", 1)[0].endswith(m))
        with self._lock:
            self._faults.extend((test, f, whole) for f in faults)

    def _take_fault(self, path: str, whole_get: bool = False) -> Any:
        with self._lock:
            for i, (test, fault, whole) in enumerate(self._faults):
                if test(path) and (whole_get or not whole):
                    del self._faults[i]
                    return fault
        return None

    def _record(self, request: Request) -> None:
        if self.log:
            with self._lock:
                self.requests.append(request)

    def _tally(self, kind: str, sent: int, whole: bool) -> None:
        with self._lock:
            c = self._counts
            keys = [kind]
            if kind == "tar":
                keys.append("tar_whole" if whole else "tar_range")
            for key in keys:
                c[f"{key}_requests"] = c.get(f"{key}_requests", 0) + 1
                c[f"{key}_bytes"] = c.get(f"{key}_bytes", 0) + sent

    def counts(self, reset: bool = False) -> dict[str, int]:
        """Requests and body bytes by kind (see the class docstring); ``reset``
        starts them again from zero."""
        with self._lock:
            out = dict(self._counts)
            if reset:
                self._counts.clear()
        return out

    def count(self, match: Callable[[Request], bool] | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.requests if match is None or match(r))

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self._counts.clear()

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> "FileServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ChildServer:
    """A server in a process of its own (``python -m MODULE ARGS...``, which prints
    its URL on a line and serves until SIGTERM: :func:`serve_until_terminated`),
    so that serving takes no CPU or GIL time from the loader measured; its
    :attr:`url`, :attr:`pid` (to read its CPU time) and :meth:`counts`."""

    def __init__(self, module: str, *args: Any) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", module, *map(str, args)],
                                      stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline().strip() if self._proc.stdout else ""
        if not line.startswith("http://"):
            self._proc.kill()
            self._proc.wait(10)
            raise RuntimeError(f"the HTTP server ({module}) did not start (said {line!r})")
        self.url = line

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _control(self, what: str) -> bytes:
        import urllib.request  # noqa: PLC0415

        with urllib.request.urlopen(self.url + CONTROL + what, timeout=30) as r:
            return r.read()

    def counts(self, reset: bool = False) -> dict[str, int]:
        """The server's :meth:`FileServer.counts` (then zero with ``reset``)."""
        return json.loads(self._control("reset" if reset else "counts"))

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except Exception:  # noqa: BLE001 - it must go
            self._proc.kill()
            self._proc.wait(10)

    def __enter__(self) -> "ChildServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ServerProcess(ChildServer):
    """A :class:`FileServer` of ``root`` in a process of its own (``python -m
    feeder.bench.httpserver``); the same ``url``, ``count`` and ``reset_counts``."""

    def __init__(self, root: str | os.PathLike, latency_s: float = 0.0, bandwidth: float = 0.0) -> None:
        super().__init__("feeder.bench.httpserver", os.fspath(root), latency_s, bandwidth)

    def count(self) -> int:
        return int(self._control("count"))

    def reset_counts(self) -> None:
        self._control("reset")


def serve_until_terminated(server: FileServer) -> None:
    """A child server's main: print the URL, serve until SIGTERM, close."""
    import signal  # noqa: PLC0415

    sys.stdout.write(server.url + "\n")
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    try:
        signal.pause()
    finally:
        server.close()


if __name__ == "__main__":
    serve_until_terminated(FileServer(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0,
                                      bandwidth=float(sys.argv[3]) if len(sys.argv) > 3 else 0.0))
