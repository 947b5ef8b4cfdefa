"""The collating loop both last stages share, and the seams of a buffer seen
from two processes (mirror/attach) and of the schema (state/adopt)."""

from __future__ import annotations

import numpy as np

from feeder.engine.batch import Batch, BufferPool, BatchBuffer
from feeder.engine.collate import CollatingStage, Collator
from feeder.engine.queue import END, Channel
from feeder.sample import MASKS, NUMERIC, Schema
from feeder.engine.stage import Counters
from feeder.errors import FeederError


def _stage(batches, ordered=True):
    pool = BufferPool(8, 2, 2, 2, pin=False)
    inbox = Channel("collate", 16)
    made = []
    for index, labels, error in batches:
        buf = pool.acquire(lambda: False)
        b = Batch(index, buf, len(labels))
        buf.labels[:len(labels)] = labels
        if error is not None:
            b.fail(0, error)
        made.append(b)
    for b in made:
        inbox.put(b)
    inbox.put(END)
    stage = CollatingStage(None, Collator(2, ordered, False, pool.release), pool, inbox, None)
    return stage, pool


def test_collate_delivers_every_batch_in_order_and_returns_none_at_the_end():
    stage, _ = _stage([(1, [2, 3], None), (0, [0, 1], None)])
    got = []
    assert stage.collate(Counters(), lambda buf, n, c: got.append(list(buf.labels[:n]))) is None
    assert got == [[0, 1], [2, 3]]


def test_collate_returns_a_batch_error_instead_of_raising_it():
    error = FeederError("sample 2 failed")
    stage, pool = _stage([(0, [0, 1], None), (1, [2, 3], error), (2, [4, 5], None)])
    got = []
    assert stage.collate(Counters(), lambda buf, n, c: got.append(list(buf.labels[:n]))) is error
    assert got == [[0, 1]]  # nothing after the failed batch


def test_collate_returns_an_error_deliver_raises():
    stage, _ = _stage([(0, [0, 1], None)])

    def deliver(buf, n, c):
        raise FeederError("refused")

    error = stage.collate(Counters(), deliver)
    assert isinstance(error, FeederError) and str(error) == "refused"


def test_a_mirror_attached_to_a_shared_buffer_sees_its_memory():
    buf = BatchBuffer(2, 4, 4, pin=False, serial=7, shared=True)
    buf.write(0, [("mask", MASKS, np.full((4, 4), 300, np.uint16)),
                  ("score", NUMERIC, np.float32(0.5))])
    view = BatchBuffer.mirror(7)
    for key, tensor in buf.shared_tensors():
        view.attach(key, tensor)
    assert view.serial == 7 and view.shared
    buf.images[1] = 9
    buf.labels[1] = 42
    assert (view.images[1] == 9).all() and view.labels[1] == 42
    assert view.arrays["score"][1][0] == np.float32(0.5)
    assert (view.planes.low[0] == 300 & 0xFF).all() and (view.planes.high[0] == 1).all()
    assert not view.planes.wide.any()  # which slots are wide travels with each batch


def test_schema_state_adopted_elsewhere_is_the_same_schema():
    schema = Schema()
    schema.check(3, True, ("image", "label"), {"label": np.int64(1)})
    other = Schema()
    other.adopt(schema.state())
    assert other.state() == schema.state()
    assert other.is_dict and other.keys == ("image", "label")
