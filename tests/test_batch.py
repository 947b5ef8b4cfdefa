"""Buffer pool and collator."""

from __future__ import annotations

import threading

import pytest

from feeder._batch import Batch, BufferPool, Collator
from feeder._queue import Closed


def filled(pool, index, size, labels, holes=()):
    buf = pool.acquire(lambda: False)
    b = Batch(index, buf, size)
    for slot in range(size):
        buf.labels[slot] = labels[slot]
        buf.images[slot] = labels[slot] % 256
    b.holes.extend(holes)
    return b


def collect(outs):
    return [list(buf.labels[:n]) for buf, n in outs]


def test_full_batches_pass_through_in_order():
    pool = BufferPool(8, 4, 2, 2, pin=False)
    col = Collator(4, ordered=True, drop_last=False, release=pool.release)
    b1 = filled(pool, 1, 4, [4, 5, 6, 7])
    b0 = filled(pool, 0, 4, [0, 1, 2, 3])
    assert collect(col.add(b1)) == []  # waits for batch 0
    assert collect(col.add(b0)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_holes_are_refilled_and_images_follow_labels():
    pool = BufferPool(8, 4, 2, 2, pin=False)
    col = Collator(4, ordered=True, drop_last=False, release=pool.release)
    out = []
    out += list(col.add(filled(pool, 0, 4, [0, 1, 2, 3], holes=[1])))
    out += list(col.add(filled(pool, 1, 4, [4, 5, 6, 7], holes=[0, 3])))
    out += list(col.add(filled(pool, 2, 4, [8, 9, 10, 11])))
    out += list(col.finish())
    assert collect(out) == [[0, 2, 3, 5], [8, 9, 10, 11], [6]]
    for buf, n in out:
        assert (buf.images[:n, 0, 0, 0] == buf.labels[:n] % 256).all()


def test_drop_last_drops_the_open_batch():
    pool = BufferPool(8, 4, 2, 2, pin=False)
    col = Collator(4, ordered=False, drop_last=True, release=pool.release)
    out = list(col.add(filled(pool, 0, 3, [0, 1, 2]))) + list(col.finish())
    assert out == []


def test_batch_error_raised_in_order():
    pool = BufferPool(8, 2, 2, 2, pin=False)
    col = Collator(2, ordered=True, drop_last=False, release=pool.release)
    bad = filled(pool, 1, 2, [2, 3])
    bad.error = ValueError("x")
    assert list(col.add(bad)) == []
    with pytest.raises(ValueError):
        list(col.add(filled(pool, 0, 2, [0, 1])))


def test_pool_blocks_until_release_and_stops():
    pool = BufferPool(1, 1, 1, 1, pin=False)
    buf = pool.acquire(lambda: False)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(lambda: False)))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # no buffer free
    pool.release(buf)
    t.join(5)
    assert got == [buf]
    with pytest.raises(Closed):
        pool.acquire(lambda: True)


def test_pool_grows_when_everything_is_lent():
    pool = BufferPool(1, 1, 1, 1, pin=False)
    a = pool.acquire(lambda: False)
    pool.lend(a)
    b = pool.acquire(lambda: False)  # would deadlock otherwise
    assert b is not a and pool.allocated == 2


def test_double_release_is_ignored():
    pool = BufferPool(2, 1, 1, 1, pin=False)
    a = pool.acquire(lambda: False)
    pool.release(a)
    pool.release(a)
    x, y = pool.acquire(lambda: False), pool.acquire(lambda: False)
    assert x is not y
