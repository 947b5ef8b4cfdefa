"""Faults in use: user transforms that raise, return the wrong shape
or dtype, or hang; sources that break; consumers that break out, raise or
never close.

Faults are triggered by a sample's *content* (a hash of its decoded pixels),
so the failing sample is known exactly whatever the thread timing, and the
survivors are checked by content hash too.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest

from tests.support import MemorySource, drain, feeder_threads
from tests.support.faults import (SIDE, Gate, consume_in_thread, assert_exactly_once, batch_sizes, delivered_hashes, distinct_jpegs,
                            expected_sizes, feeder_factory, pixel_hash, reference_hash, wait_feeder_threads_within, wait_until,
                            wait_no_feeder_threads)
from feeder import FeederError, FieldError, SampleError, SourceError, TransformError, ops
from feeder.engine.sampler import epoch_indices
from feeder.testing import start_pass

N = 24
BAD = 6
B = 4


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return distinct_jpegs(N, seed=700)


@pytest.fixture(scope="module")
def hashes(blobs) -> list[str]:
    return [reference_hash(b) for b in blobs]


@pytest.fixture
def src(blobs) -> MemorySource:
    return MemorySource(blobs, names=[f"/data/train/{i:03d}.jpg" for i in range(N)])


make = feeder_factory(batch_size=B, shuffle=False, seed=11)


class OnSample:
    """A transform that does ``action(img)`` for the samples whose pixels hash to one of
    ``targets`` and passes every other sample through unchanged."""

    def __init__(self, targets, action):
        self.targets = set(targets)
        self.action = action
        self.hits = 0
        self.__qualname__ = f"OnSample_{action.__name__}"

    def __call__(self, img, rng):
        if pixel_hash(img) in self.targets:
            self.hits += 1
            return self.action(img)
        return img


def survivors(hashes, *bad):
    return [h for i, h in enumerate(hashes) if i not in bad]


# -- a user transform that raises -------------------------------------------------------------------

def divide_by_zero(img):
    return img // 0 if False else 1 // 0


@pytest.mark.parametrize("augment_threads", [2, 0])
@pytest.mark.parametrize("ordered", [True, False])
def test_raising_transform_raise(src, hashes, ordered, augment_threads):
    t = OnSample([hashes[BAD]], divide_by_zero)
    with make(src, [t, ops.CenterCrop(SIDE)], ordered=ordered, decode_threads=3,
              augment_threads=augment_threads) as f:
        batches, err = drain(f, timeout=20)
    assert isinstance(err, SampleError) and err.stage == "augment" and err.index == BAD
    assert err.path == f"/data/train/{BAD:03d}.jpg" and err.path in str(err)
    assert "'augment'" in str(err) and f"sample {BAD}" in str(err) and "ZeroDivisionError" in str(err)
    assert isinstance(err.__cause__, ZeroDivisionError)
    assert err.__cause__.__traceback__ is not None  # the user's frame is still in the traceback
    if ordered:
        assert delivered_hashes(batches) == hashes[:B]  # the batch before the bad one
    assert BAD not in {int(v) for _, y in batches for v in y}


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("threads", [(1, 1), (3, 2), (3, 0)])
def test_raising_transform_skip(src, hashes, ordered, threads):
    t = OnSample([hashes[BAD], hashes[BAD + 1], hashes[20]], divide_by_zero)
    with make(src, [t, ops.CenterCrop(SIDE)], ordered=ordered, shuffle=True, on_error="skip",
              decode_threads=threads[0], augment_threads=threads[1]) as f:
        for epoch in range(2):
            batches, err = drain(f, timeout=20)
            assert err is None
            assert batch_sizes(batches) == expected_sizes(N - 3, B, False)
            assert_exactly_once(delivered_hashes(batches), survivors(hashes, BAD, BAD + 1, 20))
        s = f.stats()
    assert s.skipped == 6
    assert set(s.skipped_paths) == {f"/data/train/{i:03d}.jpg" for i in (BAD, BAD + 1, 20)}


def test_first_error_in_epoch_order_whatever_the_timing(src, hashes):
    """ordered=True: the error raised is the first bad sample in epoch order, for any thread counts."""
    bad = [5, 17]
    for shuffle in (False, True):
        order = epoch_indices(N, shuffle, 11, 0)
        first = next(int(i) for i in order if int(i) in bad)
        for dt, at in [(1, 1), (4, 1), (2, 4), (3, 0)]:
            t = OnSample([hashes[i] for i in bad], divide_by_zero)
            with make(src, [t, ops.CenterCrop(SIDE)], shuffle=shuffle, decode_threads=dt,
                      augment_threads=at) as f:
                _, err = drain(f, timeout=20)
            assert isinstance(err, SampleError) and err.index == first, (shuffle, dt, at, err)


def test_after_an_error_the_pass_is_over_and_the_next_pass_repeats_it(src, hashes):
    t = OnSample([hashes[BAD]], divide_by_zero)
    with make(src, [t, ops.CenterCrop(SIDE)]) as f:
        it = iter(f)
        got = []
        with pytest.raises(SampleError) as info:
            for _ in range(N):
                got.append(next(it))
        assert len(got) == BAD // B
        with pytest.raises(StopIteration):  # not a hang, not a stale batch
            next(it)
        assert wait_no_feeder_threads(2.0) == []  # a failed pass stops all of its threads
        f.set_epoch(0)
        _, err = drain(f, timeout=20)
        assert isinstance(err, SampleError) and err.index == info.value.index


def test_max_skipped_budget_is_exact(src, hashes):
    bad = [2, 9, 15]
    for ordered in (True, False):
        t = OnSample([hashes[i] for i in bad], divide_by_zero)
        with make(src, [t, ops.CenterCrop(SIDE)], on_error="skip", max_skipped=3, ordered=ordered) as f:
            batches, err = drain(f, timeout=20)
        assert err is None and f.stats().skipped == 3
        assert_exactly_once(delivered_hashes(batches), survivors(hashes, *bad))
        t = OnSample([hashes[i] for i in bad], divide_by_zero)
        with make(src, [t, ops.CenterCrop(SIDE)], on_error="skip", max_skipped=2, ordered=ordered) as f:
            _, err = drain(f, timeout=20)
        assert isinstance(err, FeederError) and "max_skipped=2" in str(err)
        assert isinstance(err.__cause__, SampleError) and err.__cause__.index in bad


# -- a user transform that returns the wrong shape or dtype ----------------------------------------

def as_float32(img):
    return img.astype(np.float32)


def as_unit_float(img):
    return img.astype(np.float64) / 255.0


def as_int16(img):
    return img.astype(np.int16)


def too_small(img):
    return img[:10, :10]


def gray_2d(img):
    return img[..., 0].copy()


def four_channels(img):
    return np.concatenate([img, img[..., :1]], axis=2)


def as_list(img):
    return img.tolist()


def as_none(img):
    return None


BAD_OUTPUTS = [as_float32, as_unit_float, as_int16, too_small, gray_2d, four_channels, as_list, as_none]
# Followers chosen to leave a good 32x32 sample's pixels unchanged, so survivors keep their hash.
FOLLOWERS = {
    "last": [],
    "flip": [ops.RandomHorizontalFlip(p=0.0)],  # an in-place tail: the user's result is the writer's
    "centercrop": [ops.CenterCrop(SIDE)],
    "resize": [ops.Resize((SIDE, SIDE))],
    "randomresizedcrop": [ops.RandomResizedCrop(SIDE, scale=(1.0, 1.0), ratio=(1.0, 1.0))],
}
_WRONG_KIND = (as_float32, as_unit_float, as_int16, gray_2d, four_channels)

def _bad_output_cases(mode):
    cases = []
    for fn in BAD_OUTPUTS:
        for follower in FOLLOWERS:
            if fn is too_small and follower not in ("last", "flip"):
                continue  # a smaller image before a crop or resize is legitimate
            if fn is too_small and mode == "skip":
                continue  # a size that is not image_size is a configuration error, never skipped
            cases.append(pytest.param(fn, follower, id=f"{fn.__name__}-then-{follower}"))
    return cases


def _bad_output_outcome(src, hashes, fn, follower, on_error):
    t = OnSample([hashes[BAD]], fn)
    with make(src, [t] + FOLLOWERS[follower], image_size=(SIDE, SIDE), on_error=on_error,
              decode_threads=2) as f:
        batches, err = drain(f, timeout=20)
        skipped = f.stats().skipped
    assert t.hits >= 1
    return batches, err, skipped


@pytest.mark.parametrize("fn, follower", _bad_output_cases("raise"))
def test_wrong_output_raises_transform_error_naming_the_transform(src, hashes, fn, follower):
    batches, err, _ = _bad_output_outcome(src, hashes, fn, follower, "raise")
    assert isinstance(err, SampleError), f"no error: the bad sample was delivered ({err!r})"
    assert err.stage == "augment" and err.index == BAD and err.path in str(err)
    assert isinstance(err.__cause__, TransformError), f"cause {type(err.__cause__).__name__}: {err}"
    assert f"OnSample_{fn.__name__}" in str(err)


@pytest.mark.parametrize("fn, follower", _bad_output_cases("skip"))
def test_wrong_output_skipped(src, hashes, fn, follower):
    batches, err, skipped = _bad_output_outcome(src, hashes, fn, follower, "skip")
    assert err is None and skipped == 1
    assert_exactly_once(delivered_hashes(batches), survivors(hashes, BAD))


def test_wrong_size_message_gives_both_shapes(src, hashes):
    batches, err, _ = _bad_output_outcome(src, hashes, too_small, "last", "raise")
    assert "(10, 10, 3)" in str(err) and f"({SIDE}, {SIDE}, 3)" in str(err)


def test_float_output_message_names_the_dtype(src, hashes):
    batches, err, _ = _bad_output_outcome(src, hashes, as_float32, "last", "raise")
    assert "float32" in str(err) and "uint8" in str(err)


# -- a source that breaks ---------------------------------------------------------------------------

class OddSource(MemorySource):
    """Returns ``reply`` instead of (bytes, label) for sample BAD."""

    def __init__(self, blobs, reply):
        super().__init__(blobs, names=[f"odd/{i}.jpg" for i in range(len(blobs))])
        self.reply = reply

    def read(self, index):
        if index == BAD:
            if isinstance(self.reply, BaseException):
                raise self.reply
            return self.reply
        return super().read(index)


# (reply, cause, skippable): what read() returns for sample BAD. Anything that is
# not a sample is the source's mistake (SourceError: never skipped); a label
# that does not fit the others is that sample's fault (FieldError). Both are
# found in the read step.
ODD_READS = {
    "raises-oserror": (OSError(5, "Input/output error"), OSError, True),
    "not-a-tuple": (b"\xff\xd8\xff", SourceError, False),
    "none-bytes": ((None, 3), SourceError, False),
    "str-bytes": (("a string", 3), SourceError, False),
    "label-not-int": (("__GOOD__", "cat"), FieldError, True),
}


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("case", sorted(ODD_READS))
def test_source_returning_garbage(blobs, hashes, case, on_error):
    reply, cause, skippable = ODD_READS[case]
    if isinstance(reply, tuple) and reply[0] == "__GOOD__":
        reply = (blobs[BAD], reply[1])
    with make(OddSource(blobs, reply), [ops.CenterCrop(SIDE)], on_error=on_error) as f:
        batches, err = drain(f, timeout=20)
        skipped = f.stats().skipped
    if on_error == "raise" or not skippable:
        assert isinstance(err, SampleError) and err.stage == "read" and err.index == BAD, repr(err)
        assert f"odd/{BAD}.jpg" in str(err) and isinstance(err.__cause__, cause)
        if cause is SourceError:
            assert f"OddSource.read({BAD})" in str(err) and "must return" in str(err)
    else:
        assert err is None and skipped == 1
        assert_exactly_once(delivered_hashes(batches), survivors(hashes, BAD))


@pytest.mark.parametrize("augment_threads", [1, 0])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()],
                         ids=["SystemExit", "KeyboardInterrupt", "GeneratorExit"])
def test_base_exception_in_worker_fails_the_pass(src, hashes, exc, on_error, augment_threads):
    """Not an Exception: not skippable, but it must still reach the consumer (no hang),
    naming the sample like any other failure."""
    def boom(img):
        raise exc
    t = OnSample([hashes[BAD]], boom)
    with make(src, [t, ops.CenterCrop(SIDE)], on_error=on_error, decode_threads=2,
              augment_threads=augment_threads) as f:
        _, err = drain(f, timeout=20)
        skipped = f.stats().skipped
    assert isinstance(err, SampleError), repr(err)
    assert err.stage == "augment" and err.path in str(err) and skipped == 0
    assert err.__cause__ is exc
    assert wait_no_feeder_threads(2.0) == []


# -- a very slow transform / source: the feeder stays responsive ------------------------------------

class SlowSource(MemorySource):
    def __init__(self, blobs):
        super().__init__(blobs)
        self.gate = Gate()

    def read(self, index):
        self.gate.block()
        return super().read(index)


@pytest.mark.parametrize("where", ["transform", "source"])
def test_close_prompt_while_threads_are_stuck_in_user_code(blobs, where):
    if where == "transform":
        gate = Gate()
        f = make(MemorySource(blobs), [gate, ops.CenterCrop(SIDE)], augment_threads=2, decode_threads=2)
    else:
        source = SlowSource(blobs)
        gate = source.gate
        f = make(source, [ops.CenterCrop(SIDE)], augment_threads=2, decode_threads=2)
    try:
        consumer, result = consume_in_thread(f)
        assert gate.entered.wait(10)
        assert wait_until(lambda: f.stats().waiting_in_next == 1, 10)
        t0 = time.monotonic()
        f.close()
        took = time.monotonic() - t0
        assert took < 1.5, f"close() took {took:.2f} s with threads stuck in user code"
        consumer.join(2.0)
        assert not consumer.is_alive() and result == ["stop"]  # the consumer woke although work hangs
        # Only the threads inside the user's call are left; every other thread has exited.
        stuck = wait_feeder_threads_within(gate.callers, 1.0)
        assert stuck and stuck <= set(gate.callers), (stuck, gate.callers)
    finally:
        gate.release.set()
        f.close()
    assert wait_no_feeder_threads(5.0) == []


def test_slow_transform_does_not_stall_close_of_a_consumer_waiting(blobs):
    """A training loop blocked in next() behind a slow transform can be closed from another thread."""
    gate = Gate()
    f = make(MemorySource(blobs), [gate, ops.CenterCrop(SIDE)], augment_threads=1)
    consumer, result = consume_in_thread(f)
    try:
        assert gate.entered.wait(10)
        closer = threading.Thread(target=f.close, name="test-closer", daemon=True)
        closer.start()
        closer.join(2.0)
        consumer.join(2.0)
        assert not closer.is_alive() and not consumer.is_alive() and result == ["stop"]
    finally:
        gate.release.set()
        f.close()


# -- the consumer breaks out, raises, or never closes -------------------------------------------------

@pytest.mark.parametrize("ordered", [True, False])
def test_consumer_breaks_mid_epoch_then_next_epoch_is_complete(src, hashes, ordered):
    with make(src, [ops.CenterCrop(SIDE)], ordered=ordered, shuffle=True, queue_size=1,
              decode_threads=3) as f:
        for i, _ in enumerate(f):
            if i == 1:
                break
        # The loop dropped its iterator: the abandoned pass stops by itself.
        assert wait_no_feeder_threads(2.0) == []
        batches, err = drain(f, timeout=20)
        assert err is None
        assert_exactly_once(delivered_hashes(batches), hashes)
        assert wait_no_feeder_threads(2.0) == []


def test_consumer_breaks_mid_epoch_then_closes(src):
    f = make(src, [ops.CenterCrop(SIDE)], queue_size=1)
    for i, _ in enumerate(f):
        if i == 2:
            break
    f.close()
    assert wait_no_feeder_threads(2.0) == []


class TrainingLoopError(Exception):
    pass


def test_consumer_raises_inside_with(src):
    with pytest.raises(TrainingLoopError):
        with make(src, [ops.CenterCrop(SIDE)], queue_size=1) as f:
            for i, _ in enumerate(f):
                if i == 1:
                    raise TrainingLoopError("loss is nan")
    assert f.closed
    assert wait_no_feeder_threads(2.0) == []


def _train_and_raise(source, refs):
    f = make(source, [ops.CenterCrop(SIDE)], queue_size=1)  # never closed by this code
    refs.append(weakref.ref(f))
    for i, _ in enumerate(f):
        if i == 1:
            raise TrainingLoopError("loss is nan")


def test_consumer_raises_without_close_gc_stops_threads(src):
    refs: list = []
    try:
        _train_and_raise(src, refs)
    except TrainingLoopError:
        # The traceback keeps the never-closed feeder alive (its pass already
        # stopped with the dropped iterator; see test_feeder).
        assert refs[0]() is not None
    gc.collect()  # ... once it is unreachable, collecting it stops every thread
    assert refs[0]() is None
    assert wait_no_feeder_threads(3.0) == []


@pytest.mark.parametrize("cycle", [False, True], ids=["plain", "in-a-reference-cycle"])
def test_never_closed_feeder_is_collected_and_stops(src, cycle):
    f = make(src, [ops.CenterCrop(SIDE)], batch_size=2, queue_size=1)
    it = iter(f)
    next(it)
    if cycle:
        f.me = f
        it.me = it
    assert feeder_threads()
    ref = weakref.ref(f)
    del f, it
    gc.collect()
    assert ref() is None
    assert wait_no_feeder_threads(3.0) == []


def test_never_closed_feeder_stuck_in_user_code_is_collected(blobs):
    gate = Gate()
    f = make(MemorySource(blobs), [gate, ops.CenterCrop(SIDE)], augment_threads=1, decode_threads=2)
    it = iter(f)
    # Start the pass as a first next() would, without a consumer waiting in next()
    # (whose frame would keep the iterator, and so the feeder, alive).
    start_pass(it)
    assert gate.entered.wait(10)
    ref = weakref.ref(f)
    del f, it
    gc.collect()
    assert ref() is None
    # Every thread but the one inside the user's call stops; that one once its call returns.
    assert wait_feeder_threads_within(gate.callers, 2.0) <= set(gate.callers)
    gate.release.set()
    assert wait_no_feeder_threads(5.0) == []
