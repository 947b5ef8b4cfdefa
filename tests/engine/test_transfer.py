"""The transfer stage driven alone on CPU: batches delivered in order with their
samples' indices, holes filled from the next batch with each index moving with
its sample. (Its CUDA side: tests/engine/test_cuda_logic.py without a GPU,
tests/cuda/ on one; cut and padded variable-size copies: tests/engine/test_variable_size.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support import encode_png, reaped, run_in_thread
from feeder import Feeder, ops
from feeder.engine.batch import Batch, BufferPool
from feeder.engine.collate import Collator
from feeder.engine.queue import Channel, END
from feeder.engine.transfer import Converter, Delivery, Transfer

from tests.support.stage import Control, drain_channel, join


def _completed_batch(pool, index, indices, labels):
    buf = pool.acquire(lambda: False)
    b = Batch(index, buf, len(indices))
    for slot, (i, y) in enumerate(zip(indices, labels)):
        buf.images[slot] = y
        buf.labels[slot] = y
        buf.indices[slot] = i
    return b


def started_transfer(batch_size):
    """A float32 CPU transfer stage, started, with its pool and channels."""
    pool = BufferPool(8, batch_size, 1, 1, pin=False)
    inbox, outbox = Channel("collate", 10), Channel("output", 10)
    collator = Collator(batch_size, ordered=True, drop_last=False, release=pool.release)
    device = torch.device("cpu")
    transfer = Transfer(Control(), collator, pool, device, Converter(torch.float32, None, device),
                        inbox, outbox)
    transfer.start()
    return transfer, pool, inbox, outbox


def test_transfer_sequences_batches_and_delivers_their_sample_indices():
    transfer, pool, inbox, outbox = started_transfer(2)
    inbox.put(_completed_batch(pool, 1, [30, 31], [3, 4]))  # out of order: waits for batch 0
    inbox.put(_completed_batch(pool, 0, [10, 11], [1, 2]))
    inbox.put(END)
    out = drain_channel(outbox)
    join(transfer)
    deliveries = out[:-1]
    assert all(isinstance(d, Delivery) for d in deliveries)
    assert [d.number for d in deliveries] == [0, 1]
    assert [list(d.indices) for d in deliveries] == [[10, 11], [30, 31]]
    assert [d.labels.tolist() for d in deliveries] == [[1, 2], [3, 4]]
    assert deliveries[0].images.dtype == torch.float32
    assert np.isclose(float(deliveries[0].images[1, 0, 0, 0]), 2 / 255)
    assert pool.count("free") == 2  # converted batches are copies: both buffers came back


def test_transfer_moves_indices_with_samples_when_filling_holes():
    transfer, pool, inbox, outbox = started_transfer(3)
    a = _completed_batch(pool, 0, [5, 6, 7], [50, 60, 70])
    a.holes.append(1)  # sample 6 was skipped
    inbox.put(a)
    b = _completed_batch(pool, 1, [8, 9, 10], [80, 90, 100])
    b.holes.append(0)  # sample 8 was skipped
    inbox.put(b)
    inbox.put(_completed_batch(pool, 2, [11, 12, 13], [110, 120, 130]))
    inbox.put(END)
    out = drain_channel(outbox)
    join(transfer)
    got = [([int(i) for i in d.indices], d.labels.tolist()) for d in out[:-1]]
    # Batch 0's survivors are topped up from batch 1; batch 2 passes through whole;
    # what is left of batch 1 ends the pass. Each index travels with its label.
    assert got == [([5, 7, 9], [50, 70, 90]), ([11, 12, 13], [110, 120, 130]), ([10], [100])]


# -- every field of a delivered batch stays valid while the loop holds it ----------------

KEEP_SAMPLES = 40  # 20 batches of 2: several times the pool's buffers
KEEP_BATCHES = 16
MASK_FILL = 255


def colour_of(i: int) -> tuple[int, int, int]:
    return (i * 37 % 200 + 30, i * 91 % 200 + 30, i * 53 % 200 + 30)


def size_of(i: int, variable: bool) -> tuple[int, int]:
    # Variable sizes put a full-size image in most batches: their masks are
    # then one dense block of the buffer's mask plane.
    return ((12, 12), (7, 12), (12, 5), (12, 12), (9, 10))[i % 5] if variable else (12, 12)


class KeptSource:
    """Sample ``i``: a solid image of ``colour_of(i)``, its mask all ``i + 1``
    (16-bit ``1000 + i`` for every seventh sample: a batch of int64 masks),
    an array, boxes and per-box ids that name ``i``, and ``"name"`` passed
    through. Module level, so the process engine can pickle it."""

    def __init__(self, variable: bool, boxes: bool) -> None:
        self.variable, self.boxes = variable, boxes

    def __len__(self) -> int:
        return KEEP_SAMPLES

    def read(self, i: int) -> dict:
        h, w = size_of(i, self.variable)
        image = np.empty((h, w, 3), np.uint8)
        image[...] = colour_of(i)
        wide = i % 7 == 3
        sample = {"image": encode_png(image),
                  "mask": np.full((h, w), 1000 + i if wide else i + 1, np.uint16 if wide else np.uint8),
                  "label": i % 5, "weights": np.array([i, -i, i / 2], np.float32), "name": f"s{i}"}
        if self.boxes:
            k = 1 + i % 3
            sample["boxes"] = np.tile(np.array([[i / 16, 1, i / 16 + 1, 3]], np.float32), (k, 1))
            sample["box_ids"] = np.full(k, i, np.int64)
        return sample


def mask_id(values: torch.Tensor) -> torch.Tensor:
    values = values.long()
    return torch.where(values >= 1000, values - 1000, values - 1)


def expected_pixels(ids: torch.Tensor, dtype, normalize) -> torch.Tensor:
    """The ``[3, h, w]`` pixels of solid samples ``ids`` (``[h, w]``; -1: padding), as
    delivered."""
    colours = torch.tensor([colour_of(i) for i in range(KEEP_SAMPLES)], dtype=torch.float64)
    pixels = colours[ids.clamp(min=0)].permute(2, 0, 1)
    if dtype is not None:
        pixels = pixels / 255
        if normalize is not None:
            mean, std = (torch.tensor(v, dtype=torch.float64).view(3, 1, 1) for v in normalize)
            pixels = (pixels - mean) / std
    return torch.where(ids < 0, 0.0, pixels)  # padding is 0, normalized or not


def check_sample_fields(i: int, got: dict, dtype, normalize, variable: bool, mixed: bool) -> None:
    """Sample ``i``'s fields in a kept batch (a target dict of ``images_and_targets``,
    or one slot of a batch), compared with what its source made."""
    h, w = size_of(i, variable)
    mask = got["mask"]
    if mixed:
        # CutMix pasted a box of a partner's mask and pixels (padding included)
        # anywhere in the slot: each pixel still names its sample.
        ids = torch.where(mask == MASK_FILL, -1, mask_id(mask))
    else:
        ids = torch.full(mask.shape, -1)
        ids[:h, :w] = i
        got_ids = torch.where(mask == MASK_FILL, -1, mask_id(mask))
        assert torch.equal(got_ids, ids), f"sample {i}: its mask changed"
    if "image" in got:
        image = got["image"]
        ids = ids[:image.shape[1], :image.shape[2]]  # images_and_targets: the image's part
        atol = 1e-2 if dtype == torch.float16 else 1e-5
        torch.testing.assert_close(image.double(), expected_pixels(ids, dtype, normalize), atol=atol,
                                   rtol=0, msg=lambda m: f"sample {i}: its image changed: {m}")
    assert got["weights"].tolist() == [i, -i, i / 2], f"sample {i}: its array changed"
    assert got["name"] == f"s{i}"
    if not mixed:
        assert int(got["label"]) == i % 5
    if "boxes" in got:
        k = 1 + i % 3
        assert got["boxes"].tolist() == [[i / 16, 1, i / 16 + 1, 3]] * k, f"sample {i}: its boxes changed"
        assert got["box_ids"].tolist() == [i] * k
    if variable and "size" in got:
        assert got["size"].tolist() == [h, w]


def keep_and_check(f, dtype, normalize, variable: bool, mixed: bool) -> None:
    """Iterate a pass to its end keeping, of its first ``KEEP_BATCHES`` batches, the
    whole batch, or only its other fields and slices of them, or only its
    ``images_and_targets()``; then check everything kept against its source."""
    kept = []

    def run():
        for number, batch in enumerate(f):
            if number >= KEEP_BATCHES:
                continue
            ids = f.last_batch.indices.tolist()
            form = number % 3
            if form == 0:
                kept.append((ids, "batch", batch))
            elif form == 1:  # no image: the mask alone must keep its memory
                fields = {k: v for k, v in batch.items() if k != "image"}
                slices = (batch["mask"][0], batch["mask"][1:, :3], batch["weights"][1])
                kept.append((ids, "fields", (fields, slices)))
            else:
                kept.append((ids, "targets", batch.images_and_targets()))
            del batch
            reaped()  # a dropped buffer is back in the pool before the next batch
        return len(kept)

    assert run_in_thread(run) == KEEP_BATCHES
    reaped()
    for ids, form, what in kept:
        if form == "targets":
            images, targets = what
            for i, image, target in zip(ids, images, targets):
                check_sample_fields(i, {**target, "image": image}, dtype, normalize, variable, mixed)
            continue
        batch, slices = (what, None) if form == "batch" else what
        for k, i in enumerate(ids):
            one = {name: value[k] for name, value in batch.items()}
            check_sample_fields(i, one, dtype, normalize, variable, mixed)
        if slices is not None:
            first, rest, weights = slices
            assert torch.equal(first, batch["mask"][0]) and torch.equal(rest, batch["mask"][1:, :3])
            assert weights.tolist() == [ids[1], -ids[1], ids[1] / 2]


NORMALIZE = ((0.5, 0.4, 0.3), (0.25, 0.2, 0.3))
CONVERSIONS = [(None, None), (torch.float32, None), (torch.float32, NORMALIZE),
               (torch.float16, None), (torch.float16, NORMALIZE)]


def _conversion_id(c) -> str:
    dtype, normalize = c
    return ("uint8" if dtype is None else str(dtype).split(".")[1]) + ("-normalized" if normalize else "")


def _kept_case(conversion, memory_format, variable, isolation):
    return pytest.param(conversion, memory_format, variable, isolation,
                        id=f"{_conversion_id(conversion)}-{memory_format}-"
                           f"{'variable' if variable else 'fixed'}-{isolation}")


# Every combination in this process; in an isolated feeder (each a worker process
# to start) every conversion once, and every pair of memory format and size kind.
KEPT_CASES = [_kept_case(c, m, v, "thread") for c in CONVERSIONS
              for m in ("channels_last", "contiguous") for v in (False, True)] + [
    _kept_case(CONVERSIONS[0], "channels_last", False, "process"),
    _kept_case(CONVERSIONS[1], "contiguous", True, "process"),
    _kept_case(CONVERSIONS[2], "channels_last", True, "process"),
    _kept_case(CONVERSIONS[3], "contiguous", False, "process"),
    _kept_case(CONVERSIONS[4], "contiguous", True, "process"),
]


@pytest.mark.parametrize("conversion, memory_format, variable, isolation", KEPT_CASES)
def test_kept_fields_stay_valid_until_dropped(conversion, memory_format, variable, isolation):
    dtype, normalize = conversion
    size = {"max_image_size": (12, 12)} if variable else {"image_size": (12, 12)}
    with Feeder(KeptSource(variable, boxes=True), 2, [], shuffle=False, decode_threads=1,
                queue_size=1, dtype=dtype, normalize=normalize, memory_format=memory_format,
                isolation=isolation, **size) as f:
        keep_and_check(f, dtype, normalize, variable, mixed=False)


@pytest.mark.parametrize("conversion, isolation", [
    *((c, "thread") for c in CONVERSIONS[1:]), (CONVERSIONS[2], "process"), (CONVERSIONS[3], "process")],
    ids=lambda v: _conversion_id(v) if isinstance(v, tuple) else v)
def test_kept_fields_of_mixed_batches_stay_valid_until_dropped(conversion, isolation):
    # Fixed sizes only: mixing ops refuse variable-size batches.
    dtype, normalize, variable = *conversion, False
    size = {"max_image_size": (12, 12)} if variable else {"image_size": (12, 12)}
    with Feeder(KeptSource(variable, boxes=False), 2, [], shuffle=False, decode_threads=1,
                queue_size=1, dtype=dtype, normalize=normalize, seed=4, isolation=isolation,
                batch_transforms=[ops.CutMix(1.0, 5)], **size) as f:
        keep_and_check(f, dtype, normalize, variable, mixed=True)


def test_a_full_queue_does_not_hold_a_copied_buffer():
    """A CUDA delivery that finds the output queue full waits for its copy and gives
    its pinned buffer back before it blocks; with room, the buffer goes back after
    the put (the wait then overlaps the loop's turnaround)."""
    import threading

    from tests.support import JOIN_TIMEOUT_S
    from feeder.engine.stage import Counters

    pool = BufferPool(4, 1, 1, 1, pin=False)
    outbox = Channel("output", 1)
    stage = Transfer(Control(), None, pool, torch.device("cpu"), None, Channel("in", 1), outbox)
    log, released = [], threading.Event()

    class Event:
        def synchronize(self):
            log.append("sync")

    real_release = pool.release

    def release(buf):
        log.append("release")
        real_release(buf)
        released.set()

    pool.release = release
    stage._hand_over(Counters(), "first", pool.acquire(lambda: False), Event())
    assert log == ["sync", "release"] and outbox.depth() == 1  # room: put, then the wait
    log.clear()
    released.clear()
    t = threading.Thread(target=stage._hand_over,
                         args=(Counters(), "second", pool.acquire(lambda: False), Event()),
                         daemon=True)
    t.start()
    # The queue is full: the buffer comes back while the put is still blocked.
    assert released.wait(JOIN_TIMEOUT_S) and log == ["sync", "release"]
    alive, free = t.is_alive(), pool.count("free")
    assert outbox.get(timeout=JOIN_TIMEOUT_S) == "first"  # unblocks the put either way
    assert alive and free == 1
    t.join(JOIN_TIMEOUT_S)
    assert not t.is_alive() and outbox.get(timeout=JOIN_TIMEOUT_S) == "second"
    assert log == ["sync", "release"]


# -- images_and_targets ---------------------------------------------------------------

def _detection_batch():
    from feeder.engine.transfer import Batch as FieldBatch
    return FieldBatch(image=torch.zeros(2, 3, 4, 4), boxes=[torch.zeros(1, 4), torch.zeros(0, 4)],
                      box_labels=[torch.tensor([1]), torch.tensor([], dtype=torch.int64)],
                      labels=torch.tensor([7, 8]))


@pytest.mark.parametrize("rename, fields", [
    ({"box_labels": "labels"}, "'box_labels' and 'labels'"),
    ({"box_labels": "scores", "boxes": "scores"}, "'boxes' and 'box_labels'"),
])
def test_images_and_targets_refuses_a_rename_onto_another_field(rename, fields):
    # Before, the later field silently replaced the earlier in every target.
    with pytest.raises(ValueError, match="images_and_targets") as info:
        _detection_batch().images_and_targets(rename=rename)
    assert "would both be" in str(info.value)
    assert all(name in str(info.value) for name in fields.replace("'", "").split(" and "))


def test_images_and_targets_refuses_a_rename_of_a_missing_field():
    with pytest.raises(ValueError, match=r"rename names the field\(s\) \['box_label'\]"):
        _detection_batch().images_and_targets(rename={"box_label": "cls"})


def test_images_and_targets_renames_onto_a_field_renamed_away():
    _, targets = _detection_batch().images_and_targets(rename={"labels": "image_labels",
                                                               "box_labels": "labels"})
    assert targets[0]["labels"].tolist() == [1] and int(targets[1]["image_labels"]) == 8


def test_images_and_targets_gives_per_image_integers_as_python_ints(jpeg_blobs, monkeypatch):
    # pycocotools' loadRes and torchvision's references key results by
    # target["image_id"]: a 0-d tensor there hashes by identity and matches nothing.
    from tests.support.fields import DictSource

    def sample(i):
        return {"image": jpeg_blobs[i], "boxes": [[1.0, 2.0, 10.0, 12.0]], "box_labels": [i],
                "image_id": 100 + i, "score": 0.5}

    with Feeder(DictSource(4, sample), 4, [ops.Resize((24, 24))], decode_threads=1) as f:
        batch = next(iter(f))
    real_tolist = torch.Tensor.tolist

    def tolist(self):  # on CUDA a read-back waits for the device: the host copy serves
        if self is batch["image_id"]:
            raise AssertionError("image_id was read back from the batch's tensor")
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    _, targets = batch.images_and_targets()
    assert [t["image_id"] for t in targets] == [100, 101, 102, 103]
    assert all(type(t["image_id"]) is int for t in targets)
    # As an evaluation uses them: results written as JSON, ground truth looked up by id.
    import json
    results = [{"image_id": t["image_id"], "category_id": 1, "bbox": [1, 2, 9, 10], "score": 0.5}
               for t in targets]
    assert json.loads(json.dumps(results))[1]["image_id"] == 101
    assert [{100 + i: i for i in range(4)}[t["image_id"]] for t in targets] == [0, 1, 2, 3]
    assert all(isinstance(t["score"], torch.Tensor) for t in targets)  # floats stay tensors
    assert all(isinstance(t["box_labels"], torch.Tensor) for t in targets)  # per box: tensors
    # A batch built by hand (or moved by a trainer) has no host copy: read from the tensor.
    monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)
    from feeder.engine.transfer import Batch as FieldBatch
    _, targets = FieldBatch(batch.items()).images_and_targets()
    assert [t["image_id"] for t in targets] == [100, 101, 102, 103]
    assert all(type(t["image_id"]) is int for t in targets)


def test_images_and_targets_gives_a_replaced_fields_own_values():
    batch = _detection_batch()
    batch._host = {"labels": (torch.tensor([7, 8]), [7, 8])}  # another tensor: stale
    _, targets = batch.images_and_targets()
    assert [t["labels"] for t in targets] == [7, 8]
    batch["labels"] = torch.tensor([1, 2])
    _, targets = batch.images_and_targets()
    assert [t["labels"] for t in targets] == [1, 2]


def test_images_and_targets_renames_a_prefix():
    from feeder.engine.transfer import Batch as FieldBatch
    batch = FieldBatch(image=torch.zeros(2, 3, 4, 4), boxes=[torch.zeros(1, 4)] * 2,
                       box_labels=[torch.tensor([1])] * 2, box_area=[torch.tensor([4.0])] * 2,
                       box_iscrowd=[torch.tensor([0])] * 2, box_score=[torch.tensor([0.5])] * 2)
    _, targets = batch.images_and_targets(rename={"box_*": "*", "box_score": "scores"})
    assert set(targets[0]) == {"boxes", "labels", "area", "iscrowd", "scores"}
    _, targets = batch.images_and_targets(rename={"box_*": "gt_*", "box_is*": "is*"})
    assert set(targets[0]) == {"boxes", "gt_labels", "gt_area", "iscrowd", "gt_score"}


@pytest.mark.parametrize("rename, message", [
    ({"box_*": ""}, "one '\\*' at the end of both"),
    ({"*_labels": "*"}, "one '\\*' at the end of both"),
    ({"mask_*": "*"}, r"rename names the field\(s\) \['mask_\*'\]"),
    ({"box_*": "*", "boxes": "labels"}, "would both be 'labels'"),
])
def test_images_and_targets_refuses_a_bad_prefix_rename(rename, message):
    with pytest.raises(ValueError, match=message):
        _detection_batch().images_and_targets(rename=rename)
