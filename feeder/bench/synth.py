"""Shards synthesized on request from their names: a web-scale dataset on one
machine, with no disk.

:class:`SynthShards` describes ``nshards`` tar shards of ``per`` samples each,
in the WebDataset layout (``s0000000.jpg`` + ``s0000000.cls`` per sample), with
their ``.idx`` indices and a ``train.json`` shard list (``nsamples``,
``filesize``). Every member has a fixed size, so any byte range of any shard is
computed from arithmetic alone: the range's samples are built (tar headers,
the one JPEG, the label) and cut, in O(range) time, and the same name always
gives the same bytes. :class:`SynthServer` serves them over HTTP/1.1 with
ranges (``206`` + ``Content-Range``) and an ``ETag`` per shard, in a process of
its own so that serving takes no CPU or GIL time from the loader measured, and
counts the requests and the body bytes it sent.

Labels are the class of the sample's place in the dataset, classes laid out in
order (``classes`` runs of consecutive shards): the hardest case for a shuffle
that mixes only within windows of shards, as in datasets packed by crawl or by
class.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_BLOCK = 512
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
_NAME = re.compile(r"/shard-(\d{6})\.(tar|idx)$")
CONTROL = "/__feeder__/"


def _pad(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


class SynthShards:
    """The synthesized dataset (see the module docstring).

    Args:
        nshards: Shards.
        per: Samples per shard.
        image: The image bytes every sample holds (a JPEG).
        classes: Label classes, in runs of consecutive samples.
    """

    def __init__(self, nshards: int, per: int, image: bytes, classes: int = 1000) -> None:
        self.nshards, self.per, self.image, self.classes = nshards, per, image, classes
        self.jpg_pad = _pad(len(image))
        self.span = _BLOCK + self.jpg_pad + _BLOCK + _BLOCK  # header, image, header, label
        self.size = per * self.span + 2 * _BLOCK  # the archive ends with two zero blocks
        self._cache: dict[int, tuple[bytes, bytes]] = {}

    @property
    def samples(self) -> int:
        return self.nshards * self.per

    def name(self, k: int) -> str:
        return f"shard-{k:06d}.tar"

    def label(self, k: int, j: int) -> int:
        return (k * self.per + j) * self.classes // self.samples

    def _header(self, name: str, size: int) -> bytes:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = size, 0, 0o644
        return info.tobuf(format=tarfile.USTAR_FORMAT)

    def _parts(self, j: int) -> tuple[bytes, bytes]:
        # Sample j's bytes but its label are the same in every shard: made once
        # (tar headers cost 10 us each; a 35 MB shard holds 20000 of them).
        parts = self._cache.get(j)
        if parts is None:
            key = f"s{j:07d}"
            head = b"".join((self._header(key + ".jpg", len(self.image)), self.image,
                             bytes(self.jpg_pad - len(self.image)), self._header(key + ".cls", 4)))
            parts = self._cache[j] = (head, bytes(_BLOCK - 4))
        return parts

    def sample_bytes(self, k: int, j: int) -> bytes:
        head, tail = self._parts(j)
        return head + b"%04d" % self.label(k, j) + tail

    def read(self, k: int, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of shard ``k``."""
        end = min(end, self.size)
        if start >= end:
            return b""
        first, last = start // self.span, min(self.per, -(-end // self.span))
        parts = [self.sample_bytes(k, j) for j in range(first, last)]
        body = b"".join(parts)
        if end > self.per * self.span:
            body += bytes(2 * _BLOCK)
        base = first * self.span
        return body[start - base:end - base]

    def index_text(self, k: int) -> str:
        """Shard ``k``'s index in DALI's ``v1.2`` format (as ``feeder-pack`` writes)."""
        lines = [f"v1.2 {self.per}"]
        for j in range(self.per):
            at = j * self.span
            key = f"s{j:07d}"
            lines.append(f"jpg {at + _BLOCK} {len(self.image)} {key}.jpg "
                         f"cls {at + 2 * _BLOCK + self.jpg_pad} 4 {key}.cls")
        return "\n".join(lines) + "\n"

    def shard_list(self) -> bytes:
        """``train.json``: every shard's name, sample count and size."""
        entries = ",".join(f'{{"url":"{self.name(k)}","nsamples":{self.per},"filesize":{self.size}}}'
                           for k in range(self.nshards))
        return ('{"__kind__":"wids-shard-index-v1","name":"synth","shardlist":[' + entries
                + "]}").encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class name
        pass

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._serve(False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(True)

    def _empty(self, status: int, **headers: str) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _serve(self, body: bool) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        if path.startswith(CONTROL):
            payload = json.dumps(owner.counts(reset=path.endswith("reset"))).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)
            return
        synth = owner.synth
        if path.endswith("/train.json"):
            data: Any = owner.listing
            size, kind, k = len(data), "list", -1
        else:
            m = _NAME.search(path)
            k = int(m.group(1)) if m else -1
            if not 0 <= k < synth.nshards:
                owner.count("other", 0)
                return self._empty(404)
            kind = m.group(2)  # type: ignore[union-attr]
            if kind == "idx":
                data = synth.index_text(k).encode()
                size = len(data)
            else:
                data, size = None, synth.size
        start, end, status = 0, size, 200
        header = self.headers.get("Range")
        if header:
            m = _RANGE.match(header.strip())
            if m is None or int(m.group(1)) >= size:
                owner.count(kind, 0)
                return self._empty(416, Content_Range=f"bytes */{size}")
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            status = 206
        self.send_response(status)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"synth-{kind}-{k}-{size}"')
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            owner.count(kind, 0)
            return
        sent = 0
        if data is not None:
            self.wfile.write(data[start:end])
            sent = end - start
        else:
            # Whole shards stream in pieces of 256 samples: memory stays small.
            step = 256 * synth.span
            for a in range(start, end, step):
                piece = synth.read(k, a, min(end, a + step))
                self.wfile.write(piece)
                sent += len(piece)
        owner.count(kind, sent, whole=status == 200)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: "SynthServer"

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that closes its connection (a source closed mid-copy) is no
        # server error; anything else is printed as http.server does.
        import sys as _sys  # noqa: PLC0415

        if not isinstance(_sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class SynthServer:
    """Serves :class:`SynthShards` at ``http://127.0.0.1:<port>/`` (in this process;
    see :class:`SynthServerProcess` for one of its own)."""

    def __init__(self, synth: SynthShards) -> None:
        self.synth = synth
        self.listing = synth.shard_list()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, name="synth-http-server",
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def count(self, kind: str, sent: int, whole: bool = False) -> None:
        with self._lock:
            c = self._counts
            c[f"{kind}_requests"] = c.get(f"{kind}_requests", 0) + 1
            c[f"{kind}_bytes"] = c.get(f"{kind}_bytes", 0) + sent
            if kind == "tar":
                w = "tar_whole" if whole else "tar_range"
                c[f"{w}_requests"] = c.get(f"{w}_requests", 0) + 1
                c[f"{w}_bytes"] = c.get(f"{w}_bytes", 0) + sent

    def counts(self, reset: bool = False) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
            if reset:
                self._counts.clear()
        return out

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> "SynthServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SynthServerProcess:
    """A :class:`SynthServer` in a process of its own (``python -m feeder.bench.synth
    NSHARDS PER IMAGE_FILE CLASSES``); the same ``url`` and ``counts``."""

    def __init__(self, nshards: int, per: int, image_path: str, classes: int = 1000) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "feeder.bench.synth", str(nshards), str(per), image_path,
             str(classes)], stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline().strip() if self._proc.stdout else ""
        if not line.startswith("http://"):
            self._proc.kill()
            raise RuntimeError(f"the synthetic shard server did not start (said {line!r})")
        self.url = line

    @property
    def pid(self) -> int:
        """The server process's id (to read its CPU time)."""
        return self._proc.pid

    def counts(self, reset: bool = False) -> dict[str, int]:
        with urllib.request.urlopen(self.url + CONTROL + ("reset" if reset else "counts"),
                                    timeout=30) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)

    def __enter__(self) -> "SynthServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__":
    import signal

    with open(sys.argv[3], "rb") as f:
        image = f.read()
    server = SynthServer(SynthShards(int(sys.argv[1]), int(sys.argv[2]), image, int(sys.argv[4])))
    sys.stdout.write(server.url + "\n")
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    try:
        signal.pause()
    finally:
        server.close()
