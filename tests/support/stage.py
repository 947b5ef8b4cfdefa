"""Stand-ins for driving one stage alone: a control that records what the stages
ask of the pipeline, and bounded draining and joining (tests/engine/test_stage.py,
tests/engine/test_transfer.py)."""

from __future__ import annotations

import threading

from feeder.engine.queue import END, Channel

TIMEOUT = 10.0


class Control:
    """Records what the stages ask of the pipeline."""

    def __init__(self):
        self.stop = False
        self.failures: list[BaseException] = []
        self.failed_samples: list[tuple[str, int, str]] = []
        self.started: list[str] = []
        self.exited: list[str] = []
        self._lock = threading.Lock()

    def stopped(self):
        return self.stop

    def fail(self, error):
        self.failures.append(error)

    def sample_failed(self, step, task, exc, c):
        with self._lock:
            self.failed_samples.append((step, task.index, type(exc).__name__))

    def thread_started(self, stage, c):
        with self._lock:
            self.started.append(stage)

    def thread_exited(self, stage, c):
        with self._lock:
            self.exited.append(stage)


def drain_channel(ch: Channel) -> list:
    """Everything up to and including END (each get bounded by TIMEOUT)."""
    out = []
    while True:
        item = ch.get(timeout=TIMEOUT)
        out.append(item)
        if item is END:
            return out


def join(stage) -> None:
    for t in stage.threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in stage.threads)
