"""decode_threads="tune": the decision (driven with made-up figures), the gate that
parks and wakes threads, and the feeder running it in both engines."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.support import JOIN_TIMEOUT_S, MemorySource, drain
from feeder import Feeder, ops
from feeder.engine import tune as _tune
from feeder.engine.config import Config
from feeder.engine.tune import Gate, Tuner
from feeder.testing import current_pass_of, passes_of



def crops():
    """Random per-sample work: identical batches show the randomness did not follow the threads."""
    return [ops.RandomResizedCrop(24), ops.RandomHorizontalFlip()]


@pytest.fixture
def long_source(jpeg_blobs) -> MemorySource:
    """600 samples: long enough a pass for the tuner to shrink and grow within it."""
    return MemorySource(jpeg_blobs * 10)


def feed(tuner: Tuner, batches: int, wait_s: float, cycle_s: float, busy_s: float) -> list[int]:
    return [tuner.batch(wait_s, cycle_s, busy_s) for _ in range(batches)]


# -- the decision ---------------------------------------------------------------------

def test_config_tune_resolves_to_the_auto_count():
    auto = Config.build(batch_size=4).resolved()
    tuned = Config.build(batch_size=4, decode_threads="tune").resolved()
    assert tuned.tune and not auto.tune
    assert tuned.decode_threads == auto.decode_threads
    with pytest.raises(ValueError, match="decode_threads must be a positive int, 'auto' or 'tune'"):
        Config.build(batch_size=4, decode_threads="tuned")
    with pytest.raises(ValueError, match="read_threads must be an int >= 0, 'auto' or 'tune'"):
        Config.build(batch_size=4, read_threads="tuned")
    with pytest.raises(ValueError, match="augment_threads must be an int >= 0, 'auto' or 'tune'"):
        Config.build(batch_size=4, augment_threads=-1)
    assert repr(tuned.decode_threads) == f"'tune' ({auto.decode_threads})"
    assert tuned.tuned() == ("decode",) and auto.tuned() == ()


def test_config_tune_for_the_read_and_augment_pools():
    auto = Config.build(batch_size=4).resolved()
    # Reads that may block: a read stage of the "auto" count, tuned.
    read = Config.build(batch_size=4, read_threads="tune").resolved()
    assert read.tune and read.tuned() == ("read",)
    assert read.read_threads == auto.read_threads > 0
    assert repr(read.read_threads) == f"'tune' ({auto.read_threads})"
    # Local reads: "auto" has no read stage, so neither has "tune" (nothing to tune).
    local = Config.build(batch_size=4, read_threads="tune").resolved(reads_block=False)
    assert local.read_threads == 0 and not local.tune
    # "auto" runs the transforms in the decode threads; "tune" gives them a pool of
    # their own, of the decode pool's "auto" size.
    augment = Config.build(batch_size=4, augment_threads="tune").resolved()
    assert auto.augment_threads == 0
    assert augment.augment_threads == auto.decode_threads and augment.tuned() == ("augment",)
    every = Config.build(batch_size=4, decode_threads="tune", augment_threads="tune",
                         read_threads="tune").resolved()
    assert every.tuned() == ("read", "decode", "augment")


def test_a_loop_that_never_waits_sheds_threads_one_window_at_a_time():
    t = Tuner(4)
    # Never waiting; the threads work 0.2 thread-seconds per 1 s batch: one thread suffices.
    counts = feed(t, _tune.WARMUP + _tune.SHRINK_WINDOW - 1, 0.0, 1.0, 0.2)
    assert set(counts) == {4}, "no change before a whole quiet window"
    assert t.batch(0.0, 1.0, 0.2) == 3
    counts = feed(t, 3 * _tune.SHRINK_WINDOW, 0.0, 1.0, 0.2)
    assert counts[-1] == 1 and t.active == 1
    # Each step down needed a full window of its own.
    assert counts.index(2) == _tune.SHRINK_WINDOW - 1
    assert feed(t, 100, 0.0, 1.0, 0.2)[-1] == 1, "never below the minimum"


def test_no_shrink_when_one_thread_fewer_would_be_too_busy():
    t = Tuner(4)
    # 2.5 threads' worth of work: 3 threads would be 83% busy, above the headroom.
    assert set(feed(t, 200, 0.0, 1.0, 2.5)) == {4}

    t = Tuner(4)
    # 1.7 threads' worth: 3 threads at 57% is fine, 2 (85%) would not be.
    assert feed(t, 200, 0.0, 1.0, 1.7)[-1] == 3


def test_a_waiting_loop_grows_back_within_a_few_batches():
    t = Tuner(8)
    feed(t, 500, 0.0, 1.0, 0.1)
    assert t.active == 1
    # The loop now waits 60% of every batch. The first such batch already lifts
    # the last three batches' share to 20%: 1 / (1 - 0.2) rounds up to 2 threads.
    counts = feed(t, 1 + _tune.GROW_WINDOW, 0.6, 1.0, 0.4)
    assert counts[0] == 2
    # After a window at 60% with 2 threads: 2 / (1 - 0.6) = 5.
    assert counts[1:] == [2] * (_tune.GROW_WINDOW - 1) + [5]
    # Still waiting: grows again after another window, up to the maximum only.
    counts = feed(t, 10 * _tune.GROW_WINDOW, 0.9, 1.0, 0.1)
    assert counts[-1] == 8 and max(counts) == 8


def test_saturated_threads_grow_before_the_loop_waits():
    """A loop that sped up first eats the batches queued ahead of it (no wait yet):
    the threads' work over their time says it will wait soon."""
    t = Tuner(4)
    feed(t, 500, 0.0, 1.0, 0.1)
    assert t.active == 1
    counts = feed(t, _tune.GROW_WINDOW, 0.0, 0.25, 0.24)  # 96% busy, no wait
    assert counts[-1] == 2 and counts[:-1] == [1] * (_tune.GROW_WINDOW - 1)


def test_between_the_thresholds_nothing_changes():
    # A wait share of 0.8%: not enough to grow (above 1%), too much to shrink (0.5%).
    t = Tuner(4)
    feed(t, 500, 0.0, 1.0, 0.1)
    assert t.active == 1
    t2 = Tuner(4)
    t2.active = 2
    assert set(feed(t2, 300, 0.008, 1.0, 0.1)) == {2}


def test_a_shrink_that_starved_the_loop_makes_the_next_one_wait_longer():
    t = Tuner(2)
    feed(t, _tune.WARMUP + _tune.SHRINK_WINDOW, 0.0, 1.0, 0.5)
    assert t.active == 1
    feed(t, _tune.GROW_WINDOW, 0.3, 1.0, 0.9)  # one thread was too few
    assert t.active == 2
    # The same quiet figures again: the next shrink needs twice the window.
    counts = feed(t, 2 * _tune.SHRINK_WINDOW, 0.0, 1.0, 0.5)
    assert counts.index(1) == 2 * _tune.SHRINK_WINDOW - 1


def test_a_large_pool_sheds_an_eighth_at_a_time():
    t = Tuner(128)
    # Next to no work (a read pool whose storage answers at once): 112, 98, 86...
    counts = feed(t, _tune.WARMUP + _tune.SHRINK_WINDOW, 0.0, 1.0, 0.5)
    assert counts[-1] == 112
    assert feed(t, _tune.SHRINK_WINDOW, 0.0, 1.0, 0.5)[-1] == 98
    # 8.7 threads' worth of work: an eighth fewer (14) would be 62% busy, one
    # fewer (15) 58%: one at a time near the headroom.
    t = Tuner(16)
    assert feed(t, _tune.WARMUP + _tune.SHRINK_WINDOW, 0.0, 1.0, 8.7)[-1] == 15
    # And a pool under 16 threads sheds one at a time, as before.
    t = Tuner(15)
    assert feed(t, _tune.WARMUP + _tune.SHRINK_WINDOW, 0.0, 1.0, 0.1)[-1] == 14


def test_propose_changes_nothing_and_commit_does_what_batch_would():
    a, b = Tuner(4), Tuner(4)
    for _ in range(_tune.WARMUP + _tune.SHRINK_WINDOW):
        want = a.propose(0.0, 1.0, 0.2)
        assert a.active == 4
        assert b.batch(0.0, 1.0, 0.2) == (want if want != 4 else 4)
    assert want == 3 and b.active == 3
    a.commit(want)
    assert a.active == 3 and a._since_change == 0


def test_warmup_batches_are_not_judged():
    t = Tuner(2)
    assert feed(t, _tune.WARMUP, 1.0, 1.0, 0.0) == [2] * _tune.WARMUP
    assert t._since_change == 0


# -- the gate -----------------------------------------------------------------------

def test_gate_parks_the_threads_above_the_count_and_wakes_them():
    record: list[tuple[str, int]] = []
    gate = Gate("decode", 3, lambda: 0.0, lambda s, n: record.append((s, n)))
    gate.set_active(1)
    passed = [threading.Event() for _ in range(3)]
    parked = threading.Barrier(3)  # threads 1 and 2 and the test

    def thread(i: int) -> None:
        gate.admit(i, lambda: False, on_park=lambda: parked.wait(JOIN_TIMEOUT_S))
        passed[i].set()

    workers = [threading.Thread(target=thread, args=(i,), daemon=True) for i in range(3)]
    for w in workers:
        w.start()
    assert passed[0].wait(JOIN_TIMEOUT_S)
    parked.wait(JOIN_TIMEOUT_S)  # both others have parked
    assert not passed[1].is_set() and not passed[2].is_set()
    gate.set_active(2)
    assert passed[1].wait(JOIN_TIMEOUT_S)
    assert not passed[2].is_set()
    gate.open()  # the end of the input: everyone runs
    assert passed[2].wait(JOIN_TIMEOUT_S)
    for w in workers:
        w.join(JOIN_TIMEOUT_S)
    assert record == [("decode", 3), ("decode", 1), ("decode", 2)]
    assert gate.parks == 2


def test_gate_measures_batches_from_the_loops_entries_and_exits():
    now = [0.0]
    busy = [0.0]
    seen: list[tuple[float, float, float]] = []

    class Spy(Tuner):
        def batch(self, wait_s, cycle_s, busy_s):
            seen.append((wait_s, cycle_s, busy_s))
            return self.active

    gate = Gate("decode", 2, lambda: busy[0], clock=lambda: now[0])
    gate.tuner = Spy(2)
    gate.consumer(False)  # the pass starts: the loop is about to call next()
    for wait, step, work in [(0.5, 2.0, 1.0), (0.0, 1.0, 0.25)]:
        gate.consumer(True)
        now[0] += wait
        busy[0] += work
        gate.consumer(False)
        now[0] += step
    assert seen == [(0.5, 0.5, 1.0), (0.0, 2.0, 0.25)]


class Pools:
    """Two tuned pools driven by :class:`Tuning` on a fake clock, with made-up work:
    ``step(wait, cycle, read=..., decode=...)`` is one batch, each pool's figure its
    busy thread-seconds in it."""

    def __init__(self, read: int, decode: int, start: dict[str, int]) -> None:
        self.now = 0.0
        self.busy = {"read": 0.0, "decode": 0.0}
        self.record: list[tuple[int, str, int]] = []
        self.batches = 0
        self.gates = {name: Gate(name, n, lambda name=name: self.busy[name],
                                 lambda s, n: self.record.append((self.batches, s, n)),
                                 start=start.get(name))
                      for name, n in (("read", read), ("decode", decode))}
        self.tuning = _tune.Tuning(list(self.gates.values()), clock=lambda: self.now)
        self.tuning.consumer(False)  # the pass starts

    def step(self, wait: float, cycle: float, **work: float) -> None:
        self.batches += 1
        self.tuning.consumer(True)
        self.now += wait
        for name, w in work.items():
            self.busy[name] += w
        self.tuning.consumer(False)
        self.now += cycle - wait

    def active(self) -> dict[str, int]:
        return {name: g.active for name, g in self.gates.items()}

    def changes(self) -> list[tuple[int, str, int]]:
        return [r for r in self.record if r[0] > 0]


def test_only_the_busiest_pool_grows_on_the_loops_wait():
    # The loop waits 40% of each batch. Decode's 2 threads work all the time; the 4
    # read threads a quarter of theirs: decode is what the loop waits for.
    p = Pools(read=16, decode=4, start={"read": 4, "decode": 2})
    for _ in range(_tune.WARMUP + _tune.GROW_WINDOW):
        p.step(0.4, 1.0, read=1.0, decode=2.0)
    assert p.active() == {"read": 4, "decode": 4}
    assert [stage for _, stage, _ in p.changes()] == ["decode"]
    # Decode at its maximum, still busiest: the loop still waits, and the read
    # pool (whose tuner alone would grow on this wait) is left alone.
    for _ in range(10 * _tune.GROW_WINDOW):
        p.step(0.4, 1.0, read=1.0, decode=4.0)
    assert p.active() == {"read": 4, "decode": 4}


def test_when_reads_are_the_busiest_stage_the_read_pool_grows():
    p = Pools(read=16, decode=4, start={"read": 4, "decode": 2})
    for _ in range(_tune.WARMUP + _tune.GROW_WINDOW):
        p.step(0.5, 1.0, read=4.0, decode=0.5)  # every read thread waits on storage
    assert p.active() == {"read": 8, "decode": 2}  # ceil(4 / (1 - 0.5))


def test_two_quiet_pools_shrink_one_at_a_time_the_least_busy_first():
    p = Pools(read=16, decode=4, start={})
    # The loop never waits; the reads need 1 thread's worth, decode 0.5.
    for _ in range(_tune.WARMUP + _tune.SHRINK_WINDOW):
        p.step(0.0, 1.0, read=1.0, decode=0.5)
    # Both could shrink at this boundary; the read pool's threads are the less busy
    # (1/16 against 0.5/4), so it goes first and decode's window restarts.
    assert p.active() == {"read": 14, "decode": 4}
    for _ in range(_tune.SHRINK_WINDOW):
        p.step(0.0, 1.0, read=1.0, decode=0.5)
    # A window later: both again, and again the less busy (1/14 against 0.5/4).
    assert p.active() == {"read": 13, "decode": 4}
    for _ in range(30 * _tune.SHRINK_WINDOW):
        p.step(0.0, 1.0, read=1.0, decode=0.5)
    assert p.active() == {"read": 2, "decode": 1}
    # Never two changes at one boundary.
    boundaries = [b for b, _, _ in p.changes()]
    assert len(boundaries) == len(set(boundaries))


# -- the feeder ---------------------------------------------------------------------

class _Scripted(Tuner):
    """A decision that follows a script: batch number -> active count."""

    script = {3: 1, 12: 2, 20: 1, 40: 2}

    def batch(self, wait_s, cycle_s, busy_s):
        self.batches += 1
        self.active = self.script.get(self.batches, self.active)
        return self.active


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_tuned_batches_are_those_of_a_fixed_thread_run(long_source, isolation, monkeypatch):
    monkeypatch.setattr(_tune, "Tuner", _Scripted)  # forked into the worker too
    extra = {"start_method": "fork"} if isolation == "process" else {}
    runs = {}
    for threads in (2, "tune"):
        with Feeder(long_source, 4, crops(), decode_threads=threads, shuffle=True, seed=3,
                    isolation=isolation, **extra) as f:
            batches, err = drain(f)
            assert err is None
            runs[threads] = (batches, f.stats())
    fixed, tuned = runs[2][0], runs["tune"][0]
    assert len(tuned) == len(fixed) == 150
    for (xa, ya), (xb, yb) in zip(fixed, tuned):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    history = [n for _, stage, n in runs["tune"][1].active_threads if stage == "decode"]
    assert history == [2, 1, 2, 1, 2]
    assert runs["tune"][1].active() == 2 and runs[2][1].active() is None
    assert "decode threads tuned" in str(runs["tune"][1])


def test_parked_threads_exit_at_the_end_and_on_close(long_source, monkeypatch):
    class Shrink(Tuner):
        def batch(self, wait_s, cycle_s, busy_s):
            self.active = 1
            return 1

    monkeypatch.setattr(_tune, "Tuner", Shrink)
    with Feeder(long_source, 4, crops(), decode_threads="tune", shuffle=False) as f:
        it = iter(f)
        for _ in range(30):
            next(it)
        gate = current_pass_of(f).gate
        assert gate.active == 1
        # A pass abandoned with a thread parked: close() must still stop it (the
        # autouse fixture fails the test on a thread left behind).
    with Feeder(long_source, 4, crops(), decode_threads="tune", shuffle=False) as f:
        batches, err = drain(f)  # and the end marker reaches every parked thread
        assert err is None and len(batches) == 150
        assert passes_of(f)[-1].gate.parks >= 1


def test_a_new_pass_starts_where_the_last_one_ended(long_source, monkeypatch):
    class Shrink(Tuner):
        def batch(self, wait_s, cycle_s, busy_s):
            self.batches += 1
            if self.batches == 5:
                self.active = 1
            return self.active

    monkeypatch.setattr(_tune, "Tuner", Shrink)
    with Feeder(long_source, 4, crops(), decode_threads="tune", shuffle=False) as f:
        for epoch in range(2):
            f.set_epoch(epoch)
            batches, err = drain(f, limit=10)
            assert err is None and len(batches) == 10
        history = [n for _, stage, n in f.stats().active_threads if stage == "decode"]
    assert history == [2, 1, 1]  # the second pass started at 1


def test_slow_loop_sheds_threads_and_a_fast_one_gets_them_back(long_source, monkeypatch):
    """The real decision on a real feeder, with a fake clock: each step of the slow
    loop 'takes' one second on it (instantly), so the loop never waits in relative
    terms and the threads' work is tiny against it; the fast loop takes none."""
    offset = [0.0]
    real = _tune._now
    monkeypatch.setattr(_tune, "_now", lambda: real() + offset[0])
    changed = threading.Event()
    with Feeder(long_source, 4, crops(), decode_threads="tune", shuffle=False) as f:
        start = f.config.decode_threads
        it = iter(f)
        taken = 0
        while taken < 120:  # bounded: a shrink is due after WARMUP + SHRINK_WINDOW batches
            next(it)
            taken += 1
            offset[0] += 1.0  # a one-second step
            if f.stats().active() < start:
                changed.set()
                break
        assert changed.is_set(), f"no thread parked in {taken} batches of a slow loop"
        low = f.stats().active()
        slow_until = taken
        grew = None
        while taken < 150:
            next(it)  # no step at all: the loop only waits on the loader now
            taken += 1
            if f.stats().active() > low:
                grew = taken - slow_until
                break
        assert grew is not None and grew <= 20, f"not grown back within 20 batches ({grew})"


# -- the augment and read pools ---------------------------------------------------------

# Each pool's "tune" option against a fixed count, and the stage it tunes.
POOLS = {"augment": ("augment_threads", 2), "read": ("read_threads", 2)}


@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize("pool", sorted(POOLS))
def test_tuned_pool_batches_are_those_of_a_fixed_thread_run(long_source, pool, isolation,
                                                            monkeypatch):
    monkeypatch.setattr(_tune, "Tuner", _Scripted)  # forked into the worker too
    option, fixed_count = POOLS[pool]
    extra = {"start_method": "fork"} if isolation == "process" else {}
    runs = {}
    for threads in (fixed_count, "tune"):
        with Feeder(long_source, 4, crops(), shuffle=True, seed=3, isolation=isolation,
                    **{option: threads}, **extra) as f:
            batches, err = drain(f)
            assert err is None
            runs[threads] = (batches, f.stats(), f.config)
    fixed, tuned = runs[fixed_count][0], runs["tune"][0]
    assert len(tuned) == len(fixed) == 150
    for (xa, ya), (xb, yb) in zip(fixed, tuned):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    stats, config = runs["tune"][1], runs["tune"][2]
    assert config.tuned() == (pool,)
    most = int(getattr(config, option))
    history = [n for _, stage, n in stats.active_threads if stage == pool]
    assert history == [most, 1, 2, 1, 2]
    assert {stage for _, stage, _ in stats.active_threads} == {pool}
    assert stats.active(pool) == 2 and stats.active("decode") is None
    assert f"{pool} threads tuned: 2 active now (of {most})" in str(stats)


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_slow_loop_sheds_pool_threads_and_a_fast_one_gets_them_back(long_source, pool,
                                                                    monkeypatch):
    """As test_slow_loop_sheds_threads_and_a_fast_one_gets_them_back, for the augment
    pool and the read pool (MemorySource's reads may block: a read stage)."""
    option = POOLS[pool][0]
    offset = [0.0]
    real = _tune._now
    monkeypatch.setattr(_tune, "_now", lambda: real() + offset[0])
    with Feeder(long_source, 4, crops(), shuffle=False, **{option: "tune"}) as f:
        start = int(getattr(f.config, option))
        assert f.config.tuned() == (pool,)
        it = iter(f)
        taken = 0
        low = None
        while taken < 120:  # bounded: a shrink is due after WARMUP + SHRINK_WINDOW batches
            next(it)
            taken += 1
            offset[0] += 1.0  # a one-second step
            if f.stats().active(pool) < start:
                low = f.stats().active(pool)
                break
        assert low is not None, f"no {pool} thread parked in {taken} batches of a slow loop"
        assert current_pass_of(f).gate.stage == pool
        slow_until = taken
        grew = None
        while taken < 150:
            next(it)  # no step at all: the loop only waits on the loader now
            taken += 1
            if f.stats().active(pool) > low:
                grew = taken - slow_until
                break
        assert grew is not None and grew <= 20, f"not grown back within 20 batches ({grew})"


def test_every_pool_tuned_gives_the_fixed_runs_batches(long_source):
    """decode, augment and read tuned together, the real decision (Tuning choosing
    among three pools): the same batches as a fixed run, every pool recorded."""
    runs = {}
    for threads in (2, "tune"):
        with Feeder(long_source, 4, crops(), shuffle=True, seed=5, decode_threads=threads,
                    augment_threads=threads, read_threads=threads) as f:
            batches, err = drain(f)
            assert err is None
            runs[threads] = (batches, f.stats())
    assert len(runs["tune"][0]) == len(runs[2][0]) == 150
    for (xa, ya), (xb, yb) in zip(runs[2][0], runs["tune"][0]):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    stages = {stage for _, stage, _ in runs["tune"][1].active_threads}
    assert stages == {"read", "decode", "augment"}
