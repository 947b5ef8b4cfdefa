"""Variable-size batches (``max_image_size``): each batch padded to its largest
image (rounded up to ``size_divisibility``), with every image's valid size, on
both engines; masks padded with ``mask_fill``, boxes unchanged; oversize images
fail as their sample's fault; resume, ordered determinism and exactly-once as
for fixed sizes."""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch

from tests.support import collected
from feeder import ConfigError, Feeder, SampleError, ops
from feeder.engine.collate import batch_extent
from feeder.decode import decode_image
from feeder.engine.transfer import copy_region, zero_padding
from tests.support.fields import png, rgb_png

ENGINES = ["thread", "process"]


def _clone(batch: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


# The batches of one pass (up to ``limit``), copied, in a thread bounded by a timeout.
collect = functools.partial(collected, keep=_clone)


def _image(h: int, w: int, seed: int) -> np.ndarray:
    # Never 0: padding (0) can be told from pixels.
    return np.random.default_rng(seed).integers(1, 256, (h, w, 3), dtype=np.uint8)


class Sized:
    """PNG pairs (exact pixels) of assorted sizes; the label is the index."""

    def __init__(self, sizes: list[tuple[int, int]]) -> None:
        self.images = [_image(h, w, i) for i, (h, w) in enumerate(sizes)]
        self.blobs = [rgb_png(img) for img in self.images]
        self.reads = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.blobs)

    def read(self, index: int):
        with self._lock:
            self.reads += 1
        return self.blobs[index], index

    def __getstate__(self) -> dict:
        # Picklable for a spawned worker (start_method="auto" spawns once other
        # threads run): the lock is the process's own.
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _sizes(n: int, seed: int = 0, low: int = 8, high: int = 40) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(low, high)), int(rng.integers(low, high))) for _ in range(n)]


@pytest.fixture(scope="module")
def sized():
    return Sized(_sizes(23))


def check_batch(batch, source: Sized, divisibility: int = 1) -> None:
    images, sizes, labels = batch["image"], batch["size"], batch["label"]
    assert sizes.dtype == torch.int64 and sizes.shape == (len(labels), 2)
    assert images.dtype == torch.uint8 and images.shape[:2] == (len(labels), 3)
    expect_hw = batch_extent(sizes.numpy(), divisibility)
    assert tuple(images.shape[2:]) == expect_hw
    assert expect_hw[0] % divisibility == 0 and expect_hw[1] % divisibility == 0
    for j, index in enumerate(labels.tolist()):
        h, w = sizes[j].tolist()
        assert (h, w) == source.images[index].shape[:2]
        hwc = images[j].permute(1, 2, 0).numpy()
        assert np.array_equal(hwc[:h, :w], source.images[index])
        assert not hwc[h:].any() and not hwc[:h, w:].any(), "padding must be 0"


@pytest.mark.parametrize("isolation", ENGINES)
def test_batches_padded_to_their_largest_image_with_sizes(sized, isolation):
    with Feeder(sized, 4, [], max_image_size=(40, 40), shuffle=True, seed=3,
                isolation=isolation) as f:
        batches = collect(f)
    assert sorted(i for b in batches for i in b["label"].tolist()) == list(range(len(sized)))
    for b in batches:
        assert list(b) == ["image", "label", "size"]
        check_batch(b, sized)
        assert b["image"].stride(1) == 1  # channels innermost, as the buffer holds them


@pytest.mark.parametrize("isolation", ENGINES)
def test_size_divisibility_rounds_each_batch_up(sized, isolation):
    with Feeder(sized, 3, [], max_image_size=(39, 39), size_divisibility=16, shuffle=False,
                isolation=isolation) as f:
        assert f.image_size == (48, 48)  # the buffers: max_image_size rounded up
        batches = collect(f)
    for b in batches:
        check_batch(b, sized, 16)


def test_batch_size_one_gives_each_image_as_decoded(sized):
    with Feeder(sized, 1, [], max_image_size=(40, 40), shuffle=False) as f:
        batches = collect(f)
    assert len(batches) == len(sized)
    for i, b in enumerate(batches):
        img = b["image"][0].permute(1, 2, 0).numpy()
        assert np.array_equal(img, decode_image(sized.blobs[i])[0])
        assert b["size"].tolist() == [list(img.shape[:2])]


def test_buffers_reused_for_smaller_images_pad_with_zeros_not_old_pixels():
    # Big images first, then small ones through the same few buffers.
    sizes = [(40, 40)] * 8 + [(10, 12), (12, 10)] * 8
    source = Sized(sizes)
    with Feeder(source, 2, [], max_image_size=(40, 40), shuffle=False, queue_size=1,
                decode_threads=1) as f:
        batches = collect(f)
        assert f.stats().buffers <= f.num_buffers
    for b in batches:
        check_batch(b, source)
    assert tuple(batches[-1]["image"].shape[2:]) == (12, 12)


def test_contiguous_memory_format_gives_dense_batches(sized):
    with Feeder(sized, 4, [], max_image_size=(40, 40), shuffle=False,
                memory_format="contiguous") as f:
        batches = collect(f)
    for b in batches:
        check_batch(b, sized)
        assert b["image"].is_contiguous()


def test_float_normalized_output_is_zero_in_the_padding(sized):
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    with Feeder(sized, 4, [], max_image_size=(40, 40), shuffle=False,
                normalize=(mean, std)) as f:
        batches = collect(f)
    for b in batches:
        images = b["image"]
        assert images.dtype == torch.float32
        for j, index in enumerate(b["label"].tolist()):
            h, w = b["size"][j].tolist()
            assert not images[j, :, h:].any() and not images[j, :, :h, w:].any()
            ref = torch.from_numpy(sized.images[index]).permute(2, 0, 1).float() / 255
            ref = (ref - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
            torch.testing.assert_close(images[j, :, :h, :w], ref, atol=1e-5, rtol=1e-5)


def test_transforms_that_vary_the_size_are_allowed(sized):
    with Feeder(sized, 4, [ops.Resize(16), ops.RandomHorizontalFlip()], max_image_size=(80, 80),
                seed=0) as f:
        batches = collect(f)
    for b in batches:
        assert (b["size"].min(dim=1).values == 16).all()  # the shorter side


# -- masks and boxes ----------------------------------------------------------------

class Segments:
    """Dict samples: an image, a mask whose values are all below 200, and boxes."""

    def __init__(self, sizes: list[tuple[int, int]]) -> None:
        self.samples = []
        for i, (h, w) in enumerate(sizes):
            mask = np.random.default_rng(100 + i).integers(0, 200, (h, w)).astype(np.uint8)
            boxes = np.array([[1, 2, w - 1, h - 2], [0, 0, w / 2, h / 2]], np.float32)
            self.samples.append((_image(h, w, i), mask, boxes))

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int):
        img, mask, boxes = self.samples[index]
        return {"image": rgb_png(img), "mask": png(mask), "boxes": boxes, "id": index}


@pytest.mark.parametrize("isolation", ENGINES)
@pytest.mark.parametrize("fill", [255, 7, 300, 65535])
def test_masks_padded_with_mask_fill_and_boxes_unchanged(isolation, fill):
    """A fill past 255 (16-bit masks whose classes include 255) makes the padded
    batches' masks int64, with the 8-bit masks' values unchanged."""
    source = Segments(_sizes(9, seed=5))
    with Feeder(source, 4, [], max_image_size=(40, 40), mask_fill=fill, shuffle=False,
                isolation=isolation) as f:
        batches = collect(f)
    seen = []
    for b in batches:
        assert list(b) == ["image", "mask", "boxes", "id", "size"]
        masks = b["mask"]
        assert masks.dtype == (torch.uint8 if fill <= 255 else torch.int64)
        assert masks.shape[1:] == b["image"].shape[2:]
        for j, index in enumerate(b["id"].tolist()):
            seen.append(index)
            img, mask, boxes = source.samples[index]
            h, w = b["size"][j].tolist()
            assert (h, w) == mask.shape
            m = masks[j].numpy()
            assert np.array_equal(m[:h, :w], mask)
            assert (m[h:] == fill).all() and (m[:h, w:] == fill).all()
            assert np.array_equal(b["boxes"][j].numpy(), boxes)
    assert seen == list(range(len(source)))


def test_a_source_field_named_size_is_refused():
    class WithSize(Segments):
        def read(self, index):
            return {**super().read(index), "size": 3}
    with Feeder(WithSize(_sizes(4)), 2, [], max_image_size=(40, 40), on_error="skip") as f:
        with pytest.raises(SampleError, match="'size'"):
            collect(f)


# -- oversize images ------------------------------------------------------------------

@pytest.mark.parametrize("isolation", ENGINES)
def test_an_image_larger_than_max_image_size_names_the_sample(isolation):
    sizes = [(20, 20)] * 5 + [(20, 45)] + [(20, 20)] * 3
    with Feeder(Sized(sizes), 3, [], max_image_size=(40, 40), shuffle=False,
                isolation=isolation) as f:
        with pytest.raises(SampleError, match=r"sample 5 .*\(20, 45\) image \(height, width\).*"
                                                  r"max_image_size=\(40, 40\)"):
            collect(f)


@pytest.mark.parametrize("isolation", ENGINES)
def test_oversize_images_are_skipped_and_counted_under_skip(isolation):
    sizes = [(20, 20)] * 5 + [(20, 45), (50, 10)] + [(20, 20)] * 3
    source = Sized(sizes)
    with Feeder(source, 3, [], max_image_size=(40, 40), shuffle=False, on_error="skip",
                isolation=isolation) as f:
        batches = collect(f)
        stats = f.stats()
    got = [i for b in batches for i in b["label"].tolist()]
    assert got == [0, 1, 2, 3, 4, 7, 8, 9]
    assert [len(b["label"]) for b in batches] == [3, 3, 2]
    assert stats.skipped == 2
    for b in batches:
        check_batch(b, source)


# -- determinism, exactly once, resume ---------------------------------------------------

def _signature(batches):
    return [(b["label"].tolist(), b["size"].tolist(), tuple(b["image"].shape),
             b["image"].sum().item()) for b in batches]


def test_ordered_output_does_not_depend_on_thread_counts():
    source = Sized(_sizes(30, seed=2))
    runs = []
    for decode, augment in ((1, 0), (3, 0), (2, 2)):
        with Feeder(source, 4, [ops.RandomHorizontalFlip()], max_image_size=(40, 40), seed=11,
                    decode_threads=decode, augment_threads=augment) as f:
            runs.append(_signature(collect(f)))
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("ordered", [True, False])
def test_every_sample_exactly_once_under_skip(ordered):
    sizes = _sizes(40, seed=4)
    for k in (3, 17, 29):
        sizes[k] = (45, 10)  # oversize: skipped
    source = Sized(sizes)
    with Feeder(source, 4, [], max_image_size=(40, 40), seed=1, ordered=ordered,
                on_error="skip", decode_threads=3) as f:
        batches = collect(f)
    got = sorted(i for b in batches for i in b["label"].tolist())
    assert got == [i for i in range(40) if i not in (3, 17, 29)]
    for b in batches:
        check_batch(b, source)


@pytest.mark.parametrize("isolation", ENGINES)
def test_resume_mid_epoch_delivers_the_rest_identically(isolation):
    source = Sized(_sizes(26, seed=6))
    kw = dict(max_image_size=(40, 40), seed=5, isolation=isolation)
    with Feeder(source, 4, [], **kw) as f:
        reference = _signature(collect(f))
    with Feeder(source, 4, [], **kw) as f:
        first = collect(f, limit=3)
        state = f.state_dict()
    assert _signature(first) == reference[:3]
    with Feeder(source, 4, [], **kw) as g:
        g.load_state_dict(state)
        rest = collect(g)
    assert _signature(rest) == reference[3:]


def test_state_of_another_max_image_size_is_refused(sized):
    with Feeder(sized, 4, [], max_image_size=(40, 40), seed=0) as f:
        state = f.state_dict()
    with Feeder(sized, 4, [], max_image_size=(48, 40), seed=0) as g:
        with pytest.raises(ValueError, match="cannot resume: .*image_size differs"):
            g.load_state_dict(state)


def test_stats_count_the_batches(sized):
    with Feeder(sized, 4, [], max_image_size=(40, 40)) as f:
        batches = collect(f)
        stats = f.stats()
    assert stats.stage("transfer").items == len(batches)
    assert stats.buffers <= f.num_buffers


# -- configuration mistakes -------------------------------------------------------------

@pytest.mark.parametrize("transforms, kw, match", [
    ([ops.CenterCrop(16)], dict(max_image_size=(40, 40)), "always produce \\(16, 16\\) \\(height, width\\)"),
    ([], dict(max_image_size=(40, 40), image_size=(40, 40)), "not both"),
    ([ops.CenterCrop(16)], dict(size_divisibility=32), "give max_image_size"),
    ([ops.CenterCrop(16)], dict(mask_fill=0), "give max_image_size"),
    ([], dict(max_image_size=(40, 40), mask_fill=65536), r"mask_fill must be an int in \[0, 65535\]"),
    ([], dict(max_image_size=(40, 0)), "max_image_size must be"),
    ([], dict(max_image_size=(40, 40), size_divisibility=0), "size_divisibility"),
    ([], dict(max_image_size=(1 << 15, 1 << 15), max_pixels=1 << 20), "above max_pixels"),
])
def test_configuration_mistakes_are_errors(sized, transforms, kw, match):
    with pytest.raises((ValueError, ConfigError), match=match):
        Feeder(sized, 4, transforms, **kw)


def test_without_max_image_size_the_error_says_how_to_get_variable_sizes(sized):
    with pytest.raises(ValueError, match="max_image_size"):
        Feeder(sized, 1, [ops.Resize(16)])


# -- max_image_size="auto" ----------------------------------------------------------------

@pytest.mark.parametrize("transforms, bound", [
    ([ops.Resize(800, max_size=1333)], (1333, 1333)),
    ([ops.RandomShortestSize([480, 640, 800], max_size=1333), ops.RandomHorizontalFlip()],
     (1333, 1333)),
    ([ops.ScaleJitter((1024, 1024))], (2048, 2048)),
    ([ops.ScaleJitter((640, 480), scale_range=(0.5, 1.5))], (720, 960)),  # (width, height)
    ([ops.RandomResize(8, 16, max_long=24)], (24, 24)),
    ([ops.Resize(100, max_size=200), ops.RandomZoomOut(side_range=(1.0, 2.5)),
      ops.RandomIoUCrop()], (500, 500)),
    ([ops.RandomResizedCrop(32), ops.ColorJitter(0.2)], (32, 32)),
    ([ops.Resize(256), ops.CenterCrop(224)], (224, 224)),
    ([ops.RandomCrop((24, 40), pad_if_needed=True)], (24, 40)),
])
def test_auto_takes_the_largest_output_the_transforms_can_make(transforms, bound):
    from feeder.ops.chain import Chain
    assert Chain(transforms, None, max_image_size="auto").max_image_size == bound


@pytest.mark.parametrize("make", [
    lambda: ops.Resize(50, max_size=90),
    lambda: ops.RandomShortestSize([30, 50, 70], max_size=90),
    lambda: ops.RandomShortestSize([30, 120], max_size=90),  # a shorter side above the cap
    lambda: ops.ScaleJitter((64, 48), scale_range=(0.1, 2.0)),
    lambda: ops.RandomResize(20, 60, max_long=90),
])
def test_no_image_exceeds_the_auto_bound(make):
    # Sizes drawn over extreme aspect ratios, each with its own draws: the
    # bound holds for every planned output (the size each transform makes).
    from feeder.ops.chain import Chain
    from feeder.sample.rng import SampleRNG
    t = make()
    chain = Chain([t], None, max_image_size="auto")
    high = chain.max_image_size
    rng = np.random.default_rng(0)
    for k in range(3000):
        h, w = (int(v) for v in rng.integers(1, 5000, 2))
        out = t.planned_size_for(h, w, SampleRNG(k, 0))
        assert out[0] <= high[0] and out[1] <= high[1], (t, (h, w), out, high)


def test_zoom_out_after_a_capped_resize_stays_within_the_auto_bound():
    from feeder.ops.chain import Chain
    from feeder.sample.rng import SampleRNG
    resize, zoom = ops.Resize(40, max_size=60), ops.RandomZoomOut(side_range=(1.0, 3.3), p=1.0)
    high = Chain([resize, zoom], None, max_image_size="auto").max_image_size
    rng = np.random.default_rng(1)
    for k in range(2000):
        h, w = resize.planned_size(*(int(v) for v in rng.integers(1, 3000, 2)))
        out = zoom.planned_size_for(h, w, SampleRNG(k, 1))
        assert out[0] <= high[0] and out[1] <= high[1], ((h, w), out, high)


@pytest.mark.parametrize("isolation", ENGINES)
def test_auto_batches_variable_sizes_up_to_the_transforms_bound(sized, isolation):
    with Feeder(sized, 4, [ops.Resize(16, max_size=40)], max_image_size="auto", seed=0,
                isolation=isolation) as f:
        assert f.config.max_image_size == (40, 40) and f.image_size == (40, 40)
        batches = collect(f)
    assert sorted(i for b in batches for i in b["label"].tolist()) == list(range(len(sized)))
    for b in batches:
        sizes = b["size"]
        assert (sizes.min(dim=1).values <= 16).all() and (sizes <= 40).all()


@pytest.mark.parametrize("isolation", ENGINES)
def test_auto_of_a_fixed_size_chain_keeps_the_dict_form(sized, isolation):
    # A preset of fixed size gives batches of the same form as a variable one:
    # the loop that reads "size" (or images_and_targets) works for both.
    with Feeder(sized, 4, [ops.CenterCrop(16)], max_image_size="auto", isolation=isolation) as f:
        assert f.config.max_image_size == (16, 16)
        batches = collect(f)
    for b in batches:
        assert set(b) == {"image", "label", "size"} and (b["size"] == 16).all()
        assert tuple(b["image"].shape[2:]) == (16, 16)


def test_auto_resumes_a_state_of_the_same_bound(sized):
    with Feeder(sized, 4, [ops.Resize(16, max_size=40)], max_image_size="auto", seed=0) as f:
        state = f.state_dict()
    with Feeder(sized, 4, [ops.Resize(16, max_size=40)], max_image_size=(40, 40), seed=0) as g:
        g.load_state_dict(state)


class _Opaque(ops.Transform):
    """A transform that changes the size and cannot say how much."""

    def apply(self, img, rng, out=None, ctx=None):
        return img[: img.shape[0] // 2]


@pytest.mark.parametrize("transforms, bound", [
    ([], (39, 37)),
    ([ops.RandomHorizontalFlip()], (39, 37)),
    ([ops.RandomZoomOut(side_range=(1.0, 2.0))], (78, 74)),
])
def test_auto_without_a_bounding_transform_takes_the_largest_image(sized, transforms, bound):
    # Native-size evaluation: the bound is the data's largest height and width.
    assert tuple(np.max([img.shape[:2] for img in sized.images], 0)) == (39, 37)
    with Feeder(sized, 4, transforms, max_image_size="auto", seed=0) as f:
        assert f.config.max_image_size == bound
        batches = collect(f)
    assert sorted(i for b in batches for i in b["label"].tolist()) == list(range(len(sized)))
    if not transforms:
        for b in batches:
            check_batch(b, sized)


def test_auto_takes_the_sizes_a_source_gives_without_reading(sized):
    class Given(Sized):
        def image_sizes(self):
            return [img.shape[:2] for img in self.images]

    source = Given(_sizes(9, seed=4))
    with Feeder(source, 4, [], max_image_size="auto") as f:
        assert source.reads == 0
        assert f.config.max_image_size == tuple(np.max([img.shape[:2] for img in source.images], 0))


@pytest.mark.parametrize("transforms, words", [
    ([], "keep the images' decoded size, and no sample's size could be read"),
    ([ops.RandomZoomOut()], "scales its input, whose size no transform before it bounds"),
    ([ops.Resize(16), ops.RandomHorizontalFlip()],
     "Resize(16, interpolation='bilinear') has no cap on the longer side (give it max_size=...)"),
    ([ops.RandomShortestSize([8, 16])], "has no cap on the longer side (give it max_size=...)"),
    ([ops.RandomResize(8, 16)], "has no cap on the longer side (give it max_long=...)"),
    ([ops.RandomZoomOut(), ops.Resize(16)], "Resize(16, interpolation='bilinear') has no cap"),
    ([ops.CenterCrop(16), _Opaque()], "cannot say the largest image it produces"),
])
def test_auto_names_the_transform_that_cannot_bound_the_size(transforms, words):
    class Unreadable(Sized):  # no header gives a size: the data cannot bound it either
        def read(self, index):
            return b"not an image", index

    with pytest.raises(ConfigError) as info:
        Feeder(Unreadable(_sizes(3)), 4, transforms, max_image_size="auto")
    text = str(info.value)
    assert text.startswith("max_image_size='auto': ") and words in text, text
    assert "give max_image_size=(height, width)" in text


def test_auto_is_the_only_word_max_image_size_takes(sized):
    with pytest.raises(ValueError, match="max_image_size must be \\(height, width\\), two "
                                         "positive ints, or 'auto'; got 'largest'"):
        Feeder(sized, 4, [ops.Resize(16, max_size=40)], max_image_size="largest")


# -- the device copy, checkable without a GPU -------------------------------------------

@pytest.mark.parametrize("extent", [None, (4, 5), (30, 5), (30, 64), (4, 64)])
def test_copy_region_gives_the_dense_top_left_extent(extent, monkeypatch):
    host = torch.randint(0, 255, (3, 32, 64, 3), dtype=torch.uint8)
    for threshold in (0, 1 << 40):  # the per-sample rows path and the whole-slots path
        monkeypatch.setattr("feeder.engine.gather._ROWS_COPY_MIN_BYTES", threshold)
        got = copy_region(host, 2, extent, torch.device("cpu"))
        hb, wb = extent or (32, 64)
        assert got.is_contiguous()
        assert torch.equal(got, host[:2, :hb, :wb])


def test_zero_padding_clears_outside_each_size():
    images = torch.ones(2, 3, 6, 7)
    zero_padding(images, np.array([[6, 7], [2, 3]]))
    assert images[0].all()
    assert images[1, :, :2, :3].all() and images[1].sum() == 3 * 2 * 3


def test_zero_padding_clears_a_batch_in_a_fixed_number_of_operations():
    """One pass over the batch, not up to two per sample, with the device's copy of
    the sizes when given; a batch without padding is left untouched."""
    from tests.ops.test_ops_recipes import aten_ops

    def run(b):
        images = torch.ones(b, 3, 6, 7).contiguous(memory_format=torch.channels_last)
        sizes = np.array([[6, 7], [2, 3], [6, 3], [2, 7]] * (b // 4))
        n = aten_ops(lambda: zero_padding(images, sizes, torch.from_numpy(sizes)))
        for img, (h, w) in zip(images, sizes):
            assert img[:, :h, :w].all() and img.sum() == 3 * h * w
        return n

    assert run(4) == run(32)
    full = torch.ones(2, 3, 6, 7)
    assert aten_ops(lambda: zero_padding(full, np.array([[6, 7], [6, 7]]))) == 0


@pytest.mark.parametrize("isolation", ENGINES)
def test_in_place_transforms_work_in_the_images_region(isolation):
    # A flip writes the resized image into its region of the slot (no copy of its
    # own): the pixels, the mask and the boxes come out flipped, the padding 0.
    source = Segments([(20, 30), (30, 14), (12, 12)])
    with Feeder(source, 3, [ops.Resize(12, interpolation="nearest"), ops.RandomHorizontalFlip(1.0)],
                max_image_size=(40, 40), shuffle=False, isolation=isolation) as f:
        (batch,) = collect(f)
    with Feeder(source, 3, [ops.Resize(12, interpolation="nearest")], max_image_size=(40, 40),
                shuffle=False) as f:
        (plain,) = collect(f)
    assert torch.equal(batch["size"], plain["size"])
    for j in range(3):
        h, w = batch["size"][j].tolist()
        assert torch.equal(batch["image"][j, :, :h, :w], plain["image"][j, :, :h, :w].flip(2))
        assert torch.equal(batch["mask"][j, :h, :w], plain["mask"][j, :h, :w].flip(1))
        assert not batch["image"][j, :, h:].any() and not batch["image"][j, :, :h, w:].any()
        assert (batch["mask"][j, h:] == 255).all() and (batch["mask"][j, :h, w:] == 255).all()
        b, p = batch["boxes"][j], plain["boxes"][j]
        assert torch.allclose(b[:, [0, 2]], w - p[:, [2, 0]]) and torch.equal(b[:, [1, 3]], p[:, [1, 3]])


@pytest.mark.parametrize("with_fields", [False, True])
def test_a_resize_that_would_exceed_max_image_size_is_refused_before_it_runs(with_fields, monkeypatch):
    # Resize says its size before computing: the sample fails as oversize, and the
    # resize never runs on it.
    calls = []
    real = ops.Resize.apply_geometry if with_fields else ops.Resize.apply
    monkeypatch.setattr(ops.Resize, "apply_geometry" if with_fields else "apply",
                        lambda self, img, *a: calls.append(img.shape) or real(self, img, *a))
    source = Segments([(20, 20), (20, 60)]) if with_fields else Sized([(20, 20), (20, 60)])
    with Feeder(source, 2, [ops.Resize(20)], max_image_size=(40, 40), shuffle=False,
                on_error="skip") as f:
        batches = collect(f)
        assert f.stats().skipped == 1
    assert sum(len(b["size"]) for b in batches) == 1
    assert calls == [(20, 20, 3)]
    with Feeder(source, 2, [ops.Resize(20)], max_image_size=(40, 40), shuffle=False) as f:
        with pytest.raises(SampleError, match=r"sample 1 .*would produce a \(20, 60\) image \(height, width\)"):
            collect(f)


@pytest.mark.parametrize("dicts", [False, True])
def test_late_bound_batches_copy_each_image_with_its_size_and_padding(monkeypatch, dicts):
    # Every batch starts without a buffer: its first samples wait in scratch arrays
    # (max-size) and only their images' regions are copied into the slots.
    from feeder.engine.batch import BufferPool
    monkeypatch.setattr(BufferPool, "try_acquire", lambda self, owner=None: None)
    sizes = _sizes(18, seed=8)
    source = Segments(sizes) if dicts else Sized(sizes)
    with Feeder(source, 4, [ops.RandomHorizontalFlip()], max_image_size=(40, 40), seed=2,
                decode_threads=3) as f:
        batches = collect(f)
    seen = []
    for b in batches:
        ids = (b["id"] if dicts else b["label"]).tolist()
        seen += ids
        for j, index in enumerate(ids):
            h, w = b["size"][j].tolist()
            assert (h, w) == sizes[index]
            img = b["image"][j].permute(1, 2, 0).numpy()
            ref = (source.samples[index][0] if dicts else source.images[index])
            assert np.array_equal(img[:h, :w], ref) or np.array_equal(img[:h, :w], ref[:, ::-1])
            assert not img[h:].any() and not img[:h, w:].any()
            if dicts:
                m = b["mask"][j].numpy()
                assert (m[h:] == 255).all() and (m[:h, w:] == 255).all()
    assert sorted(seen) == list(range(len(sizes)))


def test_random_erasing_draws_within_each_image_not_its_padding():
    # Two very different sizes in one batch: the small image's rectangle must lie
    # inside its own (h, w), as torchvision draws it on the unpadded image.
    import simplejpeg

    sizes = [(16, 16), (64, 64)] * 6
    blobs = [simplejpeg.encode_jpeg(np.full((h, w, 3), 200, np.uint8), quality=95) for h, w in sizes]

    class Two:
        def __len__(self):
            return len(blobs)

        def read(self, i):
            return blobs[i], i

    erase = ops.RandomErasing(p=1.0, scale=(0.2, 0.3), value=(0.0,))
    with Feeder(Two(), 2, [], max_image_size=(64, 64), dtype=torch.float32,
                batch_transforms=[erase], seed=1) as f:
        for batch in f:
            images, valid = batch["image"], batch["size"]
            for img, (h, w) in zip(images, valid.tolist()):
                erased = img[0] == 0.0
                inside = erased[:h, :w]
                assert inside.any(), "p=1: every image is erased"
                # Nothing erased in the padding beyond (h, w) but the padding's own zeros:
                # the rectangle's rows and columns all lie inside the image.
                rows = torch.nonzero(inside.any(1)).flatten()
                cols = torch.nonzero(inside.any(0)).flatten()
                assert rows.max() < h and cols.max() < w
                area = int(inside.sum())
                assert 0.15 * h * w <= area <= 0.35 * h * w, (h, w, area)


def test_images_and_targets_cuts_each_mask_to_its_image():
    import cv2
    import simplejpeg

    shapes = [(20, 30), (36, 24), (16, 16), (40, 40)]

    class Seg:
        def __len__(self):
            return len(shapes)

        def read(self, i):
            h, w = shapes[i]
            mask = np.full((h, w), i + 1, np.uint8)
            return {"image": simplejpeg.encode_jpeg(np.zeros((h, w, 3), np.uint8)),
                    "mask": cv2.imencode(".png", mask)[1].tobytes()}

    with Feeder(Seg(), 4, [], max_image_size=(40, 40), decode_threads=1) as f:
        batch = next(iter(f))
        images, targets = batch.images_and_targets()
        for k, (img, target) in enumerate(zip(images, targets)):
            assert img.shape[1:] == shapes[k] and target["mask"].shape == shapes[k]
            assert bool((target["mask"] == k + 1).all())  # none of the padding's mask_fill


def test_images_and_targets_reads_no_size_back_from_the_device(monkeypatch):
    """The sizes come from the host copy the transfer stage had: on CUDA, reading
    the "size" tensor (``.tolist()``) would wait for the device every step. A
    "size" the caller replaced is read from the tensor given."""
    import pickle

    import simplejpeg

    shapes = [(20, 30), (36, 24), (16, 16), (40, 40)]
    blobs = [simplejpeg.encode_jpeg(np.zeros((h, w, 3), np.uint8)) for h, w in shapes]

    class Src:
        def __len__(self):
            return len(shapes)

        def read(self, i):
            return {"image": blobs[i], "id": i}

    with Feeder(Src(), 4, [], max_image_size=(40, 40), decode_threads=1) as f:
        batch = next(iter(f))
    replaced = dict(batch)
    again = pickle.loads(pickle.dumps(batch))
    real_tolist = torch.Tensor.tolist

    def tolist(self):
        if self is batch["size"]:
            raise AssertionError("the batch's size tensor was read back")
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    images, _ = batch.images_and_targets()
    assert [tuple(img.shape[1:]) for img in images] == shapes
    assert [tuple(img.shape[1:]) for img in again.images_and_targets()[0]] == shapes
    from feeder.engine.transfer import Batch
    replaced["size"] = torch.tensor([[10, 10]] * 4)
    images, _ = Batch(replaced.items()).images_and_targets()
    assert all(tuple(img.shape[1:]) == (10, 10) for img in images)
