"""Sources: ImageFolder's torchvision conventions, FileList."""

from __future__ import annotations

import os

import pytest

from feeder import FileList, ImageFolder
from feeder.sources import describe


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


def test_describe_falls_back_to_type_and_index():
    class Bare:
        def __len__(self):
            return 1

        def read(self, i):
            return b"", 0
    assert describe(Bare(), 0) == "Bare[0]"
