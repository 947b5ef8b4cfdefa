"""feeder.synthetic: deterministic photograph-like images, image folders, and the
segmentation and detection sets whose masks and boxes follow the image content."""

from __future__ import annotations

import os

import numpy as np
import pytest
import simplejpeg

from feeder import ImageFolder
from feeder.synthetic import (CLASS_COLORS, make_detection_sample, make_detection_set, make_image,
                              make_image_folder, make_segmentation_sample, make_segmentation_set)


def test_make_image_is_deterministic_from_its_seed():
    a = make_image(48, 64, seed=7)
    assert a.shape == (48, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, make_image(48, 64, seed=7))
    assert not np.array_equal(a, make_image(48, 64, seed=8))


def test_make_image_is_neither_flat_nor_noise():
    """Its JPEG costs about what a photograph's does: between a flat image's and noise's."""
    img = make_image(128, 128, seed=1)
    size = len(simplejpeg.encode_jpeg(img, quality=90, colorspace="RGB"))
    flat = len(simplejpeg.encode_jpeg(np.full_like(img, 128), quality=90, colorspace="RGB"))
    noise = np.random.default_rng(0).integers(0, 256, img.shape, dtype=np.uint8)
    noisy = len(simplejpeg.encode_jpeg(noise, quality=90, colorspace="RGB"))
    assert 4 * flat < size < noisy / 2
    assert img.std() > 20  # not one colour


def test_make_image_folder_is_an_image_folder(tmp_path):
    paths = make_image_folder(tmp_path / "d", classes=2, per_class=3, size_range=(20, 30), seed=4)
    assert len(paths) == 6 and all(os.path.isfile(p) for p in paths)
    folder = ImageFolder(str(tmp_path / "d"))
    assert folder.classes == ["class_00", "class_01"] and len(folder) == 6
    for p in paths:
        h, w, _ = simplejpeg.decode_jpeg(open(p, "rb").read()).shape
        assert 20 <= h <= 30 and 20 <= w <= 30
    again = make_image_folder(tmp_path / "e", classes=2, per_class=3, size_range=(20, 30), seed=4)
    assert [open(a, "rb").read() for a in paths] == [open(b, "rb").read() for b in again]


@pytest.mark.parametrize("make, classes", [(make_segmentation_sample, 1),
                                           (make_segmentation_sample, len(CLASS_COLORS) + 1),
                                           (make_detection_sample, 0),
                                           (make_detection_sample, len(CLASS_COLORS))])
def test_a_class_count_out_of_range_is_refused(make, classes):
    with pytest.raises(ValueError, match="classes must be in"):
        make(32, 32, seed=0, classes=classes)


def test_segmentation_masks_follow_the_image_content():
    img, mask = make_segmentation_sample(120, 150, seed=3, classes=4)
    assert img.shape == (120, 150, 3) and mask.shape == (120, 150) and mask.dtype == np.uint8
    assert set(np.unique(mask)) - {0} and set(np.unique(mask)) <= {0, 1, 2, 3}
    for c in set(np.unique(mask).tolist()) - {0}:
        mean = img[mask == c].astype(float).mean(axis=0)
        assert np.abs(mean - np.array(CLASS_COLORS[c]) * 0.95).max() < 40, (c, mean)
    gray = img[mask == 0].astype(float)
    assert np.abs(gray - gray.mean(axis=1, keepdims=True)).mean() < 20  # the background is grayish
    again = make_segmentation_sample(120, 150, seed=3, classes=4)
    assert np.array_equal(again[0], img) and np.array_equal(again[1], mask)


def test_detection_boxes_hold_their_rectangles():
    img, boxes, labels = make_detection_sample(128, 160, seed=5, classes=3)
    assert boxes.dtype == np.float32 and boxes.shape == (len(labels), 4) and len(labels) >= 1
    for (x0, y0, x1, y1), c in zip(boxes.astype(int), labels):
        inside = img[y0:y1, x0:x1].astype(float).reshape(-1, 3).mean(axis=0)
        assert np.abs(inside - np.array(CLASS_COLORS[c + 1]) * 0.95).max() < 40
        color = np.array(CLASS_COLORS[c + 1]) * 0.95
        for outside in (img[y0:y1, x0 - 1] if x0 > 0 else None, img[y0:y1, x1] if x1 < 160 else None,
                        img[y0 - 1, x0:x1] if y0 > 0 else None, img[y1, x0:x1] if y1 < 128 else None):
            if outside is not None:  # the box is tight: the pixels just outside are not its colour
                assert np.abs(outside.astype(float).mean(axis=0) - color).max() > 40


def test_the_sets_are_written_as_files(tmp_path):
    pairs = make_segmentation_set(tmp_path / "seg", count=3, size_range=(40, 50), seed=1)
    assert all(os.path.isfile(a) and os.path.isfile(b) and b.endswith(".png") for a, b in pairs)
    records = make_detection_set(tmp_path / "det", count=3, size_range=(40, 50), seed=1)
    assert os.path.isfile(tmp_path / "det" / "annotations.json")
    assert all(len(r["boxes"]) == len(r["labels"]) for r in records)
