"""Sources: ImageFolder's torchvision conventions, FileList."""

from __future__ import annotations

import os
import threading

import pytest

from feeder import FileList, ImageFolder
from feeder.sources import _read_file, describe


def test_image_folder_classes_sorted_and_files_found(image_folder):
    src = ImageFolder(image_folder)
    assert src.classes == ["cat", "dog", "emu"]
    assert src.class_to_idx == {"cat": 0, "dog": 1, "emu": 2}
    assert len(src) == 5 + 7 + 4  # .txt ignored, nested folders and .PNG found
    assert all(not p.endswith(".txt") for p in src.paths)
    assert src.labels == sorted(src.labels)
    data, label = src.read(0)
    assert isinstance(data, bytes) and label == 0
    assert describe(src, 3) == src.paths[3]


def test_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        ImageFolder(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no class folders"):
        ImageFolder(tmp_path)
    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    (tmp_path / "a" / "x.jpg").write_bytes(b"\xff\xd8\xff")
    with pytest.raises(FileNotFoundError, match="b"):
        ImageFolder(tmp_path)
    src = ImageFolder(tmp_path, allow_empty=True)
    assert src.classes == ["a", "b"] and len(src) == 1


def test_file_list():
    fl = FileList(["a.jpg", "b.png"], [3, 4])
    assert len(fl) == 2 and fl.labels == [3, 4] and fl.describe(1) == "b.png"
    assert FileList(["a.jpg"]).labels == [-1]
    with pytest.raises(ValueError, match="2 paths but 1 labels"):
        FileList(["a", "b"], [1])


def test_one_extension_or_path_is_not_taken_letter_by_letter(tmp_path):
    os.makedirs(tmp_path / "a")
    for name in ("x.jpg", "y.png", "notes.txt"):
        (tmp_path / "a" / name).write_bytes(b"\xff\xd8\xff")
    assert [os.path.basename(p) for p in ImageFolder(tmp_path, extensions=".png").paths] == ["y.png"]
    assert len(ImageFolder(tmp_path, extensions=[".png", ".JPG"])) == 2
    with pytest.raises(TypeError, match="extensions must be a string or a list of strings"):
        ImageFolder(tmp_path, extensions=[".png", 3])
    for one in ("a/x.jpg", b"a/x.jpg", tmp_path / "a" / "x.jpg"):
        with pytest.raises(TypeError, match="FileList: paths must be a list of paths, got one"):
            FileList(one)


def test_describe_falls_back_to_type_and_index():
    class Bare:
        def __len__(self):
            return 1

        def read(self, i):
            return b"", 0
    assert describe(Bare(), 0) == "Bare[0]"


def _tree_with_links(tmp_path, jpeg_blobs):
    """root/cat/{a.jpg, sub/b.jpg, loop -> cat, up -> root, sub/back -> sub,
    x_dup1 -> outside, x_dup2 -> outside, z_sub -> sub, far.jpg -> outside/c.jpg},
    root/dog/d.jpg, outside/c.jpg (outside the root)."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    for d in (root / "cat" / "sub", root / "dog", outside):
        os.makedirs(d)
    (root / "cat" / "a.jpg").write_bytes(jpeg_blobs[0])
    (root / "cat" / "sub" / "b.jpg").write_bytes(jpeg_blobs[1])
    (root / "dog" / "d.jpg").write_bytes(jpeg_blobs[2])
    (outside / "c.jpg").write_bytes(jpeg_blobs[3])
    os.symlink(root / "cat", root / "cat" / "loop")
    os.symlink(root, root / "cat" / "up")
    os.symlink(root / "cat" / "sub", root / "cat" / "sub" / "back")
    os.symlink(outside, root / "cat" / "x_dup1")
    os.symlink(outside, root / "cat" / "x_dup2")
    os.symlink(root / "cat" / "sub", root / "cat" / "z_sub")
    os.symlink(outside / "c.jpg", root / "cat" / "far.jpg")
    return root


def test_image_folder_lists_each_folder_once_through_links(tmp_path, jpeg_blobs):
    root = _tree_with_links(tmp_path, jpeg_blobs)
    src = ImageFolder(root)
    rel = [os.path.relpath(p, root) for p in src.paths]
    cat = os.path.join
    assert rel == [cat("cat", "a.jpg"), cat("cat", "far.jpg"), cat("cat", "sub", "b.jpg"),
                   cat("cat", "x_dup1", "c.jpg"), cat("dog", "d.jpg")]
    assert src.labels == [0, 0, 0, 0, 1]  # cat/up -> root is a loop: dog's image stays dog's
    assert [src.read(i)[0] for i in range(len(src))] == [jpeg_blobs[k] for k in (0, 3, 1, 3, 2)]


def test_image_folder_link_to_outside_data_dir(tmp_path, jpeg_blobs):
    data = tmp_path / "data" / "cats"
    os.makedirs(data / "more")
    (data / "1.jpg").write_bytes(jpeg_blobs[0])
    (data / "more" / "2.jpg").write_bytes(jpeg_blobs[1])
    root = tmp_path / "root"
    os.makedirs(root)
    os.symlink(data, root / "cat")  # the class folder itself is a link
    src = ImageFolder(root)
    assert [os.path.relpath(p, root) for p in src.paths] == [os.path.join("cat", "1.jpg"),
                                                             os.path.join("cat", "more", "2.jpg")]


@pytest.fixture(params=["extension", "python"])
def reader(request, monkeypatch):
    """Each read test runs both ways of reading a file: the extension's one call
    (where it is built) and the Python system calls."""
    from feeder import sources

    if request.param == "python":
        monkeypatch.setattr(sources, "_native_read", None)
    elif sources._native_read is None:
        pytest.skip("feeder's C extension is not built")
    return request.param


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 70_000])
def test_read_file_returns_the_whole_file(tmp_path, size, reader):
    p = tmp_path / "f.bin"
    data = os.urandom(size)
    p.write_bytes(data)
    assert _read_file(str(p)) == data


def test_read_file_reads_files_whose_size_lies(reader):
    # /proc files report size 0 but have content: read on to the end, as open().read().
    with open("/proc/self/mounts", "rb") as f:
        expected = f.read()
    assert expected and _read_file("/proc/self/mounts")[:64] == expected[:64]


def test_read_file_reads_a_pipe_to_its_end(tmp_path, reader):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    payload = os.urandom(200_000)  # more than a pipe holds: several reads

    def write() -> None:
        with open(p, "wb") as f:
            f.write(payload)

    # A daemon: if the read failed before opening the FIFO, the writer would wait
    # in open() forever, and a non-daemon thread would keep pytest from exiting.
    t = threading.Thread(target=write, name="test-fifo-writer", daemon=True)
    t.start()
    try:
        assert _read_file(str(p)) == payload
    finally:
        t.join(timeout=10)
    assert not t.is_alive()


def test_read_file_errors_name_the_file(tmp_path, reader):
    with pytest.raises(FileNotFoundError) as info:
        _read_file(str(tmp_path / "missing.jpg"))
    assert info.value.filename == str(tmp_path / "missing.jpg")
    (tmp_path / "dir.jpg").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        _read_file(str(tmp_path / "dir.jpg"))
    assert info.value.filename == str(tmp_path / "dir.jpg") and "dir.jpg" in str(info.value)


def test_read_file_reads_a_file_longer_than_fstat_said(tmp_path, monkeypatch):
    """The Python way (no extension): a file longer than its fstat said (it grew,
    or a file system that reports stale sizes) is read to its end."""
    from feeder import sources

    monkeypatch.setattr(sources, "_native_read", None)
    p = tmp_path / "grows.bin"
    data = os.urandom(10_000)
    p.write_bytes(data)
    real = os.fstat

    def stale(fd):
        st = real(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid,
                               100, st.st_atime, st.st_mtime, st.st_ctime))

    monkeypatch.setattr(os, "fstat", stale)
    assert _read_file(str(p)) == data
