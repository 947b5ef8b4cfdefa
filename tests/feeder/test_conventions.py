"""DataLoader's conventions where a user porting a script relies on them: no
shuffle unless asked, ranks from torchrun's environment before the process
group exists, labels that are numbers, dict batches that refuse to be
unpacked as pairs, ``feeder.sampler`` and ``feeder.dataset``."""

from __future__ import annotations

import pickle

import cv2
import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, MemorySource, drain, labels_of, run_in_thread
from feeder import Batch, Feeder, SampleError, ops
from tests.support.faults import feeder_factory
from tests.support.fields import DictSource

RESIZE = [ops.Resize((24, 24))]


make = feeder_factory(4, RESIZE, decode_threads=2)


# -- shuffle -----------------------------------------------------------------------------------

def test_shuffle_is_off_by_default_as_in_dataloader(jpeg_blobs):
    src = MemorySource(jpeg_blobs[:20])
    with make(src, ordered=True) as f:
        assert f.config.shuffle is False
        batches, err = drain(f)
    assert err is None
    assert labels_of(batches) == list(range(20))
    with make(src, shuffle=True, seed=3) as f:
        batches, err = drain(f)
    assert err is None
    got = labels_of(batches)
    assert sorted(got) == list(range(20)) and got != list(range(20))


# -- ranks from the launcher's environment ------------------------------------------------------

def test_ranks_come_from_torchruns_environment_before_the_process_group(jpeg_blobs, monkeypatch):
    src = MemorySource(jpeg_blobs[:24])
    seen = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with make(src, shuffle=True) as f:  # seed=None: no group to agree through
            assert (f.rank, f.world_size) == (rank, 2)
            assert len(f) == 3 and f.num_samples == 12 and len(f.sampler) == 12
            batches, err = drain(f)
        assert err is None
        seen.append(labels_of(batches))
    # Disjoint shards of one order: every sample once across the two ranks.
    assert len(seen[0]) == len(seen[1]) == 12
    assert sorted(seen[0] + seen[1]) == list(range(24))


def test_given_ranks_win_over_the_environment(jpeg_blobs, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with make(MemorySource(jpeg_blobs[:12]), rank=0, world_size=3) as f:
        assert (f.rank, f.world_size) == (0, 3) and f.num_samples == 4


@pytest.mark.parametrize("rank, world", [("2", "2"), ("x", "2"), ("0", "zero"), ("-1", "2")])
def test_a_broken_launcher_environment_is_an_error(jpeg_blobs, monkeypatch, rank, world):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=r"RANK=.*WORLD_SIZE="):
        make(MemorySource(jpeg_blobs[:8]))


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "2"}, {"RANK": "1"}])
def test_without_both_variables_the_launcher_environment_is_not_read(jpeg_blobs, monkeypatch, env):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with make(MemorySource(jpeg_blobs[:8])) as f:
        assert (f.rank, f.world_size) == (0, 1) and len(f) == 2


# -- labels ------------------------------------------------------------------------------------

@pytest.mark.parametrize("label", ["cat", b"cat", None, {"a": 1}, ["x", "y"]])
@pytest.mark.parametrize("as_dict", [False, True])
def test_a_label_that_is_not_a_number_is_refused_naming_the_sample(jpeg_blobs, label, as_dict):
    blob = jpeg_blobs[0]

    def sample(i):
        return {"image": blob, "label": label} if as_dict else (blob, label)

    src = DictSource(6, sample, names=[f"img{i}.jpg" for i in range(6)])
    with make(src) as f:
        batches, err = drain(f)
    assert isinstance(err, SampleError)
    assert err.field == "label" and err.index == 0 and "img0.jpg" in str(err)
    assert "a label is a number" in str(err)


def test_numeric_labels_of_every_kind_still_arrive(jpeg_blobs):
    blob = jpeg_blobs[0]
    for label, dtype in [(np.int16(3), torch.int64), (2.5, torch.float64), ([0.1, 0.9], torch.float64),
                         (True, torch.bool)]:
        src = DictSource(4, lambda i, label=label: (blob, label))
        with make(src) as f:
            x, y = next(iter(f))
        assert y.dtype == dtype and y.shape[0] == 4


# -- dict batches --------------------------------------------------------------------------------

class FieldsSource:
    """``{"image", "label"[, "weight"]}`` samples; module-level, so a spawned worker
    process can unpickle it (``start_method="auto"`` spawns once other threads run)."""

    def __init__(self, blobs, weight):
        self.blobs, self.weight = blobs, weight

    def __len__(self):
        return len(self.blobs)

    def read(self, i):
        out = {"image": self.blobs[i], "label": i}
        if self.weight:
            out["weight"] = float(i) / 2
        return out


def fields_source(jpeg_blobs, n=8, weight=True):
    return FieldsSource(list(jpeg_blobs[:n]), weight)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_two_field_batch_refuses_to_be_unpacked_as_a_pair(jpeg_blobs, isolation):
    with make(fields_source(jpeg_blobs, weight=False), isolation=isolation) as f:
        it = iter(f)
        batch = next(it)
        assert isinstance(batch, Batch) and isinstance(batch, dict)
        with pytest.raises(TypeError, match=r"batch\['image'\], batch\['label'\]"):
            images, targets = batch
        with pytest.raises(TypeError, match="by name"):
            for images, targets in [batch]:
                pass
        # Everything a dict does by name still works.
        assert list(batch.keys()) == ["image", "label"]
        assert batch["label"].tolist() == [0, 1, 2, 3]
        assert {**batch}.keys() == dict(batch).keys() == batch.keys()
        assert "image" in batch and len(batch) == 2
        moved = {k: v for k, v in batch.items()}
        assert moved["label"].dtype == torch.int64
        again = pickle.loads(pickle.dumps(batch))
        assert isinstance(again, Batch) and torch.equal(again["image"], batch["image"])
        for _ in it:
            pass


def test_a_batch_of_more_fields_iterates_its_keys_and_cannot_unpack_into_two(jpeg_blobs):
    with make(fields_source(jpeg_blobs)) as f:
        batch = next(iter(f))
        assert isinstance(batch, Batch)
        assert list(batch) == ["image", "label", "weight"]
        with pytest.raises(ValueError, match="too many values to unpack"):
            images, targets = batch
        for _ in f:
            pass


def test_a_dict_batch_maps_through_torchs_pytree(jpeg_blobs):
    from torch.utils._pytree import tree_map

    with make(fields_source(jpeg_blobs)) as f:
        batch = next(iter(f))
        doubled = tree_map(lambda t: t * 2, batch)
        assert isinstance(doubled, Batch)
        assert doubled["label"].tolist() == [0, 2, 4, 6]
        for _ in f:
            pass


def test_a_pair_batch_still_unpacks(jpeg_blobs):
    with make(MemorySource(jpeg_blobs[:8])) as f:
        for images, labels in f:
            assert images.shape == (4, 3, 24, 24) and labels.dtype == torch.int64


# -- feeder.sampler and feeder.dataset -----------------------------------------------------------

def test_dataset_has_the_sources_length_and_the_batches_samples(jpeg_blobs):
    src = MemorySource(jpeg_blobs[:10])
    with make(src, ordered=True) as f:
        ds = f.dataset
        assert len(ds) == 10 and ds.source is src and f.dataset is ds
        batches, err = drain(f)
        assert err is None
        images = np.concatenate([x for x, _ in batches])
        for i in (0, 3, 9, -1):
            image, label = ds[i]
            assert image.dtype == torch.uint8 and image.shape == (3, 24, 24)
            assert label == i % 10
            np.testing.assert_array_equal(image.numpy(), images[i % 10])
        with pytest.raises(IndexError, match="out of range"):
            ds[10]
        with pytest.raises(TypeError):
            ds["0"]
        assert len(list(ds)) == 10  # iterating stops at the end


def test_dataset_gives_torchvision_style_targets(jpeg_blobs):
    def sample(i):
        return {"image": jpeg_blobs[i], "boxes": [[1.0, 2.0, 10.0, 12.0]], "labels": [i],
                "image_id": 100 + i}

    with make(DictSource(6, sample)) as f:
        image, target = f.dataset[2]
    assert image.shape == (3, 24, 24)
    assert target["image_id"] == 102
    assert target["boxes"].shape == (1, 4) and target["boxes"].dtype == torch.float32
    assert target["labels"].tolist() == [2]


def test_dataset_names_a_bad_sample(jpeg_blobs):
    src = MemorySource([jpeg_blobs[0], b"not an image"], names=["good.jpg", "bad.jpg"])
    with make(src, batch_size=1) as f:
        with pytest.raises(SampleError, match=r"sample 1 \(bad\.jpg\)") as info:
            f.dataset[1]
    assert info.value.stage == "decode" and info.value.index == 1


def test_dataset_is_not_what_accelerate_rebuilds_a_dataloader_around(jpeg_blobs):
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    with make(MemorySource(jpeg_blobs[:8])) as f:
        assert len(f.dataset) == 8
        with pytest.raises(AttributeError, match=r"feeder\.skip\(num_batches\) after feeder\.set_epoch"):
            accelerator.skip_first_batches(f, 1)


def test_dataset_gives_the_latest_passs_random_draws(jpeg_blobs):
    src = MemorySource(jpeg_blobs[:8])
    with Feeder(src, 4, [ops.RandomResizedCrop(24), ops.RandomHorizontalFlip()], ordered=True,
                seed=5, decode_threads=2) as f:
        f.set_epoch(3)
        batches, err = drain(f)
        assert err is None
        images = np.concatenate([x for x, _ in batches])
        for i in range(8):  # after the pass: the draws of the pass just delivered
            np.testing.assert_array_equal(f.dataset[i][0].numpy(), images[i])


@pytest.mark.parametrize("label", [np.array(["a", "b"]), np.array([object(), 1], dtype=object)])
def test_a_non_numeric_label_array_names_its_dtype(jpeg_blobs, label):
    src = DictSource(4, lambda i: (jpeg_blobs[0], label))
    with make(src) as f:
        batches, err = drain(f)
    assert isinstance(err, SampleError) and f"dtype {label.dtype}" in str(err)


def test_images_and_targets_gives_torchvisions_detection_form(jpeg_blobs):
    def sample(i):
        return {"image": jpeg_blobs[i], "boxes": [[1.0, 2.0, 10.0, 12.0]] * (i % 3 + 1),
                "box_labels": [i] * (i % 3 + 1), "image_id": 100 + i}

    with Feeder(DictSource(8, sample), 4, [], max_image_size=(160, 160), size_divisibility=32,
                decode_threads=2) as f:
        batch = next(iter(f))
        images, targets = batch.images_and_targets(rename={"box_labels": "labels"})
        assert len(images) == len(targets) == 4
        for k, (img, target) in enumerate(zip(images, targets)):
            h, w = batch["size"][k].tolist()
            assert img.shape == (3, h, w)
            assert torch.equal(img, batch["image"][k, :, :h, :w])
            assert set(target) == {"boxes", "labels", "image_id"}
            assert target["boxes"].shape == (k % 3 + 1, 4) and target["labels"].tolist() == [k] * (k % 3 + 1)
            assert int(target["image_id"]) == 100 + k
        for _ in f:
            pass


@pytest.mark.parametrize("fields", [False, True])
def test_dataset_gives_each_image_at_its_own_size_when_sizes_vary(fields):
    """With max_image_size, dataset[i] is the image unpadded (evaluation helpers such
    as torchvision's COCO conversion take each image's size from its shape), equal to
    the batch's slot cut to its size, with the mask cut the same way."""
    sizes = [(40, 70), (90, 30), (64, 64)]
    rng = np.random.default_rng(0)
    pngs = [cv2.imencode(".png", rng.integers(0, 256, (*hw, 3), dtype=np.uint8))[1].tobytes()
            for hw in sizes]

    def sample(i):
        if not fields:
            return pngs[i], i
        h, w = sizes[i]
        return {"image": pngs[i], "mask": np.full((h, w), i + 1, np.uint8), "image_id": i}

    with Feeder(DictSource(3, sample), 3, [], max_image_size=(128, 128), size_divisibility=32,
                ordered=True, decode_threads=2) as f:
        batch = next(iter(f))
        images = batch["image"]
        for i, (h, w) in enumerate(sizes):
            image, target = f.dataset[i]
            assert image.shape == (3, h, w)
            assert torch.equal(image, images[i, :, :h, :w])
            if fields:
                assert target["size"].tolist() == [h, w]
                assert target["mask"].shape == (h, w) and int(target["mask"].min()) == i + 1
        for _ in f:
            pass


@pytest.mark.parametrize("rank", [0, 1])
def test_iterating_the_sampler_gives_the_next_passs_indices_in_order(jpeg_blobs, rank):
    with make(MemorySource(jpeg_blobs[:10]), batch_size=2, shuffle=True, seed=3, rank=rank,
              world_size=2) as f:
        f.set_epoch(2)
        planned = list(f.sampler)
        assert len(planned) == len(f.sampler) == 5
        assert all(isinstance(i, int) for i in planned)
        delivered = []
        for _ in f:
            delivered += f.last_batch.indices.tolist()
        f.set_epoch(3)
        assert list(f.sampler) != planned  # another epoch, another order
    # what iterating the sampler said is what the pass delivered, batch by batch
    assert delivered == planned


def test_iterating_the_sampler_never_waits_for_the_other_ranks(jpeg_blobs, monkeypatch):
    # With a process group running and a drawn seed not yet agreed on, iterating
    # the sampler on one rank would need the others: it says so instead of waiting.
    with make(MemorySource(jpeg_blobs[:8]), batch_size=2, shuffle=True, rank=0, world_size=2) as f:
        # a two-rank group, as this process would see it (none can form in one test process)
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
        with pytest.raises(RuntimeError, match="agreed on the shuffle seed"):
            run_in_thread(lambda: list(f.sampler), timeout=JOIN_TIMEOUT_S)
    with make(MemorySource(jpeg_blobs[:8]), batch_size=2, shuffle=True, rank=0, world_size=2,
              seed=5) as f:  # a given seed needs no agreement
        assert len(run_in_thread(lambda: list(f.sampler), timeout=JOIN_TIMEOUT_S)) == 4
