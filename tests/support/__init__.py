"""Shared helpers of the test suite, imported as ``from tests.support import ...``
(pytest advises against importing from ``conftest``; the fixtures stay in
``tests/conftest.py``).

* :mod:`tests.support.data`: encoded images, packed shards.
* :mod:`tests.support.sources`: in-memory sources (counting, blocking).
* :mod:`tests.support.passes`: bounded iteration of passes in helper threads,
  the feeder threads still alive, the reaper's queue run.
* :mod:`tests.support.servers`: the loopback HTTP file server, as a fixture.
* the rest by topic: ``cli``, ``cuda``, ``cuda_standin``, ``doctor``,
  ``faults``, ``fields``, ``instances``, ``jpeg``, ``stage``.
"""

import os

from .data import SIZES, content_hash, encode_jpeg, encode_png, pack_numbered
from .passes import (JOIN_TIMEOUT_S, collect, collected, drain, feeder_threads, labels_of, numpy_pair,
                     reaped, run_in_thread, wait_no_feeder_threads)
from .sources import BlockingSource, CountingSource, MemorySource

#: The test suite's folder, and the repository's (for subprocesses that import
#: ``tests.support``: put ``REPO_DIR`` on their path).
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_DIR = os.path.dirname(TESTS_DIR)

__all__ = [
    "BlockingSource",
    "CountingSource",
    "JOIN_TIMEOUT_S",
    "MemorySource",
    "REPO_DIR",
    "SIZES",
    "TESTS_DIR",
    "collect",
    "collected",
    "content_hash",
    "drain",
    "encode_jpeg",
    "encode_png",
    "feeder_threads",
    "labels_of",
    "numpy_pair",
    "pack_numbered",
    "reaped",
    "run_in_thread",
    "wait_no_feeder_threads",
]
