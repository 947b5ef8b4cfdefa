"""DatasetSource: a map-style torch Dataset returning (image, target) as a source.
Pairs and torchvision-style dict targets, every decoded image kind, the errors
for other forms (naming the dataset's class, the sample and the field), both
engines, resume and skipping."""

from __future__ import annotations

import math
import os
import pickle
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, REPO_DIR, collect, collected
from feeder import (ConfigError, DatasetSource, Feeder, FieldError, SampleError, Source,
                    SourceError, check_sample, ops)

PIL = pytest.importorskip("PIL.Image", reason="Pillow is in the test extra (through matplotlib)")

H, W = 24, 32
N = 12


def pixels(i: int) -> np.ndarray:
    """Sample ``i``'s image: a horizontal ramp plus ``i``, so flips and indices show."""
    ramp = np.arange(W, dtype=np.uint8)[None, :, None] * 4
    return np.broadcast_to(ramp + np.uint8(i), (H, W, 3)).copy()


class Pairs(torch.utils.data.Dataset):
    """(image, class index), the image as ``kind`` says."""

    def __init__(self, kind: str = "numpy", n: int = N, fail_at: int | None = None) -> None:
        self.kind, self.n, self.fail_at = kind, n, fail_at
        self.calls: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.calls.append(i)
        if i == self.fail_at:
            raise OSError(f"sample {i} is unreadable")
        img = pixels(i)
        if self.kind == "pil":
            img = PIL.fromarray(img)
        elif self.kind == "tensor":
            img = torch.from_numpy(img).permute(2, 0, 1)  # CHW, as torchvision's
        elif self.kind == "bytes":
            from tests.support import encode_png
            img = encode_png(img)
        label = {"int": i % 3, "numpy": np.int64(i % 3), "tensor": torch.tensor(i % 3)}[
            "tensor" if self.kind == "tensor" else "numpy" if self.kind == "numpy" else "int"]
        return img, label


BOXES = [[2.0, 3.0, 10.0, 9.0], [20.0, 1.0, 30.0, 20.0]]


class Detection(torch.utils.data.Dataset):
    """torchvision-style targets, as CocoDetection wrapped for transforms v2 gives them."""

    def __init__(self, n: int = N, boxes=BOXES, tensor_id: bool = True) -> None:
        self.n, self.boxes, self.tensor_id = n, boxes, tensor_id

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        boxes = torch.tensor(self.boxes, dtype=torch.float32)
        target = {"boxes": boxes, "labels": torch.tensor([1, 2 + i % 2]),
                  "image_id": torch.tensor(100 + i) if self.tensor_id else 100 + i,
                  "area": (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]),
                  "iscrowd": torch.zeros(2, dtype=torch.int64)}
        return PIL.fromarray(pixels(i)), target


class Returns(torch.utils.data.Dataset):
    """Sample ``bad_at`` is ``bad``; the others (image, int)."""

    def __init__(self, bad, bad_at: int = 0, good=None) -> None:
        self.bad, self.bad_at, self.good = bad, bad_at, good

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        if i == self.bad_at:
            return self.bad
        return self.good if self.good is not None else (pixels(i), i % 3)


def feed(source, transforms=(), **options) -> Feeder:
    options.setdefault("timeout", JOIN_TIMEOUT_S)
    options.setdefault("image_size", (H, W))
    return Feeder(source, 4, list(transforms), **options)


# -- pairs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["pil", "numpy", "tensor", "bytes"])
def test_pairs_deliver_the_datasets_images_and_labels(kind):
    source = DatasetSource(Pairs(kind))
    assert isinstance(source, Source) and len(source) == N
    check_sample(source.read(5))
    with feed(source) as f:
        batches = collected(f, keep=lambda b: (b[0].numpy().copy(), b[1].numpy().copy()))
    images = np.concatenate([x for x, _ in batches])
    labels = np.concatenate([y for _, y in batches])
    assert labels.dtype == np.int64 and labels.tolist() == [i % 3 for i in range(N)]
    for i in range(N):
        np.testing.assert_array_equal(images[i].transpose(1, 2, 0), pixels(i))


@pytest.mark.parametrize("kind", ["int", "numpy", "tensor"])
def test_class_indices_of_every_kind_read_as_python_ints(kind):
    class Labels(Pairs):
        def __getitem__(self, i):
            label = {"int": 7, "numpy": np.int32(7), "tensor": torch.tensor(7)}[kind]
            return pixels(i), label

    image, label = DatasetSource(Labels()).read(0)
    assert type(label) is int and label == 7


def test_building_reads_only_the_first_sample():
    dataset = Pairs()
    source = DatasetSource(dataset)
    assert dataset.calls == [0] and len(source) == N
    assert DatasetSource(Pairs(n=0)) is not None  # nothing to read: nothing read


def test_describe_names_the_dataset_and_the_index():
    source = DatasetSource(Pairs())
    assert source.describe(3) == "Pairs[3]" and "Pairs" in repr(source)


# -- torchvision-style targets -------------------------------------------------------------------

def test_a_detection_target_becomes_feeders_fields():
    sample = DatasetSource(Detection()).read(1)
    check_sample(sample)
    assert set(sample) == {"image", "boxes", "box_labels", "box_area", "box_iscrowd", "image_id"}
    assert type(sample["image_id"]) is int and sample["image_id"] == 101
    assert isinstance(sample["boxes"], np.ndarray)
    np.testing.assert_array_equal(sample["boxes"], np.float32(BOXES))
    assert sample["box_labels"].tolist() == [1, 3]


def test_boxes_move_with_a_flip_and_targets_take_torchvisions_names():
    source = DatasetSource(Detection(tensor_id=False))
    with feed(source, [ops.RandomHorizontalFlip(p=1.0)]) as f:
        batch = next(iter(f))
        images, targets = batch.images_and_targets(rename={"box_*": "*"})
    flipped = [[W - x1, y0, W - x0, y1] for x0, y0, x1, y1 in BOXES]
    for k, (image, target) in enumerate(zip(images, targets)):
        assert set(target) == {"boxes", "labels", "area", "iscrowd", "image_id"}
        np.testing.assert_allclose(target["boxes"].numpy(), flipped)
        assert target["labels"].tolist() == [1, 2 + k % 2]
        assert type(target["image_id"]) is int and target["image_id"] == 100 + k
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), pixels(k)[:, ::-1])


@pytest.mark.parametrize("fmt, given", [
    ("xywh", [[2.0, 3.0, 8.0, 6.0], [20.0, 1.0, 10.0, 19.0]]),
    ("cxcywh", [[6.0, 6.0, 8.0, 6.0], [25.0, 10.5, 10.0, 19.0]]),
])
def test_other_box_formats_are_converted_to_xyxy(fmt, given):
    sample = DatasetSource(Detection(boxes=given), boxes_format=fmt).read(0)
    np.testing.assert_allclose(sample["boxes"], BOXES)


def test_integer_boxes_of_another_format_are_converted_too():
    class IntBoxes(Detection):
        def __getitem__(self, i):
            image, target = super().__getitem__(i)
            target["boxes"] = torch.tensor([[2, 3, 8, 6], [20, 1, 10, 19]])  # COCO's xywh, as ints
            return image, target

    sample = DatasetSource(IntBoxes(), boxes_format="xywh").read(0)
    np.testing.assert_allclose(sample["boxes"], BOXES)


def test_a_bounding_boxes_tensor_says_its_own_format():
    class Format:
        name = "XYWH"

    class BoundingBoxes(torch.Tensor):  # duck-typed as torchvision's tv_tensors.BoundingBoxes
        format = Format()

    class Wrapped(Detection):
        def __getitem__(self, i):
            image, target = super().__getitem__(i)
            target["boxes"] = torch.tensor([[2.0, 3.0, 8.0, 6.0]]).as_subclass(BoundingBoxes)
            target["labels"], target["area"], target["iscrowd"] = (
                torch.tensor([1]), torch.tensor([48.0]), torch.tensor([0]))
            return image, target

    np.testing.assert_allclose(DatasetSource(Wrapped()).read(0)["boxes"], [BOXES[0]])


# -- other forms: one-line errors naming the class, the sample and the field -----------------------

@pytest.mark.parametrize("bad, words", [
    ((pixels(0), 1, 2), ["Returns[0]", "tuple of 3 items"]),
    ((pixels(0), "cat"), ["Returns[0]", "field 'label'", "str"]),
    ((pixels(0), None), ["Returns[0]", "field 'label'", "NoneType"]),
    ((pixels(0), [{"bbox": [1, 2, 3, 4]}]), ["Returns[0]", "field 'label'", "list of dict",
                                              "wrap_dataset_for_transforms_v2"]),
    (("data/img.jpg", 1), ["Returns[0]", "field 'image'", "str"]),
    (pixels(0), ["Returns[0]", "numpy.ndarray", "not (image, target)"]),
    ((pixels(0), {"labels": torch.zeros(1), "masks": torch.zeros(1, H, W, dtype=torch.uint8)}),
     ["Returns[0]", "'masks'", "no \"boxes\""]),
])
def test_a_first_sample_of_another_form_is_refused_at_once(bad, words):
    with pytest.raises(SourceError) as info:
        DatasetSource(Returns(bad))
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("masks, words", [
    (torch.zeros(1, H, W), "uint8 or bool"),
    (torch.zeros(H, W, dtype=torch.uint8), "[N, H, W]"),
])
def test_malformed_per_instance_masks_are_refused_at_once(masks, words):
    with pytest.raises(FieldError) as info:
        DatasetSource(Returns((pixels(0), {"boxes": torch.zeros(1, 4), "masks": masks})))
    message = str(info.value)
    assert "Returns[0]" in message and "'masks'" in message and words in message, message


def test_a_float_image_is_refused_by_feeders_own_image_check():
    with pytest.raises(FieldError) as info:
        DatasetSource(Returns((pixels(0).astype(np.float32) / 255, 1)))
    message = str(info.value)
    assert info.value.field == "image" and "Returns[0]" in message and "float32" in message
    assert "uint8" in message and "\n" not in message


def test_a_later_sample_of_another_form_fails_naming_it():
    dict_sample = (pixels(0), {"image_id": 1})
    source = DatasetSource(Returns([pixels(0), [1, 2]], bad_at=5, good=dict_sample))
    with feed(source, ordered=True) as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and err.index == 5, err
    message = str(err)
    assert "Returns[5]" in message and "list" in message and "dict" in message
    assert "\n" not in message


def test_a_later_float_image_fails_naming_the_sample_and_field():
    source = DatasetSource(Returns((pixels(3).astype(np.float32), 1), bad_at=3))
    with feed(source) as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and err.index == 3 and err.field == "image", err
    assert "Returns[3]" in str(err)


class OneBoxAtTwo(torch.utils.data.Dataset):
    """Sample 2 has one box, the others two; ``extra`` a per-box field outside per_box."""

    def __init__(self, extra: str = "box_labels") -> None:
        self.extra = extra

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        n = 1 if i == 2 else 2
        boxes = torch.tensor(BOXES[:n], dtype=torch.float32)
        return PIL.fromarray(pixels(i)), {"boxes": boxes, self.extra: torch.arange(n) + 1}


def test_a_per_box_field_of_one_box_stays_a_row_per_box():
    # One box: its one-element box_labels is a row of one, not a Python int.
    assert DatasetSource(OneBoxAtTwo()).read(2)["box_labels"].tolist() == [1]
    with feed(DatasetSource(OneBoxAtTwo()), []) as f:
        got = [b["box_labels"] for b in f]
    assert [t.tolist() for batch in got for t in batch] == [[1, 2], [1, 2], [1], [1, 2]]


def test_a_per_box_field_left_out_of_per_box_says_how_to_declare_it():
    with feed(DatasetSource(OneBoxAtTwo("difficult")), []) as f:
        with pytest.raises(SampleError, match=r"'difficult'.*as many entries as the sample has "
                                              r"boxes.*named 'box_difficult'.*per_box=\[\.\.\.\]"):
            list(f)


def test_one_per_box_field_name_is_one_field():
    # "labels" is the field labels, not the fields l, a, b, e and s: its entries
    # move and are filtered with the boxes.
    sample = DatasetSource(Detection(), per_box="labels").read(1)
    assert {"boxes", "box_labels", "area", "iscrowd"} <= set(sample)
    with pytest.raises(TypeError, match="per_box must be a string or a list of strings"):
        DatasetSource(Detection(), per_box=["labels", None])


def test_not_a_dataset_and_an_unknown_box_format_are_refused():
    with pytest.raises(TypeError, match="object has no __len__ and __getitem__"):
        DatasetSource(object())
    with pytest.raises(ValueError, match="boxes_format='yxyx'"):
        DatasetSource(Detection(), boxes_format="yxyx")


# -- the feeder's promises hold as for any source --------------------------------------------------

def test_feeder_dataset_reads_through_the_adapter():
    with feed(DatasetSource(Pairs("pil"))) as f:
        image, label = f.dataset[4]
        assert len(f.dataset) == N and label == 1
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), pixels(4))


@pytest.mark.timeout(JOIN_TIMEOUT_S * 4)  # a spawned worker imports torch
def test_the_process_engine_delivers_the_thread_engines_batches():
    keep = lambda b: (b["image"].numpy().copy(), [t.numpy().copy() for t in b["boxes"]],  # noqa: E731
                      b["image_id"].tolist())
    results = []
    for options in ({}, {"isolation": "process", "start_method": "spawn"}):
        with feed(DatasetSource(Detection()), [ops.RandomHorizontalFlip()], seed=3,
                  shuffle=True, **options) as f:
            results.append(collected(f, keep=keep, timeout=JOIN_TIMEOUT_S * 3))
    (thread, process) = results
    assert len(thread) == len(process) == N // 4
    for (x, bx, ix), (y, by, iy) in zip(thread, process):
        np.testing.assert_array_equal(x, y)
        assert ix == iy
        for a, b in zip(bx, by):
            np.testing.assert_array_equal(a, b)


class Unpicklable(Pairs):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()  # a handle no process can be sent


def test_a_dataset_that_cannot_be_pickled_is_a_clear_error_under_spawn():
    source = DatasetSource(Unpicklable())
    with pytest.raises(TypeError):
        pickle.dumps(source)
    with pytest.raises(ConfigError) as info:
        feed(source, isolation="process", start_method="spawn")
    message = str(info.value)
    assert "DatasetSource(Unpicklable" in message and "cannot be pickled" in message
    assert "start_method='fork'" in message


def test_resume_continues_exactly():
    make = lambda: feed(DatasetSource(Pairs("pil", n=24)),  # noqa: E731
                        [ops.RandomResizedCrop(16), ops.RandomHorizontalFlip()],
                        seed=9, shuffle=True, ordered=True, image_size=None)
    keep = lambda b: (b[0].numpy().copy(), b[1].numpy().copy())  # noqa: E731
    with make() as f:
        whole = collected(f, keep=keep)
    with make() as f:
        first = collected(f, keep=keep, limit=2)
        state = pickle.loads(pickle.dumps(f.state_dict()))
    with make() as f:
        f.load_state_dict(state)
        rest = collected(f, keep=keep)
    assert len(first) + len(rest) == len(whole) == 6
    for (x, y), (wx, wy) in zip(first + rest, whole):
        np.testing.assert_array_equal(x, wx)
        np.testing.assert_array_equal(y, wy)


def test_a_failing_getitem_is_skipped_and_counted():
    source = DatasetSource(Pairs("pil", fail_at=6))
    with feed(source, on_error="skip") as f:
        batches = collected(f, keep=lambda b: b[1].numpy().copy())
        assert f.stats().skipped == 1
    labels = np.concatenate(batches).tolist()
    assert len(labels) == N - 1
    assert sorted(labels) == sorted(i % 3 for i in range(N) if i != 6)


def test_a_failing_getitem_names_the_dataset_under_raise():
    with feed(DatasetSource(Pairs("pil", fail_at=6))) as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and err.index == 6 and "Pairs[6]" in str(err), err
    assert isinstance(err.__cause__, OSError)


# -- the example -----------------------------------------------------------------------------------

@pytest.mark.timeout(300)  # a training run in a child process, on a possibly busy machine
def test_the_own_dataset_example_trains(tmp_path):
    root = REPO_DIR
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "own_dataset.py"),
                          "--epochs", "2", "--images", "32", "--batch-size", "8", "--device", "cpu"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out.stdout
    assert "32 images, 4 classes" in out.stdout
