"""The read stage: its own threads, its byte bound, its first-come-first-served hand-over,
and decode threads that keep working while a read waits."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from feeder import Feeder, ops
from feeder.engine.queue import Channel, Closed
from feeder.engine.read import BudgetedOutbox, ReadBudget, nbytes
from feeder.sample import Task

from tests.support import JOIN_TIMEOUT_S, BlockingSource, MemorySource, drain, labels_of

T = JOIN_TIMEOUT_S


def task(i: int, size: int) -> Task:
    t = Task(None, 0, i)
    t.data = b"x" * size
    return t


def start(fn, *args):
    errors: list[BaseException] = []

    def run():
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            errors.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, errors


def test_nbytes():
    import numpy as np

    assert nbytes(b"abc") == 3 and nbytes(bytearray(5)) == 5
    assert nbytes(memoryview(b"abcd")) == 4 and nbytes(np.zeros(3, np.int64)) == 24
    assert nbytes({"image": b"ab", "mask": b"c"}) == 3 and nbytes(None) == 0


def test_byte_bound_waits_for_bytes_given_back():
    budget = ReadBudget(100)
    ch = Channel("decode", 10)
    out = BudgetedOutbox(ch, budget)
    out.put(task(0, 60))
    th, errors = start(out.put, task(1, 60))  # 120 > 100: waits
    th.join(0.3)  # a bounded look: it must still be waiting
    assert th.is_alive() and ch.depth() == 1 and budget.held == 60
    budget.give(nbytes(ch.get().data))
    th.join(T)
    assert not th.is_alive() and not errors and budget.held == 60 and budget.peak == 60


def test_a_sample_larger_than_the_budget_passes_alone():
    budget = ReadBudget(10)
    out = BudgetedOutbox(Channel("decode", 4), budget)
    out.put(task(0, 50))
    assert budget.held == 50


def test_hand_over_is_first_come_first_served():
    """Samples that wait for room go in the order they arrived, never behind a
    sample that arrived after them."""
    budget = ReadBudget(1 << 30)
    ch = Channel("decode", 1)
    out = BudgetedOutbox(ch, budget)
    out.put(task(0, 1))  # the channel is full now
    threads = []
    for i in range(1, 6):
        th, errors = start(out.put, task(i, 1))
        threads.append((th, errors))
        # The next thread starts only once this one holds its ticket.
        deadline = threading.Event()
        for _ in range(1000):
            if budget._next_ticket == i + 1:
                break
            deadline.wait(0.005)  # polling a condition under a bound
        assert budget._next_ticket == i + 1
    got = []
    for _ in range(6):
        item = ch.get(timeout=T)
        budget.give(nbytes(item.data))
        got.append(item.index)
    for th, errors in threads:
        th.join(T)
        assert not th.is_alive() and not errors
    assert got == [0, 1, 2, 3, 4, 5]


def test_waiting_hand_over_ends_when_closed():
    budget = ReadBudget(10)
    ch = Channel("decode", 4)
    out = BudgetedOutbox(ch, budget)
    out.put(task(0, 10))
    waiting_bytes, e1 = start(out.put, task(1, 10))
    waiting_turn, e2 = start(out.put, task(2, 1))
    ch.close()
    for th in (waiting_bytes, waiting_turn):
        th.join(T)
        assert not th.is_alive()
    assert all(isinstance(e[0], Closed) for e in (e1, e2))


def test_decode_threads_work_while_a_read_waits(mixed_blobs):
    """One decode thread, a read stuck on sample 0: every other sample is still
    decoded and delivered (unordered batches of one), then sample 0 once released."""
    src = BlockingSource(mixed_blobs[:20])
    got = []
    with Feeder(src, 1, [ops.Resize(24), ops.CenterCrop(16)], decode_threads=1, read_threads=4,
                ordered=False, shuffle=False, seed=0) as f:
        it = iter(f)
        for _ in range(19):
            x, y = next(it)
            got.append(int(y[0]))
        assert src.entered.is_set() and 0 not in got
        src.release.set()
        got.extend(labels_of(drain(it)[0]))
    assert Counter(got) == Counter(range(20))


@pytest.mark.parametrize("read_threads, augment", [(0, 0), (1, 0), (3, 2), ("auto", 0)])
def test_exactly_once_with_any_read_threads(source, read_threads, augment):
    seen = Counter()
    for rank in range(2):
        with Feeder(source, 4, [ops.Resize(24), ops.CenterCrop(16)], decode_threads=2,
                    augment_threads=augment, read_threads=read_threads, read_ahead_bytes=3000,
                    rank=rank, world_size=2, seed=1) as f:
            f.set_epoch(1)
            batches, err = drain(f)
            assert err is None
            seen.update(labels_of(batches))
    assert seen == Counter(range(len(source)))


def test_read_options_checked():
    for bad in ({"read_threads": -1}, {"read_threads": "many"}, {"read_ahead_bytes": 0},
                {"read_ahead_bytes": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Feeder(MemorySource([b""]), 1, [ops.CenterCrop(8)], **bad)


# -- read_threads="auto": a read stage only for sources whose reads may wait ---

@pytest.fixture
def png_bytes(jpeg_blobs):
    from feeder.synthetic import make_image
    from tests.support import encode_png

    return encode_png(make_image(12, 10, seed=3))

def test_auto_reads_in_the_decode_threads_for_local_files(tmp_path, png_bytes):
    """Local files are read by the decode threads (no hand-over per sample); a
    source that says nothing about its reads gets a read stage, in case they wait."""
    from feeder import FileList

    path = tmp_path / "a.png"
    path.write_bytes(png_bytes)
    local = FileList([str(path)] * 4, [0, 1, 2, 3])
    assert local.reads_may_block is False
    with Feeder(local, 2, transforms=[ops.Resize((8, 8))], decode_threads=2) as f:
        assert f.config.read_threads == 0
        batches, err = drain(f)
        assert err is None and sorted(labels_of(batches)) == [0, 1, 2, 3]
        assert "read" not in {s.name for s in f.stats().stages}
    with Feeder(local, 2, transforms=[ops.Resize((8, 8))], decode_threads=2, read_threads=3) as f:
        assert f.config.read_threads == 3  # given: used as given
    unknown = MemorySource([png_bytes] * 4)
    assert not hasattr(unknown, "reads_may_block")
    with Feeder(unknown, 2, transforms=[ops.Resize((8, 8))], decode_threads=2) as f:
        assert f.config.read_threads == 32  # 16 per decode thread
        batches, err = drain(f)
        assert err is None and sorted(labels_of(batches)) == [0, 1, 2, 3]


@pytest.mark.parametrize("kind", ["nfs4", "cifs", "lustre", "fuse.sshfs", "fuse"])
def test_files_on_network_storage_get_a_read_stage(tmp_path, monkeypatch, png_bytes, kind):
    from feeder import FileList, ImageFolder
    from feeder.storage import local as _storage

    mounted = tmp_path / "mnt point"  # a space: /proc/self/mounts writes it as \040
    (mounted / "cls").mkdir(parents=True)
    (mounted / "cls" / "a.png").write_bytes(png_bytes)
    (tmp_path / "b.png").write_bytes(png_bytes)
    escaped = str(mounted).replace(" ", "\\040")
    table = f"/dev/sda1 / ext4 rw 0 0\nserver:/x {escaped} {kind} rw 0 0\n"
    monkeypatch.setattr(_storage, "_read_mounts", lambda: table)
    assert _storage.file_system_type(str(mounted / "cls" / "a.png")) == kind
    assert _storage.file_system_type(str(tmp_path / "b.png")) == "ext4"
    assert ImageFolder(str(mounted)).reads_may_block is True
    assert FileList([str(tmp_path / "b.png")]).reads_may_block is False
    both = FileList([str(tmp_path / "b.png"), str(mounted / "cls" / "a.png")])
    assert both.reads_may_block is True
    with Feeder(ImageFolder(str(mounted)), 1, transforms=[ops.Resize((8, 8))], decode_threads=1) as f:
        assert f.config.read_threads == 16


def test_a_failing_or_odd_hint_means_reads_may_block(png_bytes):
    class Failing(MemorySource):
        @property
        def reads_may_block(self):
            raise RuntimeError("cannot tell")

    class Odd(MemorySource):
        reads_may_block = "no"

    for cls in (Failing, Odd):
        with Feeder(cls([png_bytes] * 2), 1, transforms=[ops.Resize((8, 8))], decode_threads=1) as f:
            assert f.config.read_threads == 16


# -- read_threads="auto" for a source that does not say: decided from its reads -

def tiny_pngs(n: int) -> list[bytes]:
    from feeder.synthetic import make_image
    from tests.support import encode_png

    return [encode_png(make_image(12, 10, seed=i)) for i in range(n)]


class WaitingSource(MemorySource):
    """Reads that wait off the CPU, as on network storage (the wait is the
    simulated storage, not a test's synchronization)."""

    def read(self, index: int):
        threading.Event().wait(0.002)
        return super().read(index)


def epochs(f, n: int) -> list[tuple[list, tuple[int, int]]]:
    """Each epoch's batches and, after it, the read stage's (threads, items)."""
    out = []
    for epoch in range(n):
        f.set_epoch(epoch)
        batches, err = drain(f)
        assert err is None
        read = {s.name: s for s in f.stats().stages}.get("read")
        out.append((batches, (int(read.threads), read.items) if read is not None else None))
    return out


def test_measured_read_threads_rule():
    from feeder.engine.threads import FAST_READ_WAIT_S, MEASURED_READS, measured_read_threads

    assert measured_read_threads(32, [0.0] * (MEASURED_READS - 1)) is None
    fast = [FAST_READ_WAIT_S / 10] * MEASURED_READS + [1.0] * (MEASURED_READS // 4)
    threads, why = measured_read_threads(32, fast)
    assert threads == 0 and "read_threads=0" in why
    slow = [2 * FAST_READ_WAIT_S] * MEASURED_READS + [0.0] * (MEASURED_READS // 4)
    assert measured_read_threads(32, slow)[0] == 32


def test_only_a_source_that_does_not_say_is_measured():
    from feeder.engine.config import Config
    from feeder.engine.threads import reads_may_block
    from feeder.engine.threads import MeasuredReadThreads, auto_read_threads
    from feeder.engine.tune import TunedThreads

    class Says(MemorySource):
        reads_may_block = True

    assert reads_may_block(MemorySource([])) is None and reads_may_block(Says([])) is True
    measured = Config.build(batch_size=4, decode_threads=2).resolved(reads_block=None).read_threads
    assert isinstance(measured, MeasuredReadThreads) and measured == auto_read_threads(2)
    for said in (True, False):
        assert not isinstance(Config.build(batch_size=4).resolved(reads_block=said).read_threads, MeasuredReadThreads)
    assert type(Config.build(batch_size=4, read_threads=3).resolved(reads_block=None).read_threads) is int
    assert isinstance(Config.build(batch_size=4, read_threads="tune").resolved(reads_block=None).read_threads,
                      TunedThreads)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_fast_reads_of_a_source_that_does_not_say_lose_the_read_stage(isolation):
    """Epoch 0 reads in a read stage and times its reads (from memory: no wait);
    from epoch 1 on the decode threads read. The batches are the same as with
    read_threads=0, epoch by epoch."""
    blobs = tiny_pngs(96)
    kw = dict(decode_threads=2, shuffle=True, seed=3)
    with Feeder(MemorySource(blobs), 16, [ops.Resize((8, 8))], isolation=isolation, **kw) as f:
        got = epochs(f, 3)
    assert [stage for _, stage in got] == [(32, 96), (0, 96), (0, 96)]
    with Feeder(MemorySource(blobs), 16, [ops.Resize((8, 8))], read_threads=0, **kw) as f:
        want = epochs(f, 3)
    for (batches, _), (expected, _) in zip(got, want):
        assert len(batches) == len(expected) == 6
        for (x, y), (ex, ey) in zip(batches, expected):
            assert (x == ex).all() and (y == ey).all()


def test_reads_are_measured_over_passes_and_never_repeated(caplog):
    """A pass of fewer reads than the decision needs keeps the read stage; the
    next pass's reads add to the measure. No read is made for the measure: one
    read per sample delivered."""
    import logging

    from tests.support import CountingSource

    src = CountingSource(tiny_pngs(40))
    with caplog.at_level(logging.INFO, logger="feeder.engine.engine"):
        with Feeder(src, 8, [ops.Resize((8, 8))], decode_threads=2, seed=0) as f:
            got = epochs(f, 3)
    assert [stage for _, stage in got] == [(32, 40), (32, 80), (0, 80)]
    assert src.reads == Counter({i: 3 for i in range(40)})
    decided = [r.getMessage() for r in caplog.records if "read_threads='auto'" in r.getMessage()]
    assert len(decided) == 1 and "CountingSource" in decided[0] and "read_threads=0" in decided[0]


def test_reads_that_wait_keep_the_read_stage(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="feeder.engine.engine"):
        with Feeder(WaitingSource(tiny_pngs(64)), 16, [ops.Resize((8, 8))], decode_threads=2,
                    seed=0) as f:
            got = epochs(f, 2)
    assert [stage for _, stage in got] == [(32, 64), (32, 128)]
    decided = [r.getMessage() for r in caplog.records if "read_threads='auto'" in r.getMessage()]
    assert len(decided) == 1 and "keep their stage (read_threads=32)" in decided[0]


@pytest.mark.parametrize("kw", [{"read_threads": 4}, {"reads_may_block": True},
                                {"reads_may_block": False}])
def test_a_source_that_says_or_given_read_threads_are_never_changed(kw):
    blobs = tiny_pngs(64)
    src = MemorySource(blobs)
    if "reads_may_block" in kw:
        src.reads_may_block = kw["reads_may_block"]
    threads = kw.get("read_threads", 32 if kw.get("reads_may_block") else 0)
    with Feeder(src, 16, [ops.Resize((8, 8))], decode_threads=2, seed=0,
                read_threads=kw.get("read_threads", "auto")) as f:
        for epoch in range(2):
            f.set_epoch(epoch)
            assert drain(f)[1] is None
            stages = {s.name: int(s.threads) for s in f.stats().stages}
            assert stages.get("read", 0) == threads
