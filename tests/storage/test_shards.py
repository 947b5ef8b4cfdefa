"""TarShards over local shards: spec forms, foreign shards, the offset index, damaged
shards, thread-safe reads, and exactly-once delivery through the Feeder."""

from __future__ import annotations

import io
import os
import random
import shutil
import tarfile
import threading
from collections import Counter

import pytest

from feeder import Feeder, ops
from feeder.storage.tar import ShardIndex, index_path
from feeder.shards import ShardFormatError, TarShards

from tests.support import JOIN_TIMEOUT_S, drain, labels_of


@pytest.fixture(scope="module")
def labelled(packed, jpeg_blobs):
    """60 samples packed into several shards (conftest's ``packed``), and the samples:
    label = sample number (exactly-once checks)."""
    return packed[0], jpeg_blobs


def test_spec_forms_agree(labelled, tmp_path):
    out, _ = labelled
    tars = sorted(f for f in os.listdir(out) if f.endswith(".tar"))
    pattern = os.path.join(out, "train-{000000..%06d}.tar" % (len(tars) - 1))
    forms = [out, os.path.join(out, "train.json"), pattern, os.path.join(out, "train-*.tar"),
             [os.path.join(out, t) for t in tars]]
    got = [[s.read(i) for i in range(len(s))] for s in map(TarShards, forms)]
    assert all(g == got[0] for g in got) and len(got[0]) == 60
    with pytest.raises(FileNotFoundError, match="no \\*.tar"):
        TarShards(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        TarShards(os.path.join(out, "missing.tar"))


def test_a_shard_named_twice_is_refused(labelled):
    """Its samples would come twice an epoch (and a list's nsamples is the shard's,
    so two entries of one shard with different counts could not both hold)."""
    import json

    out, _ = labelled
    tars = sorted(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".tar"))
    with pytest.raises(ValueError, match=r"names shard .*train-000000\.tar more than once \(entries \[0, 2\]\)"):
        TarShards([tars[0], tars[1], tars[0]])
    doc = json.loads(open(os.path.join(out, "train.json")).read())
    doc["shardlist"].append(dict(doc["shardlist"][1], nsamples=doc["shardlist"][1]["nsamples"] + 5))
    # The list's entries name the shards beside it: it is written there.
    listed = os.path.join(out, "dup-test.json")
    with open(listed, "w") as f:
        json.dump(doc, f)
    try:
        with pytest.raises(ValueError, match=r"train-000001\.tar more than once"):
            TarShards(listed)
    finally:
        os.unlink(listed)


def _add(tar, name, data=None, kind=tarfile.REGTYPE):
    info = tarfile.TarInfo(name)
    info.type = kind
    if data is not None:
        info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def test_foreign_shard(tmp_path, jpeg_blobs):
    """A shard written by another tool: pax format (long names in pax headers),
    directory members, fields in any order and not adjacent, multi-dot fields,
    hidden files; no index file, so it is indexed from its headers."""
    path = tmp_path / "foreign-000000.tar"
    deep = "d/" + "x" * 120  # longer than ustar's 100-byte name field
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "d", kind=tarfile.DIRTYPE)
        _add(tar, "d/a.cls", b"3")
        _add(tar, "d/a.jpg", jpeg_blobs[0])
        _add(tar, "d/a.seg.png", b"mask-bytes")
        _add(tar, "d/._a.jpg", b"apple double")
        _add(tar, f"{deep}.json", b'{"k": 1}')
        _add(tar, f"{deep}.cls", b" 7\n")
        _add(tar, "d/b.png", jpeg_blobs[1])  # any name: feeder decodes by content
        _add(tar, f"{deep}.webp", jpeg_blobs[2])
        _add(tar, "d/b.cls", b"1")
        _add(tar, "d/c.txt", b"no image")
        _add(tar, "d/link.jpg", kind=tarfile.SYMTYPE)
    shards = TarShards(str(path), label="cls", fields=None)  # pairs: the other members unread
    assert len(shards) == 4  # a, the deep one, b, and c (no image: it fails when read)
    assert shards.read(0) == (jpeg_blobs[0], 3)
    assert shards.read(1) == (jpeg_blobs[2], 7)
    assert shards.read(2) == (jpeg_blobs[1], 1)
    assert shards.describe(1) == f"{path}:{deep}"
    assert shards.read_fields(0) == {"cls": b"3", "jpg": jpeg_blobs[0], "seg.png": b"mask-bytes"}
    assert shards.read_record(0) == {"label": 3, "image": jpeg_blobs[0], "mask": b"mask-bytes"}
    assert shards.read_record(1) == {"label": 7, "image": jpeg_blobs[2], "json": {"k": 1}}
    assert TarShards(str(path)).read(0) == shards.read_record(0)  # auto: more than pairs hold
    assert not os.path.exists(index_path(str(path)))  # nothing written next to user data
    assert not shards.warnings


def test_gnu_long_names(tmp_path, jpeg_blobs):
    path = tmp_path / "gnu.tar"
    long = "k" * 150
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, f"{long}.jpg", jpeg_blobs[0])
        _add(tar, f"{long}.cls", b"2")
    s = TarShards(str(path))
    assert s.read(0) == (jpeg_blobs[0], 2) and s.key(0) == long


def test_index_file_is_used(labelled, tmp_path):
    """With an index, reads go straight to the offsets: broken headers do not matter."""
    out, blobs = labelled
    src = os.path.join(out, "train-000000.tar")
    shard = tmp_path / "train-000000.tar"
    data = bytearray(open(src, "rb").read())
    data[0:512] = b"\x01" * 512  # the first header is garbage now
    shard.write_bytes(bytes(data))
    idx = tmp_path / "train-000000.idx"
    idx.write_text(open(index_path(src)).read())
    os.utime(idx, (os.path.getmtime(shard) + 5,) * 2)
    s = TarShards(str(shard))
    assert s.read(0) == (blobs[0], 0)
    # An index older than its shard is not trusted: the headers are scanned instead,
    # and the broken header is reported.
    os.utime(idx, (os.path.getmtime(shard) - 60,) * 2)
    s = TarShards(str(shard))
    assert any("corrupt tar header at byte 0" in w for w in s.warnings)
    assert list(s.read_fields(0)) == ["cls"]  # the image member is lost with its header


def test_malformed_index_named(tmp_path, labelled):
    out, _ = labelled
    shard = tmp_path / "s.tar"
    shard.write_bytes(open(os.path.join(out, "train-000000.tar"), "rb").read())
    (tmp_path / "s.idx").write_text("v1.2 3\njpg 512 10 a.jpg\n")
    with pytest.raises(ShardFormatError, match=r"s\.idx.*3 samples but the index has 1"):
        TarShards(str(shard))
    (tmp_path / "s.idx").write_text("v1.2 1\njpg 512 ten a.jpg\n")
    with pytest.raises(ShardFormatError, match=r"s\.idx: line 2"):
        TarShards(str(shard))


def _truncated_copy(src: str, dst, cut_inside: int):
    """``src`` cut ``cut_inside`` bytes into the data of its last image member."""
    ix = ShardIndex.from_text(open(index_path(src)).read(), src)
    last_img = max(m for m, e in enumerate(ix.exts) if e == "jpg")
    cut = int(ix.offsets[last_img]) + cut_inside
    dst.write_bytes(open(src, "rb").read()[:cut])
    return ix


@pytest.mark.parametrize("with_index", [True, False])
def test_truncated_shard(labelled, tmp_path, with_index):
    out, blobs = labelled
    src = os.path.join(out, "train-000001.tar")
    dst = tmp_path / "train-000001.tar"
    ix = _truncated_copy(src, dst, 100)
    if with_index:
        (tmp_path / "train-000001.idx").write_text(open(index_path(src)).read())
    s = TarShards(str(dst))
    assert len(s) == len(ix)  # the cut sample is still there, to be reported
    first = int(ix.keys[0])
    for j in range(len(ix) - 1):
        assert s.read(j) == (blobs[first + j], first + j)
    last = len(ix) - 1
    with pytest.raises(ShardFormatError, match=rf"train-000001\.tar:{ix.keys[last]}: truncated shard"):
        s.read(last)
    if not with_index:
        assert any("truncated" in w and ix.keys[last] in w for w in s.warnings)


def test_corrupt_header_resync(labelled, tmp_path):
    """Without an index, a damaged header loses only the member it described."""
    out, blobs = labelled
    src = os.path.join(out, "train-000000.tar")
    ix = ShardIndex.from_text(open(index_path(src)).read(), src)
    data = bytearray(open(src, "rb").read())
    second_sample_header = int(ix.offsets[ix.start[1]]) - 512
    data[second_sample_header + 148:second_sample_header + 156] = b"9999999\0"  # bad checksum
    dst = tmp_path / "s.tar"
    dst.write_bytes(bytes(data))
    s = TarShards(str(dst), label=None)
    assert len(s.warnings) == 1 and "corrupt tar header" in s.warnings[0]
    keys = [s.key(i) for i in range(len(s))]
    assert keys == ix.keys  # the sample lost its image member, not its place
    with pytest.raises(ShardFormatError, match=f"{ix.keys[1]}: no image field"):
        s.read(1)
    assert s.read(2)[0] == blobs[int(ix.keys[2])]


def test_compressed_shards_refused(tmp_path):
    with pytest.raises(ValueError, match=r"x-000\.tar\.gz is compressed"):
        TarShards([str(tmp_path / "x-000.tar.gz")])


def test_label_errors(tmp_path, jpeg_blobs):
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as tar:
        _add(tar, "a.jpg", jpeg_blobs[0])
        _add(tar, "a.cls", b"cat")
        _add(tar, "b.jpg", jpeg_blobs[1])
        _add(tar, "c.txt", b"x")
    s = TarShards(str(path), fields=None)
    with pytest.raises(ShardFormatError, match=r"s\.tar:a: \.cls field is not an integer"):
        s.read(0)
    with pytest.raises(ShardFormatError, match=r"s\.tar:b: no \.cls field"):
        s.read(1)
    with pytest.raises(ShardFormatError, match=r"s\.tar:c: no image field.*has: txt"):
        s.read(2)
    with pytest.raises(ValueError, match="none of the 3 samples.*has an image field"):
        TarShards(str(path), image_exts=["png"])
    with pytest.raises(IndexError):
        s.read(3)


def test_concurrent_reads_share_no_position(labelled):
    out, blobs = labelled
    s = TarShards(out)
    s.files.limit = 2  # fewer descriptors than shards: opened and closed under load
    errors = []
    barrier = threading.Barrier(8, timeout=JOIN_TIMEOUT_S)

    def reader(seed):
        rng = random.Random(seed)
        try:
            barrier.wait()
            for _ in range(300):
                i = rng.randrange(len(s))
                assert s.read(i) == (blobs[i], i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(s.files._open) <= 2
    s.close()


def delivered(f):
    batches, err = drain(f)
    if err is not None:
        raise err
    return labels_of(batches)


def _feeder(src, **kw):
    return Feeder(src, 8, [ops.Resize(24), ops.CenterCrop(16)], seed=3, **kw)


@pytest.mark.parametrize("threads", [1, 3])
def test_exactly_once_across_threads_ranks_epochs(labelled, threads):
    out, _ = labelled
    src = TarShards(out)
    for epoch in range(2):
        seen = Counter()
        for rank in range(2):
            with _feeder(src, decode_threads=threads, rank=rank, world_size=2) as f:
                f.set_epoch(epoch)
                seen.update(delivered(f))
        assert seen == Counter(range(60)), epoch


def test_skip_loses_only_truncated_samples(labelled, tmp_path):
    out, _ = labelled
    for f in os.listdir(out):
        if f.endswith((".tar", ".idx")):
            os.link(os.path.join(out, f), tmp_path / f)
    victim = tmp_path / "train-000002.tar"
    os.unlink(victim)
    ix = _truncated_copy(os.path.join(out, "train-000002.tar"), victim, 10)
    src = TarShards(str(tmp_path))
    lost = {int(ix.keys[-1])}
    with _feeder(src, on_error="skip", decode_threads=2) as f:
        got = delivered(f)
        stats = f.stats()
    assert sorted(got) == sorted(set(range(60)) - lost)
    assert stats.skipped == 1
    assert any(f"train-000002.tar:{ix.keys[-1]}" in p for p in stats.skipped_paths)
    with _feeder(src, on_error="raise", shuffle=False) as f:
        with pytest.raises(Exception, match=f"train-000002.tar:{ix.keys[-1]}"):
            delivered(f)


@pytest.mark.parametrize("index_newer", [True, False])
def test_a_shard_cut_under_its_index_keeps_its_samples_numbered(labelled, tmp_path, index_newer):
    """A shard cut in its middle, its index beside it (newer: written after the
    damage; older: the cut changed the shard's time): every sample the index
    promises keeps its number, and each one past the cut is a counted skip
    naming the shard and key; none is lost unseen, and len() stays the index's."""
    out, _ = labelled
    for f in os.listdir(out):
        if f.endswith((".tar", ".idx")):
            shutil.copy(os.path.join(out, f), tmp_path / f)
    victim = tmp_path / "train-000000.tar"
    ix = ShardIndex.from_text(open(index_path(str(victim))).read(), str(victim))
    cut = int(ix.offsets[ix.start[1]]) + 10  # inside the second sample's first member
    with open(victim, "r+b") as f:
        f.truncate(cut)
    stamp = os.stat(victim).st_mtime_ns
    os.utime(tmp_path / "train-000000.idx", ns=(stamp + (10**10 if index_newer else -10**10),) * 2)
    lost = {int(k) for k in ix.keys[1:]}
    assert len(lost) >= 2
    src = TarShards(str(tmp_path))
    assert len(src) == 60
    assert any("train-000000.tar: truncated" in w and f"the {len(lost)} samples" in w
               for w in src.warnings)
    with _feeder(src, on_error="skip", decode_threads=2) as f:
        got = delivered(f)
        stats = f.stats()
    assert sorted(got) == sorted(set(range(60)) - lost)
    assert stats.skipped == len(lost)
    with _feeder(src, on_error="raise", shuffle=False) as f:
        with pytest.raises(Exception, match=f"train-000000.tar:{ix.keys[1]}: truncated shard"):
            delivered(f)


def test_a_local_shard_changed_after_indexing_fails_its_reads(labelled, tmp_path):
    """A shard replaced by one of another size between the source's construction
    and its first read: each read is an error naming both sizes, never other
    samples' bytes at the old index's offsets."""
    out, _ = labelled
    names = sorted(f for f in os.listdir(out) if f.endswith(".tar"))
    sizes = {f: os.path.getsize(os.path.join(out, f)) for f in names}
    victim, other = names[-1], next(f for f in names if sizes[f] != sizes[names[-1]])
    for f in os.listdir(out):
        if f.endswith((".tar", ".idx")):
            shutil.copy(os.path.join(out, f), tmp_path / f)
    src = TarShards(str(tmp_path))
    first, stop = src.shard_ranges()[names.index(victim)]
    shutil.copy(tmp_path / other, tmp_path / ".swap")
    os.replace(tmp_path / ".swap", tmp_path / victim)
    for i in range(first, stop):
        with pytest.raises(ShardFormatError, match=rf"{victim}: holds {sizes[other]} bytes, "
                                                   rf"{sizes[victim]} when its index was loaded"):
            src.read(i)
    assert src.read(0)[1] == 0  # the other shards read as before


# -- shuffle="shards": the order for streaming storage -------------------------------

def test_shard_order_is_pure_exactly_once_and_local():
    from feeder.engine.sampler import ShardLayout, shard_order

    ranges = ((0, 7), (7, 20), (20, 21), (21, 40), (40, 55))
    layout = ShardLayout(ranges, window=6)
    shard_of = {i: k for k, (a, b) in enumerate(ranges) for i in range(a, b)}
    a = shard_order(layout, 3, 0)
    assert a.tolist() == shard_order(layout, 3, 0).tolist()
    assert a.tolist() != shard_order(layout, 3, 1).tolist() != shard_order(layout, 4, 0).tolist()
    assert sorted(a.tolist()) == list(range(55))
    # With a window of one sample, each shard is read start to end, shards in a shuffled order.
    one = shard_order(ShardLayout(ranges, 1), 3, 0).tolist()
    runs = [shard_of[i] for k, i in enumerate(one) if k == 0 or shard_of[one[k - 1]] != shard_of[i]]
    assert sorted(runs) == [0, 1, 2, 3, 4] and runs != [0, 1, 2, 3, 4]
    assert all(one[k + 1] == one[k] + 1 for k in range(54) if shard_of[one[k]] == shard_of[one[k + 1]])
    # Windows: each block of 6 positions holds the same samples as the unshuffled stream's block.
    for k in range(0, 55, 6):
        assert sorted(a[k:k + 6].tolist()) == sorted(one[k:k + 6])
    for even in (True, False):
        parts = [shard_order(layout, 3, 2, r, 3, even).tolist() for r in range(3)]
        got = [i for p in parts for i in p]
        assert len(got) == len(set(got))
        assert [len(p) for p in parts] == ([18, 18, 18] if even else [19, 18, 18])
        if not even:
            assert sorted(got) == list(range(55))
        # Each rank reads a contiguous run of the shard stream: few shards each.
        assert all(len({shard_of[i] for i in p}) <= 3 for p in parts)


@pytest.mark.parametrize("threads", [1, 3])
def test_shard_order_through_the_feeder(labelled, threads):
    out, _ = labelled
    src = TarShards(out)
    for epoch in range(2):
        seen = Counter()
        for rank in range(2):
            with _feeder(src, decode_threads=threads, rank=rank, world_size=2, shuffle="shards",
                         shuffle_window=5, drop_last=False) as f:
                f.set_epoch(epoch)
                seen.update(delivered(f))
        assert seen == Counter(range(60)), epoch


def test_shard_order_resumes(labelled):
    out, _ = labelled
    src = TarShards(out)
    with _feeder(src, shuffle="shards", shuffle_window=7) as f:
        full = delivered(f)
    with _feeder(src, shuffle="shards", shuffle_window=7) as f:
        it = iter(f)
        head = [int(v) for _ in range(3) for v in next(it)[1]]
        state = f.state_dict()
    assert state["settings"]["shuffle_window"] == 7
    with _feeder(src, shuffle="shards", shuffle_window=7) as f:
        f.load_state_dict(state)
        rest = delivered(f)
    assert head + rest == full
    with _feeder(src, shuffle="shards", shuffle_window=8) as f:
        with pytest.raises(ValueError, match="shuffle_window differs"):
            f.load_state_dict(state)


def test_shard_order_needs_shards(source):
    with pytest.raises(ValueError, match="shuffle='shards' needs a source made of shards"):
        _feeder(source, shuffle="shards")
    with pytest.raises(ValueError, match="shuffle must be True, False or 'shards'"):
        _feeder(source, shuffle="random")


def test_reads_in_a_forked_child(labelled):
    """A DataLoader worker is a fork: the child reads through the inherited source,
    even when a parent thread held the descriptor pool's lock at the fork."""
    out, blobs = labelled
    src = TarShards(out)
    assert src.read(3) == (blobs[3], 3)
    src.files._lock.acquire()  # as if a parent thread were inside the pool at the fork
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit status says whether the reads were right
            ok = all(src.read(i) == (blobs[i], i) for i in range(len(src)))
            os._exit(0 if ok else 1)
    finally:
        src.files._lock.release()
    done = threading.Event()
    for _ in range(int(JOIN_TIMEOUT_S / 0.05)):  # a bounded wait for the child
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            break
        done.wait(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0


def test_pickled_for_a_spawned_process(labelled):
    import pickle

    out, blobs = labelled
    src = TarShards(out)
    src.read(0)  # descriptors open: they do not travel
    copy = pickle.loads(pickle.dumps(src))
    assert len(copy) == 60 and copy.files is not src.files
    assert [copy.read(i) for i in range(60)] == [(blobs[i], i) for i in range(60)]
    copy.close()
