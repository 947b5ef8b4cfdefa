"""feeder.storage.local: positional reads through a pool of open files, and telling
network file systems from local ones."""

from __future__ import annotations

import os
import threading

import pytest

from feeder.storage import local as _storage
from feeder.storage.local import FilePool, file_system_type, on_network_storage

from tests.support import run_in_thread


def open_descriptors_to(path) -> int:
    """How many of this process's descriptors are open on ``path`` (Linux)."""
    real = os.path.realpath(path)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == real:
                count += 1
        except OSError:
            continue
    return count


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")


def test_file_pool_forget_and_close_while_reading(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"0123456789")
    pool = FilePool(limit=1)
    assert pool.pread(str(p), 4, 3) == b"3456"
    assert pool.pread(str(p), 100, 8) == b"89"
    pool.forget(str(p))
    pool.close()
    assert pool.pread(str(p), 2, 0) == b"01"  # reopened on demand
    pool.close()


def test_pread_past_the_end_is_empty_and_a_missing_file_raises(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    pool = FilePool()
    assert pool.pread(str(p), 10, 3) == b"" and pool.pread(str(p), 10, 99) == b""
    with pytest.raises(FileNotFoundError):
        pool.pread(str(tmp_path / "missing"), 1, 0)
    pool.close()


@needs_proc
def test_file_pool_keeps_one_descriptor_per_file_up_to_its_limit(tmp_path):
    files = []
    for i in range(4):
        files.append(tmp_path / f"{i}")
        files[-1].write_bytes(bytes([i]) * 8)
    pool = FilePool(limit=2)
    for _ in range(3):
        for i, f in enumerate(files[:2]):
            assert pool.pread(str(f), 1, i) == bytes([i])
    # Read again and again: one descriptor each, kept open.
    assert [open_descriptors_to(f) for f in files[:2]] == [1, 1]
    pool.pread(str(files[2]), 1, 0)
    # Over the limit: the least recently used one is closed.
    assert [open_descriptors_to(f) for f in files[:3]] == [0, 1, 1]
    pool.close()
    assert [open_descriptors_to(f) for f in files] == [0, 0, 0, 0]
    pool.close()  # safe to repeat


@needs_proc
def test_forget_reopens_a_replaced_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"old!")
    pool = FilePool()
    assert pool.pread(str(p), 4, 0) == b"old!"
    replacement = tmp_path / "f.new"
    replacement.write_bytes(b"new!")
    os.replace(replacement, p)
    assert pool.pread(str(p), 4, 0) == b"old!"  # the kept descriptor still reads the old file
    pool.forget(str(p))
    assert pool.pread(str(p), 4, 0) == b"new!"
    pool.close()


def test_concurrent_reads_share_one_pool(tmp_path):
    data = bytes(range(256)) * 64
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"{i}"))
        with open(paths[-1], "wb") as f:
            f.write(data)
    pool = FilePool(limit=2)  # fewer than the files: descriptors come and go under the reads
    start = threading.Barrier(4)
    errors = []

    def reader(k):
        start.wait(10)
        for n in range(200):
            off = (n * 97 + k) % (len(data) - 64)
            if pool.pread(paths[(n + k) % 3], 64, off) != data[off:off + 64]:
                errors.append((k, n))

    threads = [threading.Thread(target=reader, args=(k,), name=f"test-reader-{k}") for k in range(4)]
    for t in threads:
        t.start()
    run_in_thread(lambda: [t.join() for t in threads])
    assert errors == []
    pool.close()


MOUNTS = [("/mnt/data/deep", "nfs4"), ("/mnt/data", "ext4"), ("/", "ext4")]  # longest first


@pytest.mark.parametrize("path, kind", [
    ("/mnt/data/deep/x.jpg", "nfs4"), ("/mnt/data/deep", "nfs4"), ("/mnt/data/deeper/x", "ext4"),
    ("/mnt/data/x", "ext4"), ("/srv/x", "ext4")])
def test_file_system_type_is_the_longest_mount_holding_the_path(path, kind):
    assert file_system_type(path, MOUNTS) == kind


def test_file_system_type_without_a_mount_table_is_unknown(monkeypatch):
    monkeypatch.setattr(_storage, "_read_mounts", lambda: None)
    assert file_system_type("/anything") is None
    assert on_network_storage(["/anything"]) is False


@pytest.mark.parametrize("kind, network", [("nfs", True), ("fuse.gcsfuse", True), ("lustre", True),
                                           ("ext4", False), ("xfs", False), ("tmpfs", False)])
def test_on_network_storage_by_file_system_type(monkeypatch, tmp_path, kind, network):
    table = f"/dev/sda1 / ext4 rw 0 0\nsrv:/x {tmp_path} {kind} rw 0 0\n"
    monkeypatch.setattr(_storage, "_read_mounts", lambda: table)
    assert on_network_storage([str(tmp_path / "a.jpg")]) is network
    assert on_network_storage(["/elsewhere/a.jpg", str(tmp_path / "a.jpg")]) is network
