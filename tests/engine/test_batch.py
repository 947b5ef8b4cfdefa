"""Buffer pool and collator."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from feeder.engine.batch import Batch, BufferPool
from feeder.engine.collate import Collator
from feeder.engine.queue import Closed


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


def _loop_holds(pool, buf):
    """``buf`` was delivered; the loop took it, keeps it, and waits in next() again."""
    pool.lend(buf)
    pool.set_consumer_waiting(False)
    pool.claim(buf)
    pool.set_consumer_waiting(True)


def _acquire_in_thread(pool, starving=None):
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(lambda: False, starving)), daemon=True)
    t.start()
    return t, got


def test_pool_grows_when_everything_is_lent():
    pool = BufferPool(1, 1, 1, 1, pin=False)
    a = pool.acquire(lambda: False)
    _loop_holds(pool, a)  # the training loop took the batch and keeps it, waiting for the next
    b = pool.acquire(lambda: False)  # would deadlock otherwise
    assert b is not a and pool.allocated == 2


def test_pool_stays_at_two_buffers_while_the_loop_waits():
    """The loop holds one batch and waits for the one being filled: a third buffer
    would not bring data sooner, so the pool waits for the held one to come back."""
    pool = BufferPool(8, 1, 1, 1, pin=False)
    held, filling = pool.acquire(lambda: False), pool.acquire(lambda: False)
    _loop_holds(pool, held)
    t, got = _acquire_in_thread(pool)
    t.join(0.3)
    assert t.is_alive() and pool.allocated == 2
    pool.release(held)  # the loop dropped it after receiving the next batch
    t.join(5)
    assert got == [held] and pool.allocated == 2
    pool.release(filling)


def _both_lent_while_the_reaper_works(monkeypatch, reaping_s):
    """A pool of two buffers, both batches the loop has taken (and waits for the
    next), while the reaper has work in hand for up to ``reaping_s``."""
    from feeder.engine import pool as pool_module, reaper

    monkeypatch.setattr(reaper, "pending", lambda: True)
    monkeypatch.setattr(pool_module, "_REAPING_S", reaping_s)
    pool = BufferPool(8, 1, 1, 1, pin=False)
    a, b = pool.acquire(lambda: False), pool.acquire(lambda: False)
    _loop_holds(pool, a)
    _loop_holds(pool, b)
    return pool, a, b


def test_pool_waits_for_a_batch_the_reaper_is_handing_back(monkeypatch):
    """Both buffers are lent and the loop waits in next(), but the reaper has work
    in hand (the batch the loop just dropped, on its way back: on a loaded
    machine the reaper may not run for tens of milliseconds). The pool waits for
    that release instead of allocating a third buffer."""
    pool, a, b = _both_lent_while_the_reaper_works(monkeypatch, reaping_s=60.0)
    t, got = _acquire_in_thread(pool)
    t.join(0.3)  # well past _BUSY_S, when the pool would grow without the reaper's work
    assert t.is_alive() and pool.allocated == 2
    pool.release(a)  # the reaper hands the dropped batch back
    t.join(5)
    assert got == [a] and pool.allocated == 2
    pool.release(b)


def test_starving_workers_do_not_grow_the_pool_while_the_loop_holds_every_buffer(monkeypatch):
    """The loop has taken both batches and is about to drop the older one (its
    release in the reaper's hand): idle workers are no reason for a third buffer
    then, only a batch held up while being filled is."""
    pool, a, b = _both_lent_while_the_reaper_works(monkeypatch, reaping_s=60.0)
    t, got = _acquire_in_thread(pool, starving=lambda: True)
    t.join(0.3)
    assert t.is_alive() and pool.allocated == 2
    pool.release(a)
    t.join(5)
    assert got == [a] and pool.allocated == 2
    pool.release(b)


def test_pool_grows_when_the_reaper_brings_nothing_back_in_time(monkeypatch):
    """Work in the reaper's hand delays growing only so long: a loop that really
    holds every buffer gets a new one, not a deadlock."""
    pool, a, b = _both_lent_while_the_reaper_works(monkeypatch, reaping_s=0.05)
    t, got = _acquire_in_thread(pool)
    t.join(5)
    assert not t.is_alive() and got[0] not in (a, b) and pool.allocated == 3


def test_reaper_pending_sees_queued_and_running_work():
    from feeder.engine import reaper

    reaper.ensure_running()
    running, release = threading.Event(), threading.Event()

    def slow() -> None:
        running.set()
        assert release.wait(10)

    with reaper.busy:  # the reaper cannot run anything yet: the call stays queued or in hand
        reaper.defer(slow)
        assert reaper.pending()
    assert running.wait(10)
    assert reaper.pending()  # running
    release.set()
    # Idle (nothing queued, nothing running): a fresh process, where no other
    # test's objects can be on their way to the reaper.
    code = ("import threading\nfrom feeder.engine import reaper\nassert not reaper.pending()\n"
            "reaper.ensure_running()\ndone = threading.Event()\nwith reaper.busy:\n"
            "    reaper.defer(done.set)\n    assert reaper.pending()\nassert done.wait(10)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_pool_grows_while_the_loop_is_busy():
    """The loop computes outside next(): finished batches may queue up ahead of it."""
    pool = BufferPool(8, 1, 1, 1, pin=False)
    pool.set_consumer_waiting(True)
    a, b = pool.acquire(lambda: False), pool.acquire(lambda: False)
    t, got = _acquire_in_thread(pool)
    t.join(0.3)
    assert t.is_alive()  # the loop waits: no third buffer
    pool.set_consumer_waiting(False)  # the loop got a batch and computes
    t.join(5)
    assert not t.is_alive() and len(got) == 1 and got[0] not in (a, b) and pool.allocated == 3


def test_batch_bound_late_takes_stashed_samples():
    pool = BufferPool(4, 3, 1, 1, pin=False)
    given = []
    b = Batch(0, None, 3)
    b.store(2, np.full((1, 1, 3), 7, np.uint8), 12, given.append)  # before the buffer exists
    assert not b.finish_slot()
    b.fail(1, ValueError("x"))
    assert not b.finish_slot()
    buf = pool.acquire(lambda: False)
    assert not b.bind(buf, given.append)  # slot 0 is still to come
    assert b.buffer is buf and buf.labels[2] == 12 and (buf.images[2] == 7).all() and len(given) == 1
    b.store(0, np.full((1, 1, 3), 5, np.uint8), 10, given.append)  # after: copied in at once
    assert buf.labels[0] == 10 and (buf.images[0] == 5).all() and len(given) == 2
    assert b.finish_slot()  # the last slot completes it


def test_batch_completes_on_binding_when_every_sample_is_done():
    pool = BufferPool(4, 2, 1, 1, pin=False)
    b = Batch(0, None, 2)
    b.holes += [0, 1]
    assert not b.finish_slot() and not b.finish_slot()
    assert b.bind(pool.acquire(lambda: False), lambda arr: None)


def test_exactly_one_concurrent_finish_completes_the_batch():
    # finish_slot takes no lock: with threads switching every few bytecodes, each of
    # 8 x 500 concurrent calls must still count once, and only the last one completes.
    n_threads, per_thread = 8, 500
    b = Batch(0, None, n_threads * per_thread - 1)  # the bind counts as the last step
    start = threading.Barrier(n_threads)
    wins: list[bool] = []

    def finish() -> None:
        start.wait(timeout=10)
        wins.extend(b.finish_slot() for _ in range(per_thread))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=finish) for _ in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads)
    assert len(wins) == n_threads * per_thread and sum(wins) == 1
    assert not b.finish_slot()  # a call past the end never completes it again


def test_double_release_is_ignored():
    pool = BufferPool(2, 1, 1, 1, pin=False)
    a = pool.acquire(lambda: False)
    pool.release(a)
    pool.release(a)
    x, y = pool.acquire(lambda: False), pool.acquire(lambda: False)
    assert x is not y


def test_pool_grows_when_the_rest_belongs_to_a_stopped_pass():
    """A stopped pass's buffers come back only when its threads exit, and one may be
    stuck in user code: a waiting loop must not depend on them."""
    pool = BufferPool(8, 1, 1, 1, pin=False)
    owner = object()  # the pass filling `stuck`
    held, stuck = pool.acquire(lambda: False), pool.acquire(lambda: False, owner=owner)
    _loop_holds(pool, held)
    t, got = _acquire_in_thread(pool)
    t.join(0.3)
    assert t.is_alive()  # `stuck` is being filled by a live pass: worth waiting for
    pool.retire(owner)  # its pass was stopped
    t.join(5)
    assert not t.is_alive() and got[0] not in (held, stuck) and pool.allocated == 3
    pool.release(stuck)  # once its thread exits, it is an ordinary free buffer again
    assert pool.try_acquire() is stuck


def test_pool_grows_when_the_workers_starve_behind_a_slow_sample():
    pool = BufferPool(8, 1, 1, 1, pin=False)
    pool.set_consumer_waiting(True)
    pool.acquire(lambda: False), pool.acquire(lambda: False)
    starving = threading.Event()
    t, got = _acquire_in_thread(pool, starving.is_set)
    t.join(0.3)
    assert t.is_alive()  # the workers still have samples: wait for the loop's batch
    starving.set()
    t.join(5)
    assert not t.is_alive() and pool.allocated == 3


def test_workers_idle_for_a_moment_do_not_grow_the_pool():
    # At the end of each batch the decode threads run out of work for a moment
    # while the last samples of the batch the loop waits for are finished; its
    # batch then comes back. That moment is no reason for a third buffer.
    pool = BufferPool(8, 1, 1, 1, pin=False)
    pool.set_consumer_waiting(True)
    held, filling = pool.acquire(lambda: False), pool.acquire(lambda: False)
    calls: list[int] = []
    asked_again = threading.Event()

    def starving():  # starving at the second look only (20 ms after the first)
        calls.append(1)
        if len(calls) >= 4:
            asked_again.set()
        return len(calls) == 2

    t, got = _acquire_in_thread(pool, starving)
    assert asked_again.wait(5)
    assert t.is_alive() and pool.allocated == 2
    pool.release(held)  # the loop's batch comes back
    t.join(5)
    assert not t.is_alive() and got == [held] and pool.allocated == 2
    del filling
