"""The transfer stage driven alone on CPU: batches delivered in order with their
samples' indices, holes filled from the next batch with each index moving with
its sample. (Its CUDA side: tests/test_cuda_logic.py without a GPU,
tests/cuda/ on one; cut and padded variable-size copies: tests/test_variable_size.py.)"""

from __future__ import annotations

import numpy as np
import torch

from feeder.engine.batch import Batch, BufferPool
from feeder.engine.collate import Collator
from feeder.engine.queue import Channel, END
from feeder.engine.transfer import Converter, Delivery, Transfer

from stage_helpers import Control, drain_channel, join


def _completed_batch(pool, index, indices, labels):
    buf = pool.acquire(lambda: False)
    b = Batch(index, buf, len(indices))
    for slot, (i, y) in enumerate(zip(indices, labels)):
        buf.images[slot] = y
        buf.labels[slot] = y
        buf.indices[slot] = i
    return b


def started_transfer(batch_size):
    """A float32 CPU transfer stage, started, with its pool and channels."""
    pool = BufferPool(8, batch_size, 1, 1, pin=False)
    inbox, outbox = Channel("collate", 10), Channel("output", 10)
    collator = Collator(batch_size, ordered=True, drop_last=False, release=pool.release)
    device = torch.device("cpu")
    transfer = Transfer(Control(), collator, pool, device, Converter(torch.float32, None, device),
                        inbox, outbox)
    transfer.start()
    return transfer, pool, inbox, outbox


def test_transfer_sequences_batches_and_delivers_their_sample_indices():
    transfer, pool, inbox, outbox = started_transfer(2)
    inbox.put(_completed_batch(pool, 1, [30, 31], [3, 4]))  # out of order: waits for batch 0
    inbox.put(_completed_batch(pool, 0, [10, 11], [1, 2]))
    inbox.put(END)
    out = drain_channel(outbox)
    join(transfer)
    deliveries = out[:-1]
    assert all(isinstance(d, Delivery) for d in deliveries)
    assert [d.number for d in deliveries] == [0, 1]
    assert [list(d.indices) for d in deliveries] == [[10, 11], [30, 31]]
    assert [d.labels.tolist() for d in deliveries] == [[1, 2], [3, 4]]
    assert deliveries[0].images.dtype == torch.float32
    assert np.isclose(float(deliveries[0].images[1, 0, 0, 0]), 2 / 255)
    assert pool.count("free") == 2  # converted batches are copies: both buffers came back


def test_transfer_moves_indices_with_samples_when_filling_holes():
    transfer, pool, inbox, outbox = started_transfer(3)
    a = _completed_batch(pool, 0, [5, 6, 7], [50, 60, 70])
    a.holes.append(1)  # sample 6 was skipped
    inbox.put(a)
    b = _completed_batch(pool, 1, [8, 9, 10], [80, 90, 100])
    b.holes.append(0)  # sample 8 was skipped
    inbox.put(b)
    inbox.put(_completed_batch(pool, 2, [11, 12, 13], [110, 120, 130]))
    inbox.put(END)
    out = drain_channel(outbox)
    join(transfer)
    got = [([int(i) for i in d.indices], d.labels.tolist()) for d in out[:-1]]
    # Batch 0's survivors are topped up from batch 1; batch 2 passes through whole;
    # what is left of batch 1 ends the pass. Each index travels with its label.
    assert got == [([5, 7, 9], [50, 70, 90]), ([11, 12, 13], [110, 120, 130]), ([10], [100])]
