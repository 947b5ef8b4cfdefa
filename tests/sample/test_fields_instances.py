"""Per-instance masks ``[N, H, W]`` and keypoints ``[N, K, 3]`` (torchvision's
``masks`` and ``keypoints``): moved with their image by every geometric transform,
filtered with their boxes, batched as lists, and equal to what torchvision's
detection reference computes for the same draw (its transforms re-implemented in
``tests/support/instances.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support import collect, collected
from feeder import ConfigError, DatasetSource, Feeder, SampleError, ops
from tests.support.fields import DictSource
from tests.support.instances import COCO_FLIP, flipped, instance_sample, ref_hflip, ref_resize

FLIP = ops.RandomHorizontalFlip(0.5, keypoint_flip=ops.COCO_PERSON_KEYPOINT_FLIP)
SIZE = (60, 80)
MULTISCALE = (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)  # the reference's


class Instances:
    """``n`` samples of :func:`instance_sample` (module level: a worker process
    started by "spawn" gets it pickled)."""

    def __init__(self, n: int, size: tuple[int, int], kw: dict) -> None:
        self.n, self.size, self.kw = n, size, kw

    def __len__(self) -> int:
        return self.n

    def read(self, index: int) -> dict:
        return instance_sample(index, self.size, **self.kw)

    def describe(self, index: int) -> str:
        return f"instances://{index}"


def source(n: int = 12, size=SIZE, **kw) -> Instances:
    return Instances(n, size, kw)


def compare_with_reference(feeder, src) -> tuple[float, float, float]:
    """Every delivered sample against the reference's transforms for its draw (its
    size, its flip); returns (share of equal mask pixels, largest box and keypoint
    differences), after checking the keypoints' visibility agrees."""
    equal = total = 0
    box_err = kp_err = 0.0
    for batch in collected(feeder):
        images, targets = batch.images_and_targets()
        for image, target in zip(images, targets):
            sample = src.read(target["image_id"])
            ref = {k: sample[k] for k in ("boxes", "masks", "keypoints")}
            h, w = image.shape[1:]
            if (h, w) != sample["image"].shape[:2]:
                ref = ref_resize(ref, sample["image"].shape[:2], (h, w))
            if flipped(image):
                ref = ref_hflip(ref, w, COCO_FLIP)
            masks = target["masks"]
            assert masks.dtype == torch.uint8 and masks.shape == ref["masks"].shape
            equal += int((masks.numpy() == ref["masks"]).sum())
            total += masks.numel()
            box_err = max(box_err, float(np.abs(target["boxes"].numpy() - ref["boxes"]).max()))
            kp = target["keypoints"].numpy()
            assert kp.shape == ref["keypoints"].shape and kp.dtype == np.float32
            assert ((kp[..., 2] > 0) == (ref["keypoints"][..., 2] > 0)).all()
            kp_err = max(kp_err, float(np.abs(kp[..., :2] - ref["keypoints"][..., :2]).max()))
    return equal / total, box_err, kp_err


@pytest.mark.timeout(240)
@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize("preset", ["hflip", "multiscale"])
def test_masks_and_keypoints_match_the_detection_reference(preset, isolation):
    """The presets at COCO's image size (480 x 640), the multiscale one with the
    reference's sizes."""
    src = source(8, size=(480, 640))
    transforms = [FLIP] if preset == "hflip" else [ops.RandomShortestSize(MULTISCALE, 1333), FLIP]
    with Feeder(src, 4, transforms, max_image_size=(1333, 1333), size_divisibility=32, seed=3,
                isolation=isolation) as f:
        agreement, box_err, kp_err = compare_with_reference(f, src)
    if preset == "hflip":
        assert agreement == 1.0 and box_err == 0.0 and kp_err == 0.0
    else:
        # The reference's tensor resize samples masks at floor(j * in / out), feeder at
        # pixel centres (as it samples the image): they part on a band of boundary
        # pixels up to half a source pixel wide.
        assert agreement >= 0.999, agreement
        assert box_err < 1e-3 and kp_err <= 1.0, (box_err, kp_err)


def test_a_flip_swaps_left_and_right_keypoints_exactly():
    src = source(8)
    flip = ops.RandomHorizontalFlip(1.0, keypoint_flip=ops.COCO_PERSON_KEYPOINT_FLIP)
    with Feeder(src, 4, [flip], max_image_size=SIZE, shuffle=False) as f:
        for batch in collected(f):
            for k, points in enumerate(batch["keypoints"]):
                given = src.read(int(batch["image_id"][k]))["keypoints"]
                expect = given[:, COCO_FLIP].copy()
                expect[..., 0] = SIZE[1] - expect[..., 0]
                expect[expect[..., 2] == 0] = 0
                assert np.array_equal(points.numpy(), expect)
                # The left eye (1) is where the right one (2) was, mirrored.
                seen = given[:, 2, 2] > 0
                assert np.allclose(points.numpy()[seen, 1, 0], SIZE[1] - given[seen, 2, 0])


@pytest.mark.parametrize("transforms", [
    [ops.RandomCrop(40), FLIP],
    [ops.RandomZoomOut(side_range=(1.0, 2.0), p=1.0), ops.RandomIoUCrop(), FLIP],
    [ops.ScaleJitter((64, 64), (0.5, 1.5)), ops.RandomCrop(48, pad_if_needed=True), FLIP],
], ids=["crop", "zoom-out-iou-crop", "scale-jitter-crop"])
def test_a_crop_filters_masks_and_keypoints_with_their_boxes(transforms):
    src = source(12, size=(96, 128), count=(4, 8))
    variable = {"max_image_size": (256, 256)} if len(transforms) == 3 and transforms[1].output_size is None else {}
    with Feeder(src, 4, transforms, seed=1, **variable) as f:
        batches = collected(f)
    dropped = cleared = 0
    for batch in batches:
        hb, wb = batch["image"].shape[2:]
        sizes = batch["size"].tolist() if variable else [(hb, wb)] * len(batch["boxes"])
        for k, (boxes, masks, points, (h, w)) in enumerate(zip(
                batch["boxes"], batch["masks"], batch["keypoints"], sizes)):
            given = src.read(int(batch["image_id"][k]))
            dropped += len(given["boxes"]) - len(boxes)
            assert masks.shape == (len(boxes), hb, wb) and points.shape == (len(boxes), 17, 3)
            assert int(masks.numpy().max(initial=0)) <= 1  # 0 in any padding, never the mask fill
            for box, mask, pts in zip(boxes, masks, points):
                ys, xs = torch.nonzero(mask, as_tuple=True)
                if len(ys):  # the mask lies within its (clipped) box
                    assert box[0] - 1 <= xs.min() and xs.max() <= box[2]
                    assert box[1] - 1 <= ys.min() and ys.max() <= box[3]
                seen = pts[:, 2] > 0
                assert ((pts[seen, 0] >= 0) & (pts[seen, 0] <= w)).all()
                assert ((pts[seen, 1] >= 0) & (pts[seen, 1] <= h)).all()
                assert (pts[~seen] == 0).all()
            cleared += int((given["keypoints"][..., 2] > 0).sum()) - int((points[..., 2] > 0).sum())
    assert dropped > 0 and cleared > 0  # the crop did leave boxes and keypoints out


def test_padded_batches_pad_masks_and_targets_cut_them():
    src = DictSource(8, lambda i: instance_sample(i, (40 + 4 * i, 50)))
    with Feeder(src, 4, [], max_image_size=(80, 64), size_divisibility=16, shuffle=False) as f:
        for batch in collected(f):
            hb, wb = batch["image"].shape[2:]
            images, targets = batch.images_and_targets()
            for masks, image, target, (h, w) in zip(batch["masks"], images, targets,
                                                     batch["size"].tolist()):
                assert masks.shape[1:] == (hb, wb) and masks.dtype == torch.uint8
                assert not masks[:, h:].any() and not masks[:, :, w:].any()
                given = src.read(target["image_id"])["masks"]
                assert np.array_equal(target["masks"].numpy(), given)
                assert target["masks"].shape[1:] == image.shape[1:]


def test_dataset_source_passes_torchvision_s_masks_and_keypoints():
    class Dataset:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            s = instance_sample(i, SIZE)
            return s["image"], {"boxes": torch.from_numpy(s["boxes"]),
                                "labels": torch.from_numpy(s["box_labels"]),
                                "masks": torch.from_numpy(s["masks"]).bool(),
                                "keypoints": torch.from_numpy(s["keypoints"]), "image_id": i}
    flip = ops.RandomHorizontalFlip(1.0, keypoint_flip=ops.COCO_PERSON_KEYPOINT_FLIP)
    with Feeder(DatasetSource(Dataset()), 2, [flip], max_image_size=SIZE, shuffle=False) as f:
        for batch in collected(f):
            _, targets = batch.images_and_targets(rename={"box_labels": "labels"})
            for t in targets:
                ref = ref_hflip({k: v for k, v in instance_sample(t["image_id"], SIZE).items()},
                                SIZE[1])
                assert np.array_equal(t["masks"].numpy(), ref["masks"])
                assert np.array_equal(t["keypoints"].numpy(), ref["keypoints"])


def sample_with(i: int, **change) -> dict:
    s = instance_sample(i, SIZE)
    s.update(change)
    return {k: v for k, v in s.items() if v is not None}


@pytest.mark.parametrize("change, field, words", [
    ({"masks": np.zeros(SIZE, np.uint8)}, "masks", "goes under \"mask\""),
    ({"masks": np.zeros((1, *SIZE), np.float32)}, "masks", "uint8 or bool"),
    ({"masks": np.zeros((9, *SIZE), np.uint8)}, "masks", "boxes"),
    ({"masks": np.full((1, *SIZE), 255, np.uint8)}, "masks", "0/1 per pixel"),
    ({"keypoints": np.zeros((1, 17), np.float32)}, "keypoints", "[N, K, 3]"),
    ({"boxes": None, "box_labels": None, "keypoints": None}, "masks",
     "field 'masks' is a per-box field without \"boxes\""),
])
def test_malformed_instances_are_their_sample_s_error(change, field, words):
    src = DictSource(4, lambda i: sample_with(i, **change) if i == 1 else instance_sample(i, SIZE))
    with Feeder(src, 2, [], max_image_size=SIZE, shuffle=False, decode_threads=1) as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and err.index == 1 and err.field == field, repr(err)
    assert words in str(err) and "dict://1" in str(err)


def test_masks_of_another_size_than_their_image_are_refused():
    src = DictSource(2, lambda i: sample_with(i, masks=np.zeros((len(instance_sample(i, SIZE)["boxes"]),
                                                                  30, 80), np.uint8)))
    with Feeder(src, 2, [], max_image_size=SIZE, decode_threads=1) as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and err.field == "masks" and "(30, 80) (height, width)" in str(err), repr(err)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_masks_beyond_the_memory_bound_are_refused_naming_the_sample(isolation):
    """One sample's masks hold at most max_pixels bytes, as given and as resized."""
    src = source(4, count=(3, 3))
    with Feeder(src, 2, [], max_image_size=SIZE, max_pixels=2 * SIZE[0] * SIZE[1],
                isolation=isolation, shuffle=False) as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and err.field == "masks" and err.index == 0, repr(err)
    assert "3 masks of (60, 80) (height, width)" in str(err) and "max_pixels" in str(err)
    with Feeder(source(4, count=(2, 2)), 2, [ops.Resize((80, 100))], max_pixels=12000,
                isolation=isolation, shuffle=False) as f:
        _, err = collect(f)  # 2 x 60 x 80 given, 2 x 80 x 100 once resized
    assert isinstance(err, SampleError) and err.field == "masks", repr(err)
    assert "2 masks of (80, 100) (height, width)" in str(err)


def test_a_flip_without_a_keypoint_map_refuses_samples_with_keypoints():
    with Feeder(source(4), 2, [ops.RandomHorizontalFlip(0.0)], max_image_size=SIZE) as f:
        _, err = collect(f)
    assert isinstance(err.__cause__ if isinstance(err, SampleError) else err, ConfigError), repr(err)
    assert "keypoint_flip" in str(err) and "COCO_PERSON_KEYPOINT_FLIP" in str(err)
    # Without keypoints, the same flip is fine.
    src = DictSource(4, lambda i: sample_with(i, keypoints=None))
    with Feeder(src, 2, [ops.RandomHorizontalFlip(1.0)], max_image_size=SIZE) as f:
        assert len(collected(f)) == 2


@pytest.mark.parametrize("flip_map, words", [
    ([0, 1, 1], "each of 0..K-1 once"),
    ([1, 2, 0], "in pairs"),
    ("0 2 1", "sequence"),
])
def test_keypoint_flip_maps_are_checked_at_construction(flip_map, words):
    with pytest.raises(ValueError, match="keypoint_flip") as info:
        ops.RandomHorizontalFlip(keypoint_flip=flip_map)
    assert words in str(info.value)


def test_a_keypoint_map_of_another_length_is_a_configuration_error():
    flip = ops.RandomHorizontalFlip(1.0, keypoint_flip=[1, 0])
    with Feeder(source(4), 2, [flip], max_image_size=SIZE) as f:
        _, err = collect(f)
    assert "17 keypoints" in str(err) and "2 entries" in str(err), repr(err)


def test_rotations_move_masks_and_keypoints_with_the_image():
    """TrivialAugmentWide's rotations and shears warp the fields themselves."""
    src = source(16, size=(64, 64))
    with Feeder(src, 4, [ops.TrivialAugmentWide()], max_image_size=(64, 64), seed=5) as f:
        for batch in collected(f):
            for boxes, masks, points in zip(batch["boxes"], batch["masks"], batch["keypoints"]):
                assert len(masks) == len(points) == len(boxes)
                assert masks.shape[1:] == (64, 64)
                seen = points[..., 2] > 0
                assert (points[seen][:, :2] >= 0).all() and (points[seen][:, :2] <= 64).all()


def test_packing_with_max_side_resizes_masks_and_scales_keypoints():
    import io

    import cv2

    from feeder.storage.packsample import sample_members

    def make(i):
        s = instance_sample(i, (120, 160))
        ok, png = cv2.imencode(".png", s["image"])
        return {**s, "image": png.tobytes()}
    members, status = sample_members(DictSource(1, make), 0, max_side=80)
    assert status == "reencoded"
    got = {ext: np.load(io.BytesIO(data)) for ext, data in members if ext.endswith(".npy")}
    given = instance_sample(0, (120, 160))
    assert np.array_equal(got["masks.npy"], given["masks"][:, 1::2, 1::2])  # the centres' pixels
    assert np.allclose(got["keypoints.npy"], given["keypoints"] * np.array([0.5, 0.5, 1], np.float32))
    assert np.allclose(got["boxes.npy"], given["boxes"] * 0.5)


def test_a_sample_transform_gets_instances_in_step_and_is_checked():
    """A user's vertical flip moves masks and keypoints itself; masks of another
    size than its image are its error."""
    @ops.SampleTransform
    def vflip(sample, rng):
        h = sample["image"].shape[0]
        out = dict(sample, image=np.ascontiguousarray(sample["image"][::-1]),
                   masks=np.ascontiguousarray(sample["masks"][:, ::-1]))
        boxes = sample["boxes"].copy()
        boxes[:, [1, 3]] = h - sample["boxes"][:, [3, 1]]
        points = sample["keypoints"].copy()
        points[..., 1] = np.where(points[..., 2] > 0, h - points[..., 1], 0)
        return dict(out, boxes=boxes, keypoints=points)
    src = source(4)
    with Feeder(src, 4, [ops.Resize((30, 40)), vflip], shuffle=False) as f:
        (batch,) = collected(f)
    for k, masks in enumerate(batch["masks"]):
        given = src.read(k)["masks"]
        assert np.array_equal(masks.numpy(), given[:, 1::2, 1::2][:, ::-1])

    @ops.SampleTransform
    def crop_image_only(sample, rng):
        return dict(sample, image=np.ascontiguousarray(sample["image"][:20]))
    with Feeder(src, 4, [crop_image_only, ops.Resize((30, 40))]) as f:
        _, err = collect(f)
    assert isinstance(err, SampleError) and err.field == "masks", repr(err)
    assert "not the image's size" in str(err)


def test_mixing_batch_transforms_refuse_instances():
    kinds = {"boxes": "boxes", "masks": "instance masks", "keypoints": "keypoints"}
    with pytest.raises(ValueError) as info:
        ops.CutMix(1.0, num_classes=3).check_fields(kinds)
    assert "'masks'" in str(info.value) and "'keypoints'" in str(info.value)
