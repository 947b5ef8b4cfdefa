"""Servers the tests read remote data from, as fixtures (registered in
``tests/conftest.py``).

The HTTP file server is ``feeder-bench remote``'s own
(:class:`feeder.bench.httpserver.FileServer`: ranges, injected latency,
bandwidth and faults, request counts): the tests and the benchmark measure
against the same server, and the tests reach it only through ``file_server``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from feeder.bench.httpserver import FileServer


@pytest.fixture
def file_server() -> Iterator[Callable[..., FileServer]]:
    """Makes loopback HTTP file servers: ``file_server(root, **options)`` serves the
    files under ``root`` at its ``url`` (options: ``latency_s``, ``ignore_ranges``,
    ``validators``, ``bandwidth``; faults with its ``fail()``, counts with its
    ``count()`` and ``counts()``). Use it as a context manager to stop it at a
    point of the test; any still serving stop when the test ends."""
    servers: list[FileServer] = []

    def serve(root: str | os.PathLike, **options: Any) -> FileServer:
        server = FileServer(root, **options)
        servers.append(server)
        return server

    yield serve
    for server in servers:
        server.close()  # safe after the test's own close
