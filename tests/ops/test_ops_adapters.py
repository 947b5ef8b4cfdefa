"""The adapters (#24): ops.Albumentations (per sample, seeded from the sample's
stream, one Compose copy per thread, masks and boxes) and ops.Kornia (per batch,
on the device); both optional extras, skipped when not installed."""

from __future__ import annotations

import threading

import cv2

import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, run_in_thread
from feeder import ConfigError, Feeder, FeederError, SampleError, ops
from feeder.sample.rng import SampleRNG
from feeder.sample import Geometry
from tests.support.fields import DictSource, rgb_png

A = pytest.importorskip("albumentations")


def drain(feeder, timeout: float = JOIN_TIMEOUT_S) -> list:
    """Every batch of one pass (dicts or pairs), with a timeout (a hang fails the test)."""
    return run_in_thread(lambda: list(feeder), timeout)


def photo(h, w, seed=0):
    r = np.random.default_rng(seed)
    return r.integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_albumentations_is_seeded_from_the_sample_stream():
    compose = A.Compose([A.RandomCrop(20, 24), A.HorizontalFlip(p=0.5),
                         A.RandomBrightnessContrast(p=1.0)])
    t = ops.Albumentations(compose, output_size=(20, 24))
    img = photo(40, 50)
    outs = [t.apply(img, SampleRNG(k)) for k in range(6)]
    assert all(np.array_equal(t.apply(img, SampleRNG(k)), outs[k]) for k in range(6))
    assert len({o.tobytes() for o in outs}) == 6
    # The documented seeding: the Compose's own seed, drawn from the sample's stream.
    ref = A.Compose([A.RandomCrop(20, 24), A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=1.0)])
    ref.set_random_seed(SampleRNG(3).integers(0, 1 << 32))
    assert np.array_equal(ref(image=img)["image"], outs[3])


def test_albumentations_keeps_one_compose_per_thread():
    t = ops.Albumentations(A.Compose([A.HorizontalFlip()]))
    seen = []
    barrier = threading.Barrier(2, timeout=10)

    def run():
        t.apply(photo(8, 8), SampleRNG(0))
        barrier.wait()
        seen.append(t._local.compose)
    threads = [threading.Thread(target=run) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert len(seen) == 2 and seen[0] is not seen[1] and t.compose not in seen


def test_albumentations_moves_masks_and_boxes_and_the_per_box_fields():
    compose = A.Compose([A.HorizontalFlip(p=1.0), A.Crop(0, 0, 30, 20)],
                        bbox_params=A.BboxParams(format="pascal_voc"))
    t = ops.Albumentations(compose, output_size=(20, 30))
    img = photo(20, 40)
    mask = np.tile(np.arange(40, dtype=np.uint8), (20, 1))
    boxes = np.array([[0, 0, 10, 10], [30, 5, 38, 15], [12, 2, 12, 8]], np.float32)  # last: no area
    fields = {"mask": mask, "boxes": boxes, "box_labels": np.array([7, 8, 9])}
    out, moved, geometry = t.apply_fields(img, SampleRNG(0), fields, Geometry.identity(20, 40))
    assert out.shape == (20, 30, 3) and np.array_equal(out, img[:, ::-1][:, :30])
    assert np.array_equal(moved["mask"], mask[:, ::-1][:, :30])
    # Flipped: [0, 10] -> [30, 40] (cut off by the crop), [30, 38] -> [2, 10].
    assert moved["box_labels"].tolist() == [8]
    assert np.allclose(moved["boxes"], [[2, 5, 10, 15]])
    assert (geometry.height, geometry.width) == (20, 30)


def test_albumentations_through_the_feeder_is_deterministic_across_threads():
    def make(i):
        img = photo(40 + i % 3, 48, seed=i)
        return {"image": rgb_png(img), "mask": (img[..., 0] // 64).astype(np.uint8),
                "boxes": np.array([[4, 4, 30, 30]], np.float32), "box_labels": np.array([i])}
    aug = [ops.Albumentations(A.Compose([A.RandomCrop(32, 32), A.HorizontalFlip(), A.Rotate(limit=20)],
                                        bbox_params=A.BboxParams(format="pascal_voc")),
                              output_size=32)]

    def run(threads):
        return drain(Feeder(DictSource(12, make), 4, aug, seed=1, decode_threads=threads, shuffle=True))
    one, three = run(1), run(3)
    assert len(one) == 3
    for a, b in zip(one, three):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"])
        assert all(torch.equal(x, y) for x, y in zip(a["boxes"], b["boxes"]))


def test_albumentations_refuses_boxes_without_pascal_voc_bbox_params():
    img = photo(10, 10)
    fields = {"boxes": np.array([[1, 1, 5, 5]], np.float32)}
    with pytest.raises(ValueError, match="bbox_params=A.BboxParams\\(format='pascal_voc'\\)"):
        ops.Albumentations(A.Compose([A.HorizontalFlip()])).apply_fields(
            img, SampleRNG(0), fields, Geometry.identity(10, 10))
    with pytest.raises(ValueError, match="not 'coco'"):
        ops.Albumentations(A.Compose([A.HorizontalFlip()], bbox_params=A.BboxParams(format="coco"))
                           ).apply_fields(img, SampleRNG(0), fields, Geometry.identity(10, 10))


def test_albumentations_refuses_what_it_cannot_seed():
    with pytest.raises(TypeError, match="cannot be seeded per sample"):
        ops.Albumentations(lambda image: {"image": image})
    with pytest.raises(TypeError, match="is not callable"):
        ops.Albumentations(42)


def test_albumentations_size_says_whether_the_chain_needs_a_fixed_size_transform():
    assert ops.Albumentations(A.Compose([A.RandomBrightnessContrast()])).preserves_size
    assert not ops.Albumentations(A.Compose([A.HorizontalFlip()])).preserves_size
    assert ops.Albumentations(A.Compose([A.RandomCrop(8, 8)]), output_size=8).output_size == (8, 8)


# -- kornia --------------------------------------------------------------------------

def test_kornia_runs_per_batch_seeded_and_restores_the_global_generator(source):
    K = pytest.importorskip("kornia.augmentation")
    aug = [ops.RandomResizedCrop(24)]

    def run():
        f = Feeder(source, 4, aug, dtype=torch.float32, normalize=((0, 0, 0), (255, 255, 255)),
                   seed=4, batch_transforms=[ops.Kornia(K.ColorJiggle(0.3, 0.3, 0.3, 0.05, p=1.0))])
        return [b[0] for b in drain(f)]

    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = run(), run()
    assert torch.equal(torch.get_rng_state(), before)  # the fork was restored
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    plain = [b[0] for b in drain(Feeder(source, 4, aug, dtype=torch.float32, seed=4,
                                        normalize=((0, 0, 0), (255, 255, 255))))]
    assert not all(torch.equal(x, y) for x, y in zip(a, plain))


def test_kornia_refuses_batches_with_masks():
    pytest.importorskip("kornia")
    t = ops.Kornia(torch.nn.Identity())
    with pytest.raises(ValueError, match="Kornia moves the images only.*\\['mask'\\]"):
        t.check_fields({"mask": "mask", "id": "numeric"})
    with pytest.raises(TypeError, match="is not callable"):
        ops.Kornia(3)


def test_a_chain_of_unknown_size_names_albumentations_output_size(source):
    with pytest.raises(ValueError, match="declares it with output_size=\\(h, w\\)"):
        Feeder(source, 4, [ops.Albumentations(A.Compose([A.HorizontalFlip()]))])


def test_the_new_ops_give_the_same_batches_in_a_worker_process(source):
    aug = [ops.RandomResize(50, 70), ops.RandomCrop(48), ops.TrivialAugmentWide(),
           ops.ColorJitter(0.3, 0.3, 0.3, 0.1),
           ops.Albumentations(A.Compose([A.HorizontalFlip()]), output_size=48)]

    def run(isolation):
        f = Feeder(source, 4, aug, seed=1, dtype=torch.float32, isolation=isolation,
                   batch_transforms=[ops.RandomErasing(p=0.5)])
        with f:
            return [b[0].clone() for b in drain(f)]
    threads, process = run("thread"), run("process")
    assert len(threads) > 1 and all(torch.equal(x, y) for x, y in zip(threads, process))


def _shrink_image(image, **kwargs):
    return cv2.resize(image, (10, 8), interpolation=cv2.INTER_AREA)


def test_albumentations_refuses_a_mask_left_at_the_old_size():
    # The image is resized, the mask is not: delivered, the batch would crop it.
    t = ops.Albumentations(A.Compose([A.Lambda(image=_shrink_image)]), output_size=(8, 10))
    img, mask = photo(20, 30), np.ones((20, 30), np.uint8)
    with pytest.raises(ConfigError, match=r"Albumentations\(Compose\(\[Lambda\]\)\) returned a \(8, 10\) "
                                          r"image \(height, width\) .*mask of shape \(20, 30\) "
                                          r"\(field 'mask'\)") as info:
        t.apply_fields(img, SampleRNG(0), {"mask": mask}, Geometry.identity(20, 30))
    assert info.value.field == "mask"


def test_albumentations_mask_mismatch_is_not_skipped_and_names_the_sample():
    def make(i):
        img = photo(20, 30, seed=i)
        return {"image": rgb_png(img), "mask": np.ones((20, 30), np.uint8)}
    aug = [ops.Albumentations(A.Compose([A.Lambda(image=_shrink_image)]), output_size=(8, 10))]
    f = Feeder(DictSource(8, make), 4, aug, seed=0, on_error="skip")
    with f, pytest.raises(SampleError, match=r"on sample \d+ .*field 'mask'.*changed the image's size "
                                             r"but not the mask's") as info:
        drain(f)
    assert info.value.field == "mask"


@pytest.mark.parametrize("make, named", [
    (lambda K: K.RandomHorizontalFlip(), "RandomHorizontalFlip"),
    (lambda K: K.AugmentationSequential(K.ColorJiggle(0.1), K.RandomAffine(10.0)), "RandomAffine"),
    (lambda K: torch.nn.Sequential(K.RandomResizedCrop((16, 16))), "RandomResizedCrop"),
])
def test_kornia_geometric_ops_are_refused_on_variable_size_batches_at_construction(source, make, named):
    K = pytest.importorskip("kornia.augmentation")
    # Each image lies in the region its "size" names: a flip or a warp of the
    # padded batch would move it out of there.
    with pytest.raises(ConfigError, match=rf"batch_transforms\[0\]: Kornia.*geometric op\(s\) "
                                          rf"\['{named}'\].*max_image_size"):
        Feeder(source, 4, [], dtype=torch.float32, max_image_size=(96, 96),
               batch_transforms=[ops.Kornia(make(K))])
    Feeder(source, 4, [ops.CenterCrop(16)], dtype=torch.float32,
           batch_transforms=[ops.Kornia(make(K))]).close()  # fixed sizes: accepted


def test_kornia_intensity_ops_run_on_variable_size_batches(source):
    K = pytest.importorskip("kornia.augmentation")
    with Feeder(source, 4, [], dtype=torch.float32, max_image_size=(160, 160), seed=0,
                batch_transforms=[ops.Kornia(K.ColorJiggle(0.2, p=1.0))]) as f:
        batches = drain(f)
    assert batches and all(b["image"].dtype == torch.float32 for b in batches)


def test_kornia_geometric_op_added_after_construction_is_refused_at_the_first_batch(source):
    K = pytest.importorskip("kornia.augmentation")
    module = torch.nn.Sequential(K.ColorJiggle(0.1))
    f = Feeder(source, 4, [], dtype=torch.float32, max_image_size=(160, 160),
               batch_transforms=[ops.Kornia(module)])
    module.append(K.RandomVerticalFlip())
    with f, pytest.raises(FeederError, match=r"refused batch 0 .*\['RandomVerticalFlip'\]"):
        drain(f)


def test_kornia_mixing_ops_are_refused():
    K = pytest.importorskip("kornia.augmentation")
    with pytest.raises(ValueError, match=r"\['RandomMixUpV2'\] mix images.*ops.MixUp"):
        ops.Kornia(K.RandomMixUpV2())
