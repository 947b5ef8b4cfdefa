"""feeder.engine.threads: the "auto" thread counts and OpenCV's thread pool while feeders run."""

from __future__ import annotations

import gc

import cv2
import pytest

from feeder.engine.config import Config
from feeder.engine.threads import (MAX_READ_THREADS, MIN_READ_THREADS, LibraryThreads, auto_read_threads,
                             auto_threads, available_cores, cores_for_this_rank)

from tests.support import reaped


def test_available_cores_is_the_affinity_mask(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert available_cores() == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(), raising=False)
    assert available_cores() == 1  # never zero


def test_auto_threads_are_a_decode_thread_per_core_at_least_two():
    assert auto_threads(1) == (2, 0)
    assert auto_threads(2) == (2, 0)
    assert auto_threads(16) == (16, 0)


@pytest.mark.parametrize("decode, expect", [(1, MIN_READ_THREADS), (2, 32), (8, MAX_READ_THREADS),
                                            (100, MAX_READ_THREADS)])
def test_auto_read_threads_are_bounded(decode, expect):
    assert auto_read_threads(decode) == expect


@pytest.mark.parametrize("affinity, machine, local_ranks, expect", [
    (16, 16, 1, 16),   # one process: every core
    (16, 16, 8, 2),    # 8 ranks free to run anywhere: the cores are divided
    (2, 16, 8, 2),     # ranks bound to their own cores: the mask already says it
    (2, 2, 8, 1),      # more ranks than cores: at least one each
])
def test_auto_threads_share_a_nodes_cores_among_its_ranks(affinity, machine, local_ranks, expect):
    assert cores_for_this_rank(affinity, machine, local_ranks) == expect


def test_auto_threads_read_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr("feeder.engine.threads.available_cores", lambda: 16)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert cores_for_this_rank() == 4
    cfg = Config.build(batch_size=4).resolved()
    assert (cfg.decode_threads, cfg.augment_threads) == auto_threads(4)


def test_a_malformed_local_world_size_counts_as_one_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    assert cores_for_this_rank(16, 16) == 16


@pytest.fixture
def opencv_threads():
    """OpenCV's pool at 3 threads for the test, restored after."""
    before = cv2.getNumThreads()
    cv2.setNumThreads(3)
    yield 3
    cv2.setNumThreads(before)


def test_library_threads_limit_opencv_while_any_user_holds_them(opencv_threads):
    # Feeders of earlier tests that were dropped unclosed: their close runs in the
    # reaper once collected, releasing their hold, so this test's are the only ones.
    gc.collect()
    reaped()
    LibraryThreads.acquire()
    try:
        assert cv2.getNumThreads() == 1
        LibraryThreads.acquire()  # a second feeder
        LibraryThreads.release()
        assert cv2.getNumThreads() == 1  # the first still runs
    finally:
        LibraryThreads.release()
    assert cv2.getNumThreads() == opencv_threads  # the last user restores the count


def test_library_threads_parked_stops_the_pool_for_the_duration(opencv_threads):
    with LibraryThreads.parked():
        assert cv2.getNumThreads() == 1
    assert cv2.getNumThreads() == opencv_threads
