"""Shards synthesized on request from their names: a web-scale dataset on one
machine, with no disk.

:class:`SynthShards` describes ``nshards`` tar shards of ``per`` samples each,
in the WebDataset layout (``s0000000.jpg`` + ``s0000000.cls`` per sample), with
their ``.idx`` indices and a ``train.json`` shard list (``nsamples``,
``filesize``). Every member has a fixed size, so any byte range of any shard is
computed from arithmetic alone and the same name always gives the same bytes.
Every shard is the same bytes but its labels: the server builds one template
shard at start (tar headers, the one JPEG, a label placeholder) and stamps a
shard's labels into a copy of it when the shard is asked for (a copy and one
vectorized write, a few milliseconds for 35 MB), keeping the last few in memory
and writing their slices to the socket without copies, so that serving costs
little beside the socket's own work. :class:`SynthServer` serves them over
HTTP/1.1 with ranges (``206`` + ``Content-Range``) and an ``ETag`` per shard,
with :class:`feeder.bench.httpserver.FileServer` (the same range, fault and
count handling as the tests' server), and :class:`SynthServerProcess` in a
process of its own so that serving takes no CPU or GIL time from the loader
measured (its CPU time is read separately: ``pid``).

Labels are the class of the sample's place in the dataset, classes laid out in
order (``classes`` runs of consecutive shards): the hardest case for a shuffle
that mixes only within windows of shards, as in datasets packed by crawl or by
class.
"""

from __future__ import annotations

import re
import sys
import tarfile
import threading
from collections import OrderedDict

import numpy as np

from .httpserver import ChildServer, FileServer, Resource, memory_chunks, serve_until_terminated

_BLOCK = 512
_NAME = re.compile(r"/shard-(\d{6})\.(tar|idx)$")
_LABEL_DIGITS = 4


def _pad(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


class SynthShards:
    """The synthesized dataset (see the module docstring), and the store a
    :class:`~feeder.bench.httpserver.FileServer` serves it from.

    Args:
        nshards: Shards.
        per: Samples per shard.
        image: The image bytes every sample holds (a JPEG).
        classes: Label classes, in runs of consecutive samples (at most 10^4:
            a label is 4 digits).
        keep: Stamped shards kept in memory (the server's working set: a client
            copying a shard while it reads ranges of it asks it more than once).
    """

    def __init__(self, nshards: int, per: int, image: bytes, classes: int = 1000,
                 keep: int = 4) -> None:
        if not 0 < classes <= 10**_LABEL_DIGITS:
            raise ValueError(f"classes must be in 1..{10**_LABEL_DIGITS}, got {classes}")
        self.nshards, self.per, self.image, self.classes = nshards, per, image, classes
        self.jpg_pad = _pad(len(image))
        self.span = _BLOCK + self.jpg_pad + _BLOCK + _BLOCK  # header, image, header, label
        self.size = per * self.span + 2 * _BLOCK  # the archive ends with two zero blocks
        self._keep = keep
        self._template: bytes | None = None
        self._index: bytes | None = None
        self._listing: bytes | None = None
        self._stamped: OrderedDict[int, bytearray] = OrderedDict()
        self._lock = threading.Lock()

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

    def _label_at(self, j: int) -> int:
        """Where sample ``j``'s label starts in its shard."""
        return j * self.span + _BLOCK + self.jpg_pad + _BLOCK

    def template(self) -> bytes:
        """A shard's bytes with every label ``0000``: made once (tar headers cost
        10 us each; a 35 MB shard holds 20000 of them)."""
        if self._template is None:
            pad, tail = bytes(self.jpg_pad - len(self.image)), bytes(_BLOCK - _LABEL_DIGITS)
            parts = []
            for j in range(self.per):
                key = f"s{j:07d}"
                parts += [self._header(key + ".jpg", len(self.image)), self.image, pad,
                          self._header(key + ".cls", _LABEL_DIGITS), b"0" * _LABEL_DIGITS, tail]
            parts.append(bytes(2 * _BLOCK))
            self._template = b"".join(parts)
        return self._template

    def shard(self, k: int) -> bytearray:
        """Shard ``k``'s bytes: the template with its labels stamped in (the
        last ``keep`` shards asked are kept)."""
        with self._lock:
            buf = self._stamped.get(k)
            if buf is not None:
                self._stamped.move_to_end(k)
                return buf
        buf = bytearray(self.template())
        j = np.arange(self.per, dtype=np.int64)
        labels = (k * self.per + j) * self.classes // self.samples
        digits = labels[:, None] // 10 ** np.arange(_LABEL_DIGITS - 1, -1, -1) % 10 + ord("0")
        at = self._label_at(0) + j[:, None] * self.span + np.arange(_LABEL_DIGITS)
        np.frombuffer(buf, np.uint8)[at] = digits
        with self._lock:
            self._stamped[k] = buf
            while len(self._stamped) > self._keep:
                self._stamped.popitem(last=False)
        return buf

    def sample_bytes(self, k: int, j: int) -> bytes:
        return bytes(self.shard(k)[j * self.span:(j + 1) * self.span])

    def read(self, k: int, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of shard ``k``."""
        return bytes(memoryview(self.shard(k))[max(0, start):min(end, self.size)])

    def index_text(self, k: int) -> str:
        """Shard ``k``'s index in DALI's ``v1.2`` format (as ``feeder-pack`` writes);
        the same for every shard."""
        if self._index is None:
            lines = [f"v1.2 {self.per}"]
            for j in range(self.per):
                at = j * self.span
                key = f"s{j:07d}"
                lines.append(f"jpg {at + _BLOCK} {len(self.image)} {key}.jpg "
                             f"cls {at + 2 * _BLOCK + self.jpg_pad} {_LABEL_DIGITS} {key}.cls")
            self._index = ("\n".join(lines) + "\n").encode()
        return self._index.decode()

    def shard_list(self) -> bytes:
        """``train.json``: every shard's name, sample count and size."""
        if self._listing is None:
            entries = ",".join(
                f'{{"url":"{self.name(k)}","nsamples":{self.per},"filesize":{self.size}}}'
                for k in range(self.nshards))
            self._listing = ('{"__kind__":"wids-shard-index-v1","name":"synth","shardlist":['
                             + entries + "]}").encode()
        return self._listing

    def resource(self, path: str) -> Resource | None:
        """The store's answer for a URL path: ``.../train.json``, ``.../shard-K.tar``
        or ``.../shard-K.idx`` (any prefix: S3's path-style bucket too)."""
        if path.endswith("/train.json"):
            data = self.shard_list()
            return Resource("list", len(data), f'"synth-list-{len(data)}"', None,
                            memory_chunks(data))
        m = _NAME.search(path)
        k = int(m.group(1)) if m else -1
        if not 0 <= k < self.nshards:
            return None
        kind = m.group(2)  # type: ignore[union-attr]
        if kind == "idx":
            self.index_text(k)
            data = self._index  # type: ignore[assignment]
            return Resource(kind, len(data), f'"synth-idx-{k}-{len(data)}"', None,
                            memory_chunks(data))
        # Stamped when its bytes are first sent (a HEAD does not need them).
        chunks = lambda a, b, step, k=k: memory_chunks(self.shard(k))(a, b, step)  # noqa: E731
        return Resource(kind, self.size, f'"synth-tar-{k}-{self.size}"', None, chunks)


class SynthServer(FileServer):
    """Serves :class:`SynthShards` at ``http://127.0.0.1:<port>/`` (in this process;
    see :class:`SynthServerProcess` for one of its own): a
    :class:`~feeder.bench.httpserver.FileServer` of the synthesized store, with
    counts and no request log."""

    def __init__(self, synth: SynthShards) -> None:
        self.synth = synth
        super().__init__(store=synth, log=False)


class SynthServerProcess(ChildServer):
    """A :class:`SynthServer` in a process of its own (``python -m feeder.bench.synth
    NSHARDS PER IMAGE_FILE CLASSES``); the same ``url`` and ``counts``, and its
    ``pid``."""

    def __init__(self, nshards: int, per: int, image_path: str, classes: int = 1000) -> None:
        super().__init__("feeder.bench.synth", nshards, per, image_path, classes)


if __name__ == "__main__":
    with open(sys.argv[3], "rb") as f:
        image = f.read()
    synth = SynthShards(int(sys.argv[1]), int(sys.argv[2]), image, int(sys.argv[4]))
    synth.template()  # before the URL goes out: no client waits for it
    serve_until_terminated(SynthServer(synth))
