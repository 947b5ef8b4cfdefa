"""feeder-pack: layout, offset index, sizes, re-encoding, atomic and resumable output, CLI."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import subprocess
import sys
import tarfile

import cv2
import numpy as np
import pytest

from feeder import ImageFolder
from feeder.storage.tar import ShardIndex, scan
from feeder.storage.local import FilePool
from feeder.pack import PackError, main, pack, parse_size
from feeder.shards import TarShards

from tests.support import encode_jpeg, encode_png, run_in_thread
from feeder.synthetic import make_image


def shard_files(out):
    return sorted(f for f in os.listdir(out) if f.endswith(".tar"))


def test_pack_image_folder_roundtrip(image_folder, tmp_path):
    out = tmp_path / "out"
    res = pack(image_folder, str(out), shard_size=parse_size("20KB"), name="train")
    folder = ImageFolder(image_folder)
    assert res.samples == len(folder) and len(res.shards) > 2
    shards = TarShards(str(out))
    assert len(shards) == len(folder)
    for i in range(len(folder)):
        assert shards.read(i) == folder.read(i)  # the original bytes and label, in order
        assert shards.describe(i).endswith(f".tar:{i:09d}")
    manifest = json.loads((out / "train.json").read_text())
    assert manifest["__kind__"] == "wids-shard-index-v1"
    assert manifest["classes"] == folder.classes
    assert [e["nsamples"] for e in manifest["shardlist"]] == [len(TarShards(s)) for s in res.shards]
    assert TarShards(str(out / "train.json")).classes == folder.classes
    for shard in res.shards:
        # Each shard's index is DALI's text format and matches what its headers say.
        text = open(shard[:-4] + ".idx").read()
        assert text.startswith("v1.2 ")
        scanned = scan(lambda n, o, p=shard: FilePool().pread(p, n, o), os.path.getsize(shard), shard,
                       pytest.fail)
        # ... then a line of image sizes and one of EXIF-transposed images (for
        # aspect-ratio grouping), which DALI does not read.
        body, sizes_line, rest = text.partition("# image_sizes ")
        assert scanned.to_text() == body and sizes_line and rest.count("\n") == 2
        assert rest.splitlines()[1].startswith("# image_transposed ")
        with tarfile.open(shard) as tar:  # a standard tar, readable by any tool
            names = tar.getnames()
        assert all(n.endswith((".jpg", ".png", ".cls")) for n in names)


def test_shard_size_bound(image_folder, tmp_path):
    limit = parse_size("30KB")
    res = pack(image_folder, str(tmp_path), shard_size=limit)
    for shard in res.shards:
        n = len(TarShards(shard))
        assert os.path.getsize(shard) <= limit or n == 1


def test_max_side_reencodes_large_images_only(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    big, small = make_image(300, 200, seed=1), make_image(40, 30, seed=2)
    (src / "big.jpg").write_bytes(encode_jpeg(big))
    (src / "small.jpg").write_bytes(encode_jpeg(small))
    (src / "wide.png").write_bytes(encode_png(make_image(50, 400, seed=3)))
    res = pack(str(tmp_path / "src"), str(tmp_path / "out"), max_side=100, quality=80)
    assert res.reencoded == 2 and not res.kept
    shards = TarShards(str(tmp_path / "out"))
    shapes = {}
    for i in range(len(shards)):
        data, _ = shards.read(i)
        shapes[i] = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED).shape[:2]
    assert shapes == {0: (100, 67), 1: (40, 30), 2: (12, 100)}
    assert shards.read(1)[0] == (src / "small.jpg").read_bytes()  # small enough: bytes kept


def test_file_list_source(tmp_path, jpeg_blobs):
    lines = []
    for i in range(6):
        (tmp_path / f"{i}.jpg").write_bytes(jpeg_blobs[i])
        lines.append(f"{i}.jpg {i * 2}" if i < 4 else f"{i}.jpg")
    (tmp_path / "list.txt").write_text("# images\n" + "\n".join(lines) + "\n")
    pack(str(tmp_path / "list.txt"), str(tmp_path / "out"))
    shards = TarShards(str(tmp_path / "out"))
    assert [shards.read(i)[1] for i in range(4)] == [0, 2, 4, 6]
    with pytest.raises(Exception, match=r"000000004: no \.cls field"):
        shards.read(4)  # unlabeled samples have no .cls: named when a label is asked for
    assert TarShards(str(tmp_path / "out"), label=None).read(4) == (jpeg_blobs[4], -1)


@pytest.mark.parametrize("junk", [b"", b"hello, not an image\n"])
def test_a_file_that_is_no_image_is_an_error_naming_it(tmp_path, jpeg_blobs, junk):
    # As a source's sample that is no image: refused, not packed to fail later.
    os.makedirs(tmp_path / "data" / "a")
    (tmp_path / "data" / "a" / "0.jpg").write_bytes(jpeg_blobs[0])
    (tmp_path / "data" / "a" / "1.jpg").write_bytes(junk)
    with pytest.raises(PackError, match=r"a/1\.jpg: not an image feeder reads \(first bytes"):
        pack(str(tmp_path / "data"), str(tmp_path / "out"))


def test_every_format_feeder_reads_packs_from_a_folder(tmp_path):
    # The check of a file's first bytes accepts what the decoder accepts:
    # BigTIFF, and a PNM whose header goes on with a comment.
    import io

    from PIL import Image

    img = make_image(12, 16, seed=1)
    os.makedirs(tmp_path / "data" / "a")
    big = io.BytesIO()
    Image.fromarray(img).save(big, format="TIFF", big_tiff=True)
    assert big.getvalue()[:4] == b"II+\x00"
    (tmp_path / "data" / "a" / "0.tif").write_bytes(big.getvalue())
    (tmp_path / "data" / "a" / "1.ppm").write_bytes(b"P6#made by hand\n16 12\n255\n" + img.tobytes())
    pack(str(tmp_path / "data"), str(tmp_path / "out"))
    shards = TarShards(str(tmp_path / "out"))
    assert len(shards) == 2


def test_unlabeled_pack_needs_label_none(tmp_path, jpeg_blobs):
    (tmp_path / "a.jpg").write_bytes(jpeg_blobs[0])
    (tmp_path / "list.txt").write_text("a.jpg\n")
    pack(str(tmp_path / "list.txt"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="label=None"):
        TarShards(str(tmp_path / "out"))


def _make_folder(root, blobs, n=30):
    for i in range(n):
        d = root / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(blobs[i % len(blobs)])


def test_interrupted_pack_resumes_to_identical_output(tmp_path, jpeg_blobs):
    src = tmp_path / "src"
    _make_folder(src, jpeg_blobs)
    ref = pack(str(src), str(tmp_path / "ref"), shard_size=parse_size("25KB"))
    # A file that cannot be read stops the pack half-way: complete shards stay,
    # the shard in progress is removed, no shard list is written.
    victim = src / "c1" / "016.jpg"
    data = victim.read_bytes()
    victim.unlink()
    victim.symlink_to(tmp_path / "gone.jpg")  # listed, but opening it fails
    out = tmp_path / "out"
    with pytest.raises(OSError, match="016.jpg"):
        pack(str(src), str(out), shard_size=parse_size("25KB"))
    partial = shard_files(out)
    assert 0 < len(partial) < len(ref.shards)
    assert not (out / "train.json").exists()
    assert not [f for f in os.listdir(out) if f.endswith(".part")]
    for f in partial:  # what is there is complete
        assert len(TarShards(str(out / f))) == len(TarShards(str(tmp_path / "ref" / f)))
    # A killed run leaves a temporary shard, or an index renamed before its shard.
    (out / ".train-000009.tar.part").write_bytes(b"partial")
    nxt = len(partial)
    (out / f"train-{nxt:06d}.idx").write_text("v1.2 0\n")
    victim.unlink()
    victim.write_bytes(data)
    res = pack(str(src), str(out), shard_size=parse_size("25KB"))
    assert res.resumed == len(partial)
    assert shard_files(out) == shard_files(tmp_path / "ref")
    for f in shard_files(out):
        assert (out / f).read_bytes() == (tmp_path / "ref" / f).read_bytes()
    assert not [f for f in os.listdir(out) if f.endswith(".part")]


def test_rerun_with_other_settings_refused(tmp_path, jpeg_blobs):
    src = tmp_path / "src"
    _make_folder(src, jpeg_blobs, 6)
    pack(str(src), str(tmp_path / "out"), shard_size=parse_size("25KB"))
    with pytest.raises(PackError, match="shard_size.*--overwrite"):
        pack(str(src), str(tmp_path / "out"), shard_size=parse_size("50KB"))
    res = pack(str(src), str(tmp_path / "out"), shard_size=parse_size("50KB"), overwrite=True)
    assert res.resumed == 0 and len(TarShards(str(tmp_path / "out"))) == 6
    # Shards this command did not write are never taken over silently.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "train-000000.tar").write_bytes(b"")
    with pytest.raises(PackError, match="did not start"):
        pack(str(src), str(tmp_path / "other"))


def test_cli(tmp_path, image_folder, capsys):
    assert main([image_folder, str(tmp_path / "o"), "--shard-size", "40KB", "--name", "val", "-q"]) == 0
    out = capsys.readouterr().out
    assert "16 samples" in out and "val.json" in out
    assert os.path.exists(tmp_path / "o" / "val-000000.tar")
    assert main([str(tmp_path / "missing"), str(tmp_path / "o2"), "-q"]) == 2
    assert "neither an ImageFolder" in capsys.readouterr().err
    assert main([image_folder, str(tmp_path / "o2"), "--name", "train.v2", "-q"]) == 2
    assert "--name 'train.v2'" in capsys.readouterr().err
    # The module entry point, with the progress bar on stderr.
    proc = subprocess.run([sys.executable, "-m", "feeder.pack", image_folder, str(tmp_path / "o3")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr
    assert "16/16" in proc.stderr and "img" in proc.stderr
    assert len(ShardIndex.from_text((tmp_path / "o3" / "train-000000.idx").read_text(), "x")) == 16


# -- hostile inputs and failing storage ------------------------------------------------------

def _assert_only_complete_shards(out):
    """Every shard under its final name is whole (its index's members all read back)
    and no temporary file is left."""
    assert not [f for f in os.listdir(out) if f.endswith(".part")]
    for f in shard_files(out):
        with tarfile.open(out / f) as tar:
            names = tar.getnames()
        ix = ShardIndex.from_text((out / f.replace(".tar", ".idx")).read_text(), f)
        assert len(ix) and all(any(n.startswith(k) for n in names) for k in ix.keys)


def test_fifo_named_jpg_is_skipped_never_opened(tmp_path, jpeg_blobs):
    src = tmp_path / "src"
    _make_folder(src, jpeg_blobs, 6)
    fifo = src / "c1" / "002b.jpg"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes: never
    res = run_in_thread(lambda: pack(str(src), str(tmp_path / "out")), timeout=60)
    assert res.samples == 6 and res.skipped == [f"{fifo} (FIFO)"]
    assert len(TarShards(res.manifest)) == 6
    # The command says so.
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert run_in_thread(lambda: main([str(src), str(tmp_path / "out2"), "-q"]), timeout=60) == 0
    assert f"skipped, not a regular file: {fifo} (FIFO)" in buf.getvalue()


def test_input_replaced_by_a_fifo_after_listing_fails_naming_it(tmp_path):
    from feeder.pack import _read_input
    fifo = tmp_path / "late.jpg"
    os.mkfifo(fifo)
    with pytest.raises(PackError, match=r"late\.jpg: input is not a regular file \(FIFO\)"):
        run_in_thread(lambda: _read_input(str(fifo)), timeout=30)


class _FailingFile:
    """A file whose writes fail with ``code`` once ``budget`` bytes were written (a
    disk that fills up), or whose reads fail (a failing disk)."""

    def __init__(self, real, code, budget=None, fail_reads=False):
        self.real, self.code, self.budget, self.fail_reads = real, code, budget, fail_reads

    def write(self, data):
        if self.budget is not None:
            if len(data) > self.budget:
                raise OSError(self.code, os.strerror(self.code))
            self.budget -= len(data)
        return self.real.write(data)

    def read(self, *args):
        if self.fail_reads:
            raise OSError(self.code, os.strerror(self.code))
        return self.real.read(*args)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.real.close()


def test_disk_full_names_the_shard_and_folder_and_leaves_no_truncated_shard(tmp_path, jpeg_blobs,
                                                                            monkeypatch):
    import builtins
    import feeder.storage.packout as packmod  # writes the shards
    src = tmp_path / "src"
    _make_folder(src, jpeg_blobs)
    out = tmp_path / "out"
    shards_opened = []

    def fake_open(file, mode="r", *args, **kw):
        f = builtins.open(file, mode, *args, **kw)
        if isinstance(file, str) and file.endswith(".tar.part"):
            shards_opened.append(file)
            # The third shard meets a full disk part-way through.
            return _FailingFile(f, errno.ENOSPC, 10_000) if len(shards_opened) == 3 else f
        return f
    monkeypatch.setattr(packmod, "open", fake_open, raising=False)
    with pytest.raises(OSError) as info:
        pack(str(src), str(out), shard_size=parse_size("25KB"))
    msg = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert str(out) in msg and ".train-000002.tar.part" in msg and "full" in msg
    assert shard_files(out) == ["train-000000.tar", "train-000001.tar"]
    _assert_only_complete_shards(out)
    assert not (out / "train.json").exists()
    # The same command, once there is room, completes the pack from there.
    monkeypatch.undo()
    res = pack(str(src), str(out), shard_size=parse_size("25KB"))
    assert res.resumed == 2 and len(TarShards(res.manifest)) == 30


def test_read_only_output_names_the_folder(tmp_path, jpeg_blobs, monkeypatch):
    import builtins
    import feeder.storage.packout as packmod  # writes the shards
    src = tmp_path / "src"
    _make_folder(src, jpeg_blobs, 6)
    out = tmp_path / "out"

    def fake_open(file, mode="r", *args, **kw):
        if isinstance(file, str) and "w" in mode:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), file)
        return builtins.open(file, mode, *args, **kw)
    monkeypatch.setattr(packmod, "open", fake_open, raising=False)
    with pytest.raises(OSError, match="read-only") as info:
        pack(str(src), str(out))
    assert str(out) in str(info.value) and info.value.errno == errno.EROFS
    assert not [f for f in os.listdir(out) if f.endswith(".part")]
    assert main([str(src), str(tmp_path / "out2"), "-q"]) == 2


def test_failing_input_read_names_the_file(tmp_path, jpeg_blobs, monkeypatch):
    import builtins
    import feeder.storage.packinput as packmod  # reads the inputs
    src = tmp_path / "src"
    _make_folder(src, jpeg_blobs, 9)
    victim = str(src / "c1" / "004.jpg")

    def fake_open(file, mode="r", *args, **kw):
        f = builtins.open(file, mode, *args, **kw)
        if isinstance(file, int) and os.path.realpath(f"/proc/self/fd/{file}") == victim:
            return _FailingFile(f, errno.EIO, fail_reads=True)
        return f
    monkeypatch.setattr(packmod, "open", fake_open, raising=False)
    with pytest.raises(OSError, match="004.jpg") as info:
        pack(str(src), str(tmp_path / "out"))
    assert info.value.errno == errno.EIO and "reading input file" in str(info.value)
    _assert_only_complete_shards(tmp_path / "out")


def test_source_read_error_without_a_filename_names_the_sample(tmp_path, jpeg_blobs):

    class Flaky:
        def __len__(self):
            return 4

        def read(self, i):
            if i == 2:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return jpeg_blobs[i], 0

        def describe(self, i):
            return f"blob://{i}"
    with pytest.raises(OSError, match=r"reading sample 2 \(blob://2\): Input/output error"):
        pack(Flaky(), str(tmp_path / "out"))


# -- hostile arguments: one line naming the culprit, never a traceback -----------------

@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, str]:
    from tests.support.cli import hostile_files

    return hostile_files(tmp_path_factory.mktemp("pack-hostile"))


PACK_HOSTILE = [
    # (argv, status, names the last line must hold)
    (["{missing}", "{out}"], 2, ["{missing}"]),
    (["{photos}", "{afile}"], 2, ["OUT_DIR '{afile}'"]),
    (["{photos}", "{out}", "--workers", "-1"], 2, ["--workers"]),
    (["{photos}", "{out}", "--shard-size", "nan"], 2, ["--shard-size"]),
    (["{photos}", "{out}", "--max-side", "-5"], 2, ["--max-side"]),
    (["no_such_module:source", "{out}"], 2, ["no_such_module"]),
    (["tests.support.cli:raising_source", "{out}"], 1,
     ["SOURCE tests.support.cli:raising_source raised RuntimeError: the source blew up"]),
    (["tests.support.cli:BrokenReads", "{out}"], 2, ["sample 0", "disk gone"]),
    (["{empty}", "{out}"], 2, ["{empty}"]),
    (["{noimage}", "{out}"], 2, ["{noimage}"]),
    (["{list}", "{out}"], 2, ["{list}:1: lists", "gone.jpg", "which does not exist"]),
    (["{afile}", "{out}"], 2, ["{afile}:1: lists", "read as a file list"]),
    (["{latin1}", "{out}"], 2, ["{latin1}: line 2: not UTF-8 text"]),
]


@pytest.mark.parametrize("argv, status, names", PACK_HOSTILE)
def test_pack_hostile_arguments_end_in_one_line(hostile, tmp_path, argv, status, names):
    from tests.support.cli import assert_one_line_error, run_cli

    r = run_cli("feeder.pack", ["-q", *argv], hostile, tmp_path)
    assert_one_line_error(r, "feeder-pack", names, hostile, status)


def test_decoded_images_are_packed_as_png_of_the_pixels_a_feeder_delivers(tmp_path):
    """Arrays, tensors and PIL images (gray, RGB, RGBA, CHW) come back from the
    shards as the very pixels a feeder over the source delivers."""
    import torch
    from PIL import Image

    from feeder import Feeder

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (16, 20, 3), np.uint8), rng.integers(0, 256, (9, 7), np.uint8),
              rng.integers(0, 256, (5, 6, 4), np.uint8),
              torch.from_numpy(rng.integers(0, 256, (3, 8, 9), np.uint8)),
              Image.fromarray(rng.integers(0, 256, (10, 11, 3), np.uint8))]

    class Decoded:
        def __len__(self):
            return len(images)

        def read(self, i):
            return images[i], i

    def delivered(source):
        with Feeder(source, 1, image_size=None, max_image_size=(16, 20), shuffle=False) as f:
            out = {}
            for batch in run_in_thread(lambda: [(b["image"].clone(), b["size"].clone(), b["label"].clone())
                                                for b in f]):
                x, size, y = batch
                h, w = size[0].tolist()
                out[int(y[0])] = x[0, :, :h, :w].numpy().copy()
            return out

    result = pack(Decoded(), str(tmp_path))
    assert result.samples == len(images)
    want = delivered(Decoded())
    got = delivered(TarShards(result.shards))
    assert sorted(got) == list(range(len(images)))
    for i in range(len(images)):
        np.testing.assert_array_equal(got[i], want[i])
