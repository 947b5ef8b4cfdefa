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

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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

    def _serve(self, body: bool) -> None:
        owner = self.server.owner
        if self.path in (CONTROL + "count", CONTROL + "reset"):
            # The control paths of a server in another process (ServerProcess): not counted.
            if self.path.endswith("reset"):
                owner.reset_counts()
            payload = str(owner.count()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)
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
            self._record(302)
            self.send_response(302)
            self.send_header("Location", self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault == "reset":
            self._record(0)
            self.close_connection = True
            self.connection.close()
            return
        if isinstance(fault, int):
            self._record(fault)
            self.send_response(fault)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        rel = self.path.split("?", 1)[0].lstrip("/")
        path = os.path.realpath(os.path.join(owner.root, rel))
        if not path.startswith(os.path.realpath(owner.root) + os.sep) or not os.path.isfile(path):
            self._record(404)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        st = os.stat(path)
        size = st.st_size
        start, end, status = 0, size, 200
        header = None if owner.ignore_ranges else self.headers.get("Range")
        if header:
            m = _RANGE.match(header.strip())
            if m is None or (not m.group(1) and not m.group(2)):
                self._record(416)
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:  # a suffix: the last N bytes
                start = max(0, size - int(m.group(2)))
            if start >= size or start >= end:
                self._record(416)
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        if not owner.ignore_ranges:
            self.send_header("Accept-Ranges", "bytes")
        if owner.validators:
            # As nginx does: the ETag from the modification time and size.
            self.send_header("ETag", f'"{st.st_mtime_ns:x}-{size:x}"')
            self.send_header("Last-Modified", self.date_time_string(int(st.st_mtime)))
        cut = fault in ("truncate", "shortlen")
        if fault == "shortlen":  # a proxy that cut the body and its length alike
            end = start + (end - start) // 2
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            return
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start
            if fault == "truncate":
                left //= 2
            # A bandwidth limit sends small chunks, each once the shared budget allows.
            step = 1 << 20 if not owner.bandwidth else 16 << 10
            while left > 0:
                chunk = f.read(min(left, step))
                if not chunk:
                    break
                owner._throttle(len(chunk))
                self.wfile.write(chunk)
                left -= len(chunk)
        if cut:  # the connection drops mid-body
            self.close_connection = True
            self.wfile.flush()
            self.connection.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: "FileServer"


class FileServer:
    """Serves the files under ``root`` at ``http://127.0.0.1:<port>/``.

    Faults: :meth:`fail` queues what the next requests for a path get: an HTTP
    status (503, 404...), ``"reset"`` (the connection closes with no answer),
    ``"truncate"`` (half the body, then the connection closes), ``"shortlen"``
    (half the body with a ``Content-Length`` saying so: a cut that looks
    complete), ``"redirect"`` (a redirect to the same path: a loop) or
    ``"stall"`` (no answer until the server closes).

    Args:
        root: The folder served.
        latency_s: Delay before every answer, seconds.
        ignore_ranges: Answer every request with the whole file (status 200), as
            ``python -m http.server`` does.
        validators: Send ``ETag`` and ``Last-Modified`` (from the file's
            modification time and size, as nginx does).
        bandwidth: Bytes per second of response bodies, shared by every
            connection (a saturated link or a throttled bucket); 0: no limit.
    """

    def __init__(self, root: str | os.PathLike, latency_s: float = 0.0, ignore_ranges: bool = False,
                 validators: bool = True, bandwidth: float = 0.0) -> None:
        if bandwidth < 0:
            raise ValueError(f"bandwidth must be >= 0 bytes/s, got {bandwidth!r}")
        self.bandwidth = bandwidth
        # When the link is next free (perf_counter seconds): each chunk books its
        # share of it under the lock, then waits outside it.
        self._link_free = 0.0
        self.root = os.fspath(root)
        self.latency_s = latency_s
        self.ignore_ranges = ignore_ranges
        self.validators = validators
        self._closing = threading.Event()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._faults: list[tuple[Callable[[str], bool], Any]] = []
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
        with self._lock:
            self.requests.append(request)

    def count(self, match: Callable[[Request], bool] | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.requests if match is None or match(r))

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> "FileServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ServerProcess:
    """A :class:`FileServer` in a process of its own (``python -m
    feeder.bench.httpserver``), so that serving does not take CPU and GIL time
    from the loader being measured; the same ``url``, ``count`` and ``reset_counts``."""

    def __init__(self, root: str | os.PathLike, latency_s: float = 0.0, bandwidth: float = 0.0) -> None:
        import subprocess  # noqa: PLC0415
        import sys  # noqa: PLC0415

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "feeder.bench.httpserver", os.fspath(root), str(latency_s),
             str(bandwidth)],
            stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline().strip() if self._proc.stdout else ""
        if not line.startswith("http://"):
            self._proc.kill()
            raise RuntimeError(f"the HTTP server did not start (said {line!r})")
        self.url = line

    def _control(self, what: str) -> int:
        import urllib.request  # noqa: PLC0415

        with urllib.request.urlopen(self.url + CONTROL + what, timeout=30) as r:
            return int(r.read())

    def count(self) -> int:
        return self._control("count")

    def reset_counts(self) -> None:
        self._control("reset")

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except Exception:  # noqa: BLE001 - it must go
            self._proc.kill()
            self._proc.wait(10)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__":
    import signal
    import sys

    server = FileServer(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0,
                        bandwidth=float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
    sys.stdout.write(server.url + "\n")
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    try:
        signal.pause()
    finally:
        server.close()
