"""The ``bare`` row of ``peers``: the per-sample work with no loader around it.

One process per core calls feeder's per-sample work as a Python function
(:class:`~feeder.bench.loaders.FeederWorkDataset`'s: read the file, then the
region decode, crop, resize and flip into one preallocated output), the very
call the DataLoader and SPDL rows make for each sample, with nothing around
it: no queue, no batch, no hand-off, no collation, no other thread. Every
process first reads every file once (the first epoch, whose rate is
therefore not a loader's and is not reported), so that in the later epochs
each of its reads finds the file verified and indexed, as in a feeder after
its first epoch. Each later epoch is shuffled, and the processes take its
indices in chunks of :data:`CHUNK` from a shared counter, so that none waits
for another but at the epoch's very end.

No loader that runs the work through that call (DataLoader, SPDL) can pass
this row's steady rate on these cores; their ratio to it is the share of the
machine their own machinery leaves to the work. feeder's engine runs the same
work through other paths (the reads and decodes of a run of files in one C
call, one verified memory and Huffman table cache for its threads), so it can
pass it.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..engine.threads import available_cores
from .ceiling import next_result

_TIMEOUT_S = 900.0  # one epoch of one process, on a loaded machine
CHUNK = 16  # indices a process takes at a time


def _worker(root: str, size: int, seed: int, limit: int | None, share: int, shares: int,
            commands: Any, results: Any, taken: Any) -> None:
    try:
        import cv2

        from ..sample.rng import sample_key
        from .loaders import FeederWorkDataset, transforms

        cv2.setNumThreads(1)  # as every loader's worker (one process per core here)
        ds = FeederWorkDataset(root, transforms(size), seed=seed, limit=limit)
        h, w = ds.work.image_size
        out = np.empty((h, w, 3), np.uint8)
        n = len(ds)
        while True:
            epoch = commands.get(timeout=_TIMEOUT_S)
            if epoch is None:
                return
            if epoch == 0:
                # Every file, in every process (see the module's text); counted as a
                # share of the epoch's images.
                for i in range(n):
                    data, _ = ds.source.read(i)
                    ds.work(data, sample_key(seed, epoch, i), out)
                results.put((share, None, len(range(share, n, shares)), int(out[0, 0, 0])))
                continue
            order = np.random.default_rng([seed, epoch]).permutation(n)
            count = 0
            while True:
                with taken.get_lock():
                    start = taken.value
                    taken.value = start + CHUNK
                if start >= n:
                    break
                for i in order[start:start + CHUNK].tolist():
                    data, _ = ds.source.read(i)
                    ds.work(data, sample_key(seed, epoch, i), out)
                    count += 1
            results.put((share, None, count, int(out[0, 0, 0])))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        results.put((share, f"{type(exc).__name__}: {exc}", 0, 0))


class BareLoader:
    """The ``bare`` row as a loader: each epoch runs the work in every process and
    yields, per process, a stand-in batch of that process's count of images (one
    value per image, the same for all: a view, no pixels).

    Args:
        root: ImageFolder root.
        size: RandomResizedCrop's output side.
        seed: Base of the per-sample keys and of each epoch's order.
        limit: Only this many of the images (:func:`~feeder.bench.loaders.image_source`).
        processes: Processes (default: the cores available).
    """

    def __init__(self, root: str, size: int, seed: int = 0, limit: int | None = None,
                 processes: int | None = None) -> None:
        self.processes = processes or available_cores()
        self.size = size
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
        self._results = ctx.Queue()
        self._taken = ctx.Value("q", 0)  # the epoch's indices taken so far
        self._commands = [ctx.Queue() for _ in range(self.processes)]
        self._procs = [ctx.Process(target=_worker, daemon=True, name=f"bare-{k}",
                                   args=(root, size, seed, limit, k, self.processes, self._commands[k],
                                         self._results, self._taken))
                       for k in range(self.processes)]
        for p in self._procs:
            p.start()

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with self._taken.get_lock():
            self._taken.value = 0
        for c in self._commands:
            c.put(epoch)
        deadline = time.monotonic() + _TIMEOUT_S
        for _ in self._procs:
            share, error, count, pixel = next_result(self._results, self._procs, deadline, "bare", _TIMEOUT_S)
            if error is not None:
                raise RuntimeError(f"bare: process bare-{share} failed: {error}")
            if count:
                batch = torch.full((1, 3, 1, 1), pixel, dtype=torch.uint8).expand(count, 3, self.size,
                                                                                  self.size)
                yield batch, torch.zeros(count, dtype=torch.int64)

    def stats(self) -> dict[str, Any]:
        return {"processes": self.processes}

    def close(self) -> None:
        for c in self._commands:
            try:
                c.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
