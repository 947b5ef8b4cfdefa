"""The recipes' augmentations (#24): Resize(max_size), RandomResize, RandomCrop,
ColorJitter, TrivialAugmentWide, RandAugment, RandomErasing and the detection
recipes' ops, each against a numpy
transcription of torchvision's documented behaviour, with masks and boxes,
deterministic across thread counts, and bad parameters refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, run_in_thread
from feeder import ConfigError, Feeder, SampleError, TransformError, ops
from feeder.ops.chain import Chain
from feeder.sample.rng import SampleRNG
from feeder.ops import SampleContext, autoaugment, color
from feeder.sample import Geometry, move_fields
from tests.support.fields import DictSource, rgb_png


def photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth image with texture: not constant anywhere, every value range used."""
    r = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255.0 / w, y * 255.0 / h, (x + y) * 127.0 / (h + w) + 64], -1)
    return np.clip(base + r.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)


def drain(feeder, timeout: float = JOIN_TIMEOUT_S) -> list:
    """Every batch of one pass (dicts or pairs), with a timeout (a hang fails the test)."""
    return run_in_thread(lambda: list(feeder), timeout)


# -- Resize(max_size) and RandomResize ----------------------------------------------

def tv_resized_size(h: int, w: int, size: int, max_size: int | None) -> tuple[int, int]:
    """torchvision's _compute_resized_output_size for an int size, written out."""
    short, long = min(h, w), max(h, w)
    new_short, new_long = size, int(size * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_short, new_long) if h <= w else (new_long, new_short)


@pytest.mark.parametrize("hw", [(480, 640), (640, 480), (375, 500), (100, 1000), (333, 333)])
def test_resize_max_size_matches_torchvision(hw):
    img = photo(*hw)
    for size, max_size in ((800, 1333), (200, None), (300, 400)):
        out = ops.Resize(size, max_size=max_size).apply(img, SampleRNG(0))
        assert out.shape[:2] == tv_resized_size(*hw, size, max_size)
    if hw == (100, 1000):
        assert ops.Resize(800, max_size=1333).apply(img, SampleRNG(0)).shape[:2] == (133, 1333)


def test_resize_max_size_refuses_bad_values():
    with pytest.raises(ValueError, match="max_size applies to an int size"):
        ops.Resize((10, 20), max_size=30)
    with pytest.raises(ValueError, match="max_size must be an int above size=800"):
        ops.Resize(800, max_size=800)


def test_random_resize_draws_every_shorter_side_in_range_both_ends_included():
    t = ops.RandomResize(20, 24)
    img = photo(40, 60)
    seen = set()
    for k in range(300):
        out, g = t.apply_geometry(img, SampleRNG(k))
        h, w = out.shape[:2]
        assert h == min(h, w) and 20 <= h <= 24 and (h, w) == tv_resized_size(40, 60, h, None)
        assert g.sy == pytest.approx(h / 40) and g.sx == pytest.approx(w / 60)
        seen.add(h)
    assert seen == {20, 21, 22, 23, 24}
    capped = ops.RandomResize(50, 60, max_long=70).apply(photo(30, 90), SampleRNG(1))
    assert capped.shape[:2] == (23, 70)


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_size=0), "min_size must be a positive int"),
    (dict(min_size=10, max_size=5), "min_size \\(10\\) is above max_size \\(5\\)"),
    (dict(min_size=10, max_size=20, max_long=15), "max_long must be an int >= max_size"),
    (dict(min_size=10, interpolation="cubic"), "interpolation must be one of"),
])
def test_random_resize_refuses_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.RandomResize(**kwargs)


# -- RandomCrop --------------------------------------------------------------------

def tv_random_crop(img, size, padding, pad_at, fill, rng):
    """torchvision's RandomCrop with pad_if_needed (or the segmentation reference's
    pad_if_smaller, pad_at="end"), in numpy, drawing the window as documented."""
    h, w = size
    l, t, r, b = padding
    img = np.pad(img, ((t, b), (l, r), (0, 0)), constant_values=fill)
    H, W = img.shape[:2]
    dy, dx = max(0, h - H), max(0, w - W)
    if pad_at == "both":  # torchvision pads both sides by the shortfall
        img = np.pad(img, ((dy, dy), (dx, dx), (0, 0)), constant_values=fill)
    else:
        img = np.pad(img, ((0, dy), (0, dx), (0, 0)), constant_values=fill)
    H, W = img.shape[:2]
    i, j = rng.integers(0, H - h + 1), rng.integers(0, W - w + 1)
    return img[i:i + h, j:j + w]


@pytest.mark.parametrize("hw", [(40, 50), (20, 70), (10, 12), (64, 64)])
@pytest.mark.parametrize("padding, pad_at", [(None, "both"), (3, "both"), ((1, 2, 3, 4), "end"),
                                             (None, "end")])
def test_random_crop_matches_torchvision_with_padding(hw, padding, pad_at):
    img = photo(*hw, seed=hw[0])
    t = ops.RandomCrop((32, 48), padding=padding, fill=7, pad_at=pad_at)
    pad4 = (0, 0, 0, 0) if padding is None else ((padding,) * 4 if isinstance(padding, int) else padding)
    for k in range(5):
        got = t.apply(img, SampleRNG(k))
        want = tv_random_crop(img, (32, 48), pad4, pad_at, 7, SampleRNG(k))
        assert np.array_equal(got, want), k


def test_random_crop_pads_the_mask_with_mask_fill_and_clips_boxes():
    img = photo(20, 30)
    mask = np.tile(np.arange(30, dtype=np.uint8), (20, 1))
    boxes = np.array([[0, 0, 10, 10], [25, 15, 30, 20]], np.float32)
    t = ops.RandomCrop(40, pad_at="end")  # image at the top-left, padding after it
    out, g = t.apply_geometry(img, SampleRNG(0))
    assert np.array_equal(out[:20, :30], img) and (out[20:] == 0).all() and (out[:, 30:] == 0).all()
    m = g.mask(mask)
    assert np.array_equal(m[:20, :30], mask) and (m[20:] == 255).all() and (m[:, 30:] == 255).all()
    moved, keep = g.boxes(boxes)
    assert keep.all() and np.array_equal(moved, boxes)
    # A crop inside the image: boxes shift and are clipped; one outside is dropped.
    inner = ops.RandomCrop(10)
    for k in range(20):
        top, left = inner.window(20, 30, SampleRNG(k))
        _, g = inner.apply_geometry(img, SampleRNG(k))
        moved, keep = g.boxes(boxes)
        want = np.clip(boxes - [left, top, left, top], 0, 10)
        alive = (want[:, 2] > want[:, 0]) & (want[:, 3] > want[:, 1])
        assert np.array_equal(keep, alive) and np.allclose(moved, want[alive])


def test_random_crop_without_padding_names_a_too_small_image():
    with pytest.raises(ValueError, match=r"a \(20, 30\) image \(height, width\).* is smaller "
                                         r"than the crop \(40, 40\)"):
        ops.RandomCrop(40, pad_if_needed=False).apply(photo(20, 30), SampleRNG(0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(size=0), "size must be positive"),
    (dict(size=8, padding=-1), "padding must be"),
    (dict(size=8, padding=(1, 2, 3)), "padding must be"),
    (dict(size=8, fill=300), "fill must be an int in \\[0, 255\\]"),
    (dict(size=8, fill=1.5), "fill must be an int in \\[0, 255\\] .* got 1.5"),  # not "not iterable"
    (dict(size=8, mask_fill=-1), "mask_fill must be an int"),
    (dict(size=8, pad_at="start"), "pad_at must be 'both' or 'end'"),
    (dict(size=8, pad_if_needed="yes"), "pad_if_needed must be True or False"),
])
def test_random_crop_refuses_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.RandomCrop(**kwargs)


# -- ColorJitter and the photometric adjustments --------------------------------------

def tv_gray(img):
    f = img.astype(np.float64)
    return 0.2989 * f[..., 0] + 0.587 * f[..., 1] + 0.114 * f[..., 2]


def tv_blend(a, b, ratio):
    return np.clip(ratio * a.astype(np.float64) + (1 - ratio) * b, 0, 255).astype(np.uint8)


def tv_rgb_to_hsv(f):
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    maxc, minc = f.max(-1), f.min(-1)
    eqc = maxc == minc
    cr = maxc - minc
    s = cr / np.where(eqc, 1.0, maxc)
    crd = np.where(eqc, 1.0, cr)
    rc, gc, bc = (maxc - r) / crd, (maxc - g) / crd, (maxc - b) / crd
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = np.mod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return h, s, maxc


def tv_hsv_to_rgb(h, s, v):
    i = np.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.astype(np.int64) % 6
    p, q, t = np.clip(v * (1 - s), 0, 1), np.clip(v * (1 - s * f), 0, 1), np.clip(v * (1 - s * (1 - f)), 0, 1)
    table = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)]
    out = np.zeros(h.shape + (3,))
    for k, (a, b, c) in enumerate(table):
        sel = i == k
        out[sel] = np.stack([a[sel], b[sel], c[sel]], -1)
    return out


def tv_adjust_hue(img, shift):
    h, s, v = tv_rgb_to_hsv(img.astype(np.float64) / 255.0)
    h = np.mod(h + shift, 1.0)
    return (tv_hsv_to_rgb(h, s, v) * 255.999).astype(np.uint8)


def tv_sharpness(img, factor):
    k = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float64) / 13
    f = img.astype(np.float64)
    smooth = f.copy()
    H, W = img.shape[:2]
    acc = np.zeros((H - 2, W - 2, 3))
    for dy in range(3):
        for dx in range(3):
            acc += k[dy, dx] * f[dy:dy + H - 2, dx:dx + W - 2]
    smooth[1:-1, 1:-1] = np.round(acc)
    return tv_blend(img, smooth, factor)


def tv_equalize(img):
    out = np.empty_like(img)
    for c in range(3):
        ch = img[..., c]
        hist = np.bincount(ch.ravel(), minlength=256)
        nz = hist[hist != 0]
        step = (nz.sum() - nz[-1]) // 255
        if step == 0:
            out[..., c] = ch
            continue
        lut = (np.cumsum(hist) + step // 2) // step
        lut = np.clip(np.concatenate(([0], lut[:-1])), 0, 255)
        out[..., c] = lut[ch]
    return out


def tv_autocontrast(img):
    f = img.astype(np.float64)
    lo, hi = f.min((0, 1)), f.max((0, 1))
    eq = hi == lo
    scale = np.where(eq, 1.0, 255.0 / np.where(eq, 1, hi - lo))
    lo = np.where(eq, 0, lo)
    return np.clip((f - lo) * scale, 0, 255).astype(np.uint8)


def close(a, b, atol):
    d = np.abs(a.astype(np.int64) - b.astype(np.int64))
    assert d.max() <= atol, f"max difference {d.max()} > {atol}"


@pytest.mark.parametrize("factor", [0.0, 0.3, 1.0, 1.7])
def test_photometric_adjustments_match_torchvision(factor):
    img = photo(37, 53, seed=3)
    gray = tv_gray(img)
    close(color.adjust_brightness(img, factor), tv_blend(img, 0, factor), 1)
    close(color.adjust_contrast(img, factor), tv_blend(img, gray.mean(), factor), 1)
    close(color.adjust_saturation(img, factor), tv_blend(img, np.floor(gray)[..., None], factor), 2)
    # Sharpness blends with a rounded 3x3 box mean (a third of filter2D's time): <= 2 levels.
    close(color.adjust_sharpness(img, factor), tv_sharpness(img, factor), 2)
    shift = (factor - 0.85) / 2  # in [-0.425, 0.425]
    close(color.adjust_hue(img, shift), tv_adjust_hue(img, shift), 1)


def test_histogram_ops_match_torchvision_exactly():
    img = photo(31, 47, seed=5)
    img[..., 2] = 77  # a constant channel: autocontrast and equalize leave it alone
    assert np.array_equal(color.equalize(img), tv_equalize(img))
    assert np.array_equal(color.autocontrast(img), tv_autocontrast(img))
    for bits in range(1, 9):
        assert np.array_equal(color.posterize(img, bits), img & np.uint8((0xFF << (8 - bits)) & 0xFF))
    for thr in (0.0, 100.5, 128.0, 255.0):
        want = np.where(img >= thr, 255 - img, img)
        assert np.array_equal(color.solarize(img, thr), want)


def test_color_jitter_draws_torchvision_ranges_in_a_random_order():
    t = ops.ColorJitter(brightness=0.4, contrast=(0.5, 0.6), saturation=0.2, hue=0.1)
    orders = set()
    for k in range(200):
        params = t.params(SampleRNG(k))
        assert sorted(i for i, _ in params) == [0, 1, 2, 3]
        f = dict(params)
        assert 0.6 <= f[0] <= 1.4 and 0.5 <= f[1] <= 0.6 and 0.8 <= f[2] <= 1.2 and -0.1 <= f[3] <= 0.1
        orders.add(tuple(i for i, _ in params))
    assert len(orders) == 24  # every order occurs
    img = photo(20, 30)
    # Applying equals the adjustments in the drawn order, with the drawn factors.
    fns = (color.adjust_brightness, color.adjust_contrast, color.adjust_saturation, color.adjust_hue)
    want = img
    for i, f in t.params(SampleRNG(9)):
        want = fns[i](want, f)
    assert np.array_equal(t.apply(img, SampleRNG(9)), want)
    assert ops.ColorJitter(brightness=0.5).params(SampleRNG(1))[0][0] == 0  # off ones skipped
    assert len(ops.ColorJitter(brightness=0.5).params(SampleRNG(1))) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(brightness=-0.1), "brightness must be non-negative"),
    (dict(contrast=(1.5, 0.5)), "contrast must be \\(min, max\\)"),
    (dict(hue=0.6), "hue must be in \\[0, 0.5\\]"),
    (dict(hue=(-0.7, 0.1)), "hue must be \\(min, max\\)"),
    (dict(saturation="a lot"), "saturation must be a number or \\(min, max\\)"),
])
def test_color_jitter_refuses_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.ColorJitter(**kwargs)


# -- TrivialAugmentWide and RandAugment -----------------------------------------------

def tv_warp_nearest(img, m, fill):
    """Output pixel centre (x + 0.5, y + 0.5) in edge coordinates, mapped back through
    the inverse of the forward map ``m``, nearest source pixel (torchvision's grid_sample)."""
    H, W = img.shape[:2]
    a, t = m[:, :2], m[:, 2]
    inv = np.linalg.inv(a)
    y, x = np.mgrid[0:H, 0:W]
    pts = np.stack([x + 0.5 - t[0], y + 0.5 - t[1]], -1) @ inv.T
    sx, sy = np.floor(pts[..., 0]).astype(int), np.floor(pts[..., 1]).astype(int)
    ok = (sx >= 0) & (sx < W) & (sy >= 0) & (sy < H)
    out = np.full_like(img, fill)
    out[ok] = img[sy[ok], sx[ok]]
    return out


@pytest.mark.parametrize("name, mag", [("ShearX", 0.3), ("ShearX", -0.5), ("ShearY", 0.2),
                                       ("TranslateX", 7.9), ("TranslateY", -5.0), ("Rotate", 30.0),
                                       ("Rotate", -135.0), ("Rotate", 90.0)])
def test_geometric_ops_match_torchvision_geometry(name, mag):
    img, _ = coordinate_sample(40, 56)  # R = x, G = y: each pixel says where it came from
    m = autoaugment.affine(name, mag, 40, 56)
    got = autoaugment.apply_op(img, name, mag, autoaugment.cv2.INTER_NEAREST, (0, 0, 0)).astype(int)
    want = tv_warp_nearest(img, m, 0).astype(int)
    both = (got[..., 2] == 128) & (want[..., 2] == 128)
    # OpenCV quantizes nearest sampling positions to 1/32 pixel: a position that
    # close to a pixel boundary may take the neighbouring pixel, never further.
    assert np.abs(got - want)[both].max() <= 1
    assert (np.abs(got - want)[both].max(-1) > 0).mean() < 0.1
    assert ((got[..., 2] == 128) != (want[..., 2] == 128)).mean() < 0.05  # the same pixels inside
    if name.startswith("Translate"):
        assert np.array_equal(got, want)


def test_rotation_by_90_degrees_is_counter_clockwise():
    img = np.zeros((8, 8, 3), np.uint8)
    img[3:5, 6:8] = 255  # right edge, middle
    got = autoaugment.apply_op(img, "Rotate", 90.0, autoaugment.cv2.INTER_NEAREST, 0)
    assert (got[0:2, 3:5] == 255).all() and got.sum() == img.sum()  # now at the top


def test_policies_draw_torchvision_magnitude_tables():
    space = dict((n, (m, s)) for n, m, s in autoaugment._space("wide", 31, 100, 200))
    assert space["Rotate"][0][-1] == 135.0 and space["ShearX"][0][-1] == 0.99
    assert space["TranslateX"][0][-1] == 32.0 and list(space["Posterize"][0][[0, -1]]) == [8, 2]
    assert space["Solarize"][0][0] == 255.0 and not space["Solarize"][1]
    space = dict((n, (m, s)) for n, m, s in autoaugment._space("rand", 31, 100, 200))
    assert space["TranslateX"][0][-1] == pytest.approx(150 / 331 * 200)
    assert space["TranslateY"][0][-1] == pytest.approx(150 / 331 * 100)
    assert list(space["Posterize"][0][[0, -1]]) == [8, 4] and space["Rotate"][0][-1] == 30.0
    names, signs, ops_per = set(), set(), set()
    for k in range(2000):
        (name, mag), = ops.TrivialAugmentWide().draw(SampleRNG(k), 100, 200)
        names.add(name)
        signs.add(np.sign(mag))
        drawn = ops.RandAugment(num_ops=3, magnitude=9).draw(SampleRNG(k), 100, 200)
        ops_per.add(len(drawn))
        for n, m in drawn:
            table = dict((a, b) for a, b, _ in autoaugment._space("rand", 31, 100, 200))[n]
            assert (m == 0.0) if table is None else abs(m) == pytest.approx(float(table[9]))
    assert len(names) == 14 and signs == {-1.0, 0.0, 1.0} and ops_per == {3}


def test_policy_ops_apply_what_they_draw():
    img = photo(33, 41)
    for k in range(40):
        t = ops.RandAugment(num_ops=2, magnitude=12)
        want = img
        for name, mag in t.draw(SampleRNG(k), 33, 41):
            want = autoaugment.apply_op(want, name, mag, autoaugment.cv2.INTER_NEAREST, (0, 0, 0))
        assert np.array_equal(t.apply(img, SampleRNG(k)), want)


def coordinate_sample(h, w):
    """Image R = x, G = y, B = 128; the mask = x: wherever a nearest warp moves the
    image, the mask must say the same x."""
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x, y, np.full_like(x, 128)], -1).astype(np.uint8)
    return img, x.astype(np.uint8)


@pytest.mark.parametrize("name, mag", [("ShearX", 0.4), ("ShearY", -0.3), ("Rotate", 40.0),
                                       ("TranslateX", -9.0), ("TranslateY", 6.0), ("Equalize", 0.0)])
def test_policy_ops_move_masks_and_boxes_with_the_image(name, mag):
    img, mask = coordinate_sample(48, 64)
    boxes = np.array([[10, 12, 30, 20], [40, 30, 60, 44]], np.float32)
    t = ops.TrivialAugmentWide()
    fields = {"mask": mask, "boxes": boxes, "box_labels": np.array([5, 6])}
    # Replay the op through the policy's field path.
    out, moved, geometry = t.apply_fields(img, autoaugment._Replay([(name, mag)]), fields,
                                          Geometry.identity(48, 64))
    moved = move_fields(moved, geometry)
    inside = out[..., 2] == 128
    if name != "Equalize":
        assert np.array_equal(moved["mask"][inside], out[..., 0][inside])
        assert (moved["mask"][~inside] == 255).all()
    else:
        assert np.array_equal(moved["mask"], mask)
    m = autoaugment.affine(name, mag, 48, 64) if name != "Equalize" else np.eye(2, 3)
    for box, label in zip(moved["boxes"], moved["box_labels"]):
        src = boxes[label - 5]
        xs, ys = src[[0, 2, 0, 2]], src[[1, 1, 3, 3]]
        nx, ny = m[0, 0] * xs + m[0, 1] * ys + m[0, 2], m[1, 0] * xs + m[1, 1] * ys + m[1, 2]
        want = np.clip([nx.min(), ny.min(), nx.max(), ny.max()], 0, [64, 48, 64, 48])
        assert np.allclose(box, want, atol=1e-4)


def test_a_box_rotated_out_of_the_image_is_dropped_with_its_per_box_fields():
    img, mask = coordinate_sample(40, 40)
    boxes = np.array([[0, 0, 3, 3], [15, 15, 25, 25]], np.float32)
    t = ops.RandAugment()
    _, moved, _ = t.apply_fields(img, autoaugment._Replay([("TranslateX", -5.0), ("Rotate", 10.0)]),
                                 {"boxes": boxes, "box_labels": np.array([1, 2])},
                                 Geometry.identity(40, 40))
    assert moved["box_labels"].tolist() == [2] and moved["boxes"].shape == (1, 4)


@pytest.mark.parametrize("cls, kwargs, match", [
    (ops.TrivialAugmentWide, dict(num_magnitude_bins=1), "num_magnitude_bins must be an int >= 2"),
    (ops.TrivialAugmentWide, dict(interpolation="bicubic"), "interpolation must be 'nearest' or"),
    (ops.RandAugment, dict(magnitude=31), "magnitude must be an int in \\[0, 31\\)"),
    (ops.RandAugment, dict(num_ops=-1), "num_ops must be an int >= 0"),
    (ops.RandAugment, dict(fill=(1, 2)), "fill must be"),
])
def test_policies_refuse_bad_parameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


# -- through the feeder: masks, boxes, determinism across threads --------------------------

def seg_source(n=12):
    def make(i):
        h, w = 40 + 7 * (i % 4), 56 + 5 * (i % 3)
        img, mask = coordinate_sample(h, w)
        return {"image": rgb_png(img), "mask": mask,
                "boxes": np.array([[5, 5, 20, 30], [30, 10, 50, 35]], np.float32),
                "box_labels": np.array([1, 2])}
    return DictSource(n, make)


class GeometricOnly(ops.TrivialAugmentWide):
    """The policy's field path, with its geometric ops only (the photometric ones
    would change the pixels that tell where each came from)."""

    def draw(self, rng, height, width):
        if isinstance(rng, autoaugment._Replay):
            return rng.ops
        name = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")[rng.integers(0, 5)]
        return [(name, rng.uniform(-0.3, 0.3) if name.startswith("Shear") else rng.uniform(-30, 30))]


RECIPE = [ops.RandomResize(60, 80, interpolation="nearest"), GeometricOnly(),
          ops.RandomCrop(64, pad_at="end"), GeometricOnly()]


def test_the_recipe_keeps_masks_in_step_with_images_through_the_feeder():
    f = Feeder(seg_source(), 4, RECIPE, seed=5, decode_threads=2, shuffle=False)
    checked = 0
    for batch in drain(f):
        for img, mask in zip(batch["image"].numpy(), batch["mask"].numpy()):
            img = img.transpose(1, 2, 0) if img.shape[0] == 3 else img
            inside = img[..., 2] == 128
            # Nearest upscaling: neighbouring pixels differ by <= 1 in x; the mask's
            # and cv2's nearest rules may pick neighbours.
            assert np.abs(mask[inside].astype(int) - img[..., 0][inside]).max() <= 1
            assert (mask[~inside] == 255).all()
            checked += int(inside.sum())
    assert checked > 10000


@pytest.mark.parametrize("ordered", [True])
def test_recipe_results_do_not_depend_on_thread_counts(ordered):
    aug = [ops.RandomResize(50, 70), ops.RandomCrop(48), ops.ColorJitter(0.4, 0.4, 0.4, 0.1),
           ops.TrivialAugmentWide(), ops.RandAugment()]

    def run(threads):
        f = Feeder(seg_source(16), 4, aug, seed=11, decode_threads=threads, shuffle=True,
                   augment_threads=threads - 1)
        return drain(f)

    one, three = run(1), run(3)
    assert len(one) == len(three) == 4
    for a, b in zip(one, three):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"])
        assert all(torch.equal(x, y) for x, y in zip(a["boxes"], b["boxes"]))


# -- RandomErasing ---------------------------------------------------------------------

def tv_erasing_params(H, W, p, scale, ratio, rng):
    """torchvision's RandomErasing draws, from ``rng``: (top, left, h, w) or None."""
    if not rng.random() < p:
        return None
    area = H * W
    for _ in range(10):
        erase = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        h, w = int(round(math.sqrt(erase * aspect))), int(round(math.sqrt(erase / aspect)))
        if h < H and w < W:
            return rng.integers(0, H - h + 1), rng.integers(0, W - w + 1), h, w
    return None


def test_random_erasing_erases_each_sample_from_its_own_stream():
    t = ops.RandomErasing(p=0.7, value=(1.0, 2.0, 3.0))
    images = torch.rand(6, 3, 20, 24)
    labels = torch.arange(6)
    rngs = [SampleRNG(100 + i, 7) for i in range(6)]
    out, same = t.apply_keyed(images, labels, rngs)
    assert same is labels and not torch.equal(out, images)
    erased = 0
    for b in range(6):
        box = tv_erasing_params(20, 24, 0.7, (0.02, 0.33), (0.3, 3.3), SampleRNG(100 + b, 7))
        want = images[b].clone()
        if box is not None:
            top, left, h, w = box
            want[:, top:top + h, left:left + w] = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
            erased += 1
        assert torch.equal(out[b], want)
    assert 0 < erased < 6
    # A sample's erasing depends on its own stream only, not on its batch.
    order = [3, 0, 5]
    sub, _ = t.apply_keyed(images[order], labels[order], [SampleRNG(100 + i, 7) for i in order])
    assert torch.equal(sub, out[order])


def test_random_erasing_random_values_are_per_sample_and_reproducible():
    t = ops.RandomErasing(p=1.0, value="random")
    images = torch.zeros(4, 3, 16, 16)
    a, _ = t.apply_keyed(images, torch.zeros(4), [SampleRNG(i) for i in range(4)])
    b, _ = t.apply_keyed(images[[2]], torch.zeros(1), [SampleRNG(2)])
    assert torch.equal(a[2], b[0]) and (a != 0).any(dim=(1, 2, 3)).all()
    assert abs(float(a[a != 0].std()) - 1.0) < 0.3  # standard normal noise


def aten_ops(fn) -> int:
    """How many aten operations ``fn()`` runs (each is a kernel launch on a device)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


@pytest.mark.parametrize("value", [0.5, (1.0, 2.0, 3.0)])
def test_random_erasing_writes_a_batch_in_a_fixed_number_of_operations(value):
    """The rectangles are written in one pass over the batch, not one slice per erased
    sample: the operations run do not grow with the batch."""
    t = ops.RandomErasing(p=1.0, value=value)

    def run(b):
        images = torch.rand(b, 3, 20, 24)
        return aten_ops(lambda: t.apply_keyed(images, torch.zeros(b), [SampleRNG(i) for i in range(b)]))

    run(2)  # the fill constant is made on the first call
    assert run(4) == run(32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("value", [2.0, (1.0, 2.0, 3.0), (7.0,)])
def test_random_erasing_matches_one_slice_per_sample(dtype, channels_last, value, monkeypatch):
    """The batched write gives what writing each sample's rectangle does, in the
    input's dtype and memory format; the fill is made once per device and dtype."""
    t = ops.RandomErasing(p=0.7, value=value)
    images = (torch.rand(8, 3, 20, 24) * 200).to(dtype)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    sizes = np.array([[20, 24], [12, 10]] * 4)
    out, _ = t.apply_keyed(images, torch.zeros(8), [SampleRNG(i, 3) for i in range(8)], sizes=sizes)
    want = images.clone()
    for b in range(8):
        box = tv_erasing_params(*map(int, sizes[b]), 0.7, (0.02, 0.33), (0.3, 3.3), SampleRNG(b, 3))
        if box is not None:
            top, left, h, w = box
            fill = torch.tensor(value if isinstance(value, tuple) else (value,), dtype=dtype)
            want[b, :, top:top + h, left:left + w] = fill.view(-1, 1, 1)
    assert torch.equal(out, want) and out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last
    rngs = [SampleRNG(i, 3) for i in range(8)]
    monkeypatch.setattr(torch, "tensor", None)  # no constant is made again
    again, _ = t.apply_keyed(images, torch.zeros(8), rngs, sizes=sizes)
    monkeypatch.undo()
    assert torch.equal(again, out)


def test_random_erasing_through_the_feeder_is_deterministic_across_threads(source):
    def run(threads):
        f = Feeder(source, 4, [ops.RandomResizedCrop(24)], dtype=torch.float32, seed=2,
                   decode_threads=threads, batch_transforms=[ops.RandomErasing(p=0.5, value=-1.0)])
        return drain(f)
    one, three = run(1), run(3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, three))
    assert any((a[0] == -1.0).any() for a in one)


@pytest.mark.parametrize("value", [-1.0, 0.5, 256, (0, 300, 0), (0.5, 0, 0)])
def test_random_erasing_refuses_a_value_uint8_images_cannot_hold(value):
    # torch writes it wrapped or truncated (-1 as 255, 0.5 as 0): wrong pixels.
    t = ops.RandomErasing(p=1.0, value=value)
    images = torch.zeros(2, 3, 16, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"RandomErasing: value=.* does not fit torch.uint8 images"):
        t.apply_keyed(images, torch.zeros(2), [SampleRNG(i) for i in range(2)])
    fits = ops.RandomErasing(p=1.0, value=(0, 255, 7))
    out, _ = fits.apply_keyed(images, torch.zeros(2), [SampleRNG(i) for i in range(2)])
    assert (out[:, 1] == 255).any() and (out[:, 2] == 7).any()


@pytest.mark.parametrize("fields", [("mask", "boxes", "box_labels"), ()])
def test_random_erasing_runs_on_batches_without_labels(fields):
    # Segmentation and detection samples have no "label": RandomErasing leaves
    # labels alone and must not require one (it was refused at the first batch).
    def make(i):
        sample = seg_source().read(i)
        return {k: v for k, v in sample.items() if k == "image" or k in fields}
    plain, erased = (drain(Feeder(DictSource(8, make), 4, [ops.Resize((32, 32))], seed=2,
                                  dtype=torch.float32, batch_transforms=bt))
                     for bt in ([], [ops.RandomErasing(p=1.0, value=-1.0)]))
    for a, b in zip(plain, erased):
        assert set(b) == {"image", *fields}
        assert (b["image"] == -1.0).any(dim=(1, 2, 3)).all() and not (a["image"] == -1.0).any()
        for name in fields:  # masks and boxes left alone
            assert all(torch.equal(x, y) for x, y in zip(a[name], b[name]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(p=1.5), "p must be in \\[0, 1\\]"),
    (dict(scale=(0.5, 0.1)), "scale must be \\(min, max\\)"),
    (dict(ratio=(0, 1)), "ratio must be \\(min, max\\)"),
    (dict(value="noise"), "value must be a number, a per-channel sequence or 'random'"),
])
def test_random_erasing_refuses_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.RandomErasing(**kwargs)


# -- a torchvision transform gets the fix named ----------------------------------------

def torchvision_like(name: str, module: str = "torchvision.transforms.v2._geometry"):
    cls = type(name, (), {"__call__": lambda self, x: x, "__repr__": lambda self: f"{name}()"})
    cls.__module__ = module
    return cls()


@pytest.mark.parametrize("name, fix", [
    ("RandomResizedCrop", "use ops.RandomResizedCrop"),
    ("ColorJitter", "use ops.ColorJitter"),
    ("Normalize", "Feeder\\(normalize="),
    ("ToTensor", "feeder delivers tensors"),
    ("GaussianBlur", "ops.Albumentations\\(A.Compose"),
])
def test_a_torchvision_transform_gets_an_error_naming_the_fix(source, name, fix):
    with pytest.raises(TypeError, match=f"is a torchvision transform .*{fix}"):
        Feeder(source, 4, [ops.Resize((16, 16)), torchvision_like(name)])


def test_a_torchvision_batch_transform_gets_an_error_naming_the_fix(source):
    with pytest.raises(TypeError, match="batch_transforms\\[0\\].*ops.RandomErasing"):
        Feeder(source, 4, [ops.Resize((16, 16))], dtype=torch.float32,
               batch_transforms=[torchvision_like("RandomErasing", "torchvision.transforms.transforms")])


@pytest.mark.parametrize("kwargs, match", [
    (dict(transforms=[ops.Resize((16, 16)), ops.RandomErasing()]),
     "transforms: RandomErasing.* is a batch transform .*Feeder\\(batch_transforms="),
    (dict(transforms=[ops.Resize((16, 16)), ops.MixUp(0.2, num_classes=2)]),
     "transforms: MixUp.* is a batch transform"),
    (dict(transforms=[ops.Resize((16, 16))], batch_transforms=[ops.ColorJitter(0.2)]),
     "batch_transforms\\[0\\]: ColorJitter.* is a per-sample transform .*Feeder\\(transforms="),
    (dict(transforms=[ops.Resize((16, 16)), torchvision_like("HorizontalFlip", "albumentations.augmentations")]),
     "is an albumentations transform; wrap its pipeline as ops.Albumentations"),
])
def test_a_transform_in_the_wrong_list_is_refused_at_construction(source, kwargs, match):
    # Without the check each of these fails only at the first batch, with a
    # TypeError about a missing argument (or, under on_error="skip", skips every sample).
    with pytest.raises(TypeError, match=match):
        Feeder(source, 4, dtype=torch.float32, **kwargs)


def test_a_non_callable_transform_gets_an_error_naming_the_alternatives(source):
    with pytest.raises(TypeError, match="neither a feeder transform nor callable; use the feeder.ops"):
        Feeder(source, 4, [ops.Resize((16, 16)), 42])


def test_lookup_tables_give_the_same_result_with_and_without_stringzilla(monkeypatch):
    img = photo(29, 31, seed=8)
    def run():
        return [color.adjust_brightness(img, 1.3), color.adjust_contrast(img, 0.7), color.posterize(img, 3),
                color.solarize(img, 99.0), color.adjust_brightness(img[:, ::2], 0.8)]

    with_sz = run()
    # A StringZilla without translate(out=): copy, then translate in place.
    monkeypatch.setattr(color, "_SZ_OUT", False)
    in_place = run()
    monkeypatch.setattr(color, "_sz", None)
    without = run()
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(with_sz, in_place, without))


# -- the detection recipes' ops ------------------------------------------------------------

def test_photometric_distort_applies_torchvision_draws_in_order():
    t = ops.RandomPhotometricDistort(p=0.5)
    img = photo(30, 40, seed=2)
    kinds = set()
    for k in range(60):
        q = t.params(SampleRNG(k))
        want = img
        if q["brightness"] is not None:
            assert 0.875 <= q["brightness"] <= 1.125
            want = color.adjust_brightness(want, q["brightness"])
        if q["contrast"] is not None and q["contrast_before"]:
            want = color.adjust_contrast(want, q["contrast"])
        if q["saturation"] is not None:
            want = color.adjust_saturation(want, q["saturation"])
        if q["hue"] is not None:
            assert -0.05 <= q["hue"] <= 0.05
            want = color.adjust_hue(want, q["hue"])
        if q["contrast"] is not None and not q["contrast_before"]:
            want = color.adjust_contrast(want, q["contrast"])
        if q["permutation"] is not None:
            assert sorted(q["permutation"]) == [0, 1, 2]
            want = want[..., q["permutation"]]
        assert np.array_equal(t.apply(img, SampleRNG(k)), want)
        kinds.add((q["brightness"] is None, q["permutation"] is None, q["contrast_before"]))
    assert len(kinds) == 8


def test_zoom_out_places_the_image_on_a_canvas_and_moves_boxes():
    t = ops.RandomZoomOut(fill=(1, 2, 3), side_range=(1.5, 3.0), p=1.0)
    img = photo(20, 30)
    boxes = np.array([[2, 3, 10, 12]], np.float32)
    for k in range(10):
        top, left, ch, cw = t.params(20, 30, SampleRNG(k))
        assert 1.5 * 30 - 1 <= cw <= 3.0 * 30 and 1.5 * 20 - 1 <= ch <= 3.0 * 20
        out, g = t.apply_geometry(img, SampleRNG(k))
        assert out.shape == (ch, cw, 3) and np.array_equal(out[top:top + 20, left:left + 30], img)
        rest = out.copy()
        rest[top:top + 20, left:left + 30] = (1, 2, 3)
        assert (rest == np.array([1, 2, 3], np.uint8)).all()
        assert np.allclose(g.boxes(boxes)[0], boxes + [left, top, left, top])
        mask = g.mask(np.ones((20, 30), np.uint8))
        assert (mask[top:top + 20, left:left + 30] == 1).all() and (mask == 255).sum() == ch * cw - 600
    assert ops.RandomZoomOut(p=0.0).apply(img, SampleRNG(0)) is img


def test_iou_crop_keeps_the_boxes_whose_centres_it_holds():
    img = photo(100, 120)
    boxes = np.array([[10, 10, 40, 40], [60, 50, 110, 95], [0, 80, 20, 100]], np.float32)
    fields = {"boxes": boxes, "box_labels": np.array([0, 1, 2])}
    t = ops.RandomIoUCrop()
    cropped = 0
    for k in range(40):
        q = t.params(100, 120, boxes, SampleRNG(k))
        out, moved, g = t.apply_fields(img, SampleRNG(k), fields, Geometry.identity(100, 120))
        if q is None:
            assert out is img and moved["box_labels"].tolist() == [0, 1, 2]
            continue
        cropped += 1
        top, left, h, w, within = q
        assert np.array_equal(out, img[top:top + h, left:left + w])
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        assert within.tolist() == ((left < cx) & (cx < left + w) & (top < cy) & (cy < top + h)).tolist()
        assert 0.5 <= w / h <= 2.0 and w >= int(0.3 * 120) and h >= int(0.3 * 100)
        assert moved["box_labels"].tolist() == np.flatnonzero(within).tolist()
        final = move_fields(moved, g)
        want = np.clip(boxes[within] - [left, top, left, top], 0, [w, h, w, h])
        assert np.allclose(final["boxes"], want)
    assert 5 < cropped < 40


def test_iou_crop_without_boxes_is_an_error_naming_the_need():
    with pytest.raises(ValueError, match="RandomIoUCrop needs samples with boxes"):
        ops.RandomIoUCrop().apply(photo(10, 10), SampleRNG(0))


def test_scale_jitter_and_random_shortest_size_match_torchvision_sizes():
    img = photo(60, 90)
    for k in range(20):
        t = ops.ScaleJitter((100, 120), scale_range=(0.5, 1.5))  # (width, height), as torchvision
        s = 0.5 + SampleRNG(k).random() * 1.0
        r = min(120 / 60, 100 / 90) * s
        assert t.apply(img, SampleRNG(k)).shape[:2] == (int(60 * r), int(90 * r))
        u = ops.RandomShortestSize([40, 50, 80], max_size=100)
        size = [40, 50, 80][SampleRNG(k).integers(0, 3)]
        r = min(size / 60, 100 / 90)
        out, g = u.apply_geometry(img, SampleRNG(k))
        assert out.shape[:2] == (int(60 * r), int(90 * r))
        assert g.sy == pytest.approx(out.shape[0] / 60)


@pytest.mark.parametrize("make, match", [
    (lambda: ops.RandomPhotometricDistort(brightness=(1.2, 0.8)), "brightness must be \\(min, max\\)"),
    (lambda: ops.RandomPhotometricDistort(hue=(-0.1, 0.7)), "hue must be \\(min, max\\) within \\[-0.5, 0.5\\]"),
    (lambda: ops.RandomPhotometricDistort(p=2), "p must be in \\[0, 1\\]"),
    (lambda: ops.RandomZoomOut(side_range=(0.5, 2.0)), "side_range must be \\(min, max\\) within \\[1, inf\\]"),
    (lambda: ops.RandomIoUCrop(min_scale=0.0), "\\(min_scale, max_scale\\) must be \\(min, max\\) within \\(0, 1\\]"),
    (lambda: ops.RandomIoUCrop(trials=0), "trials must be a positive int"),
    (lambda: ops.ScaleJitter((100,)), "target_size must be \\(width, height\\)"),
    (lambda: ops.RandomShortestSize([480, 0]), "min_size must be a positive int"),
])
def test_detection_ops_refuse_bad_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def det_source(n=12):
    def make(i):
        img = photo(60 + 5 * (i % 3), 80, seed=i)
        return {"image": rgb_png(img), "boxes": np.array([[5, 5, 30, 40], [40, 20, 75, 55]], np.float32),
                "box_labels": np.array([1, 2])}
    return DictSource(n, make)


def test_detection_recipe_through_the_feeder_is_deterministic_across_threads():
    aug = [ops.RandomPhotometricDistort(), ops.RandomZoomOut(side_range=(1.0, 2.0)), ops.RandomIoUCrop(),
           ops.RandomShortestSize([48, 56, 64], max_size=96), ops.RandomHorizontalFlip(),
           ops.Resize((64, 64))]

    def run(threads):
        return drain(Feeder(det_source(), 4, aug, seed=3, decode_threads=threads, shuffle=True))
    one, three = run(1), run(3)
    assert len(one) == 3
    for a, b in zip(one, three):
        assert torch.equal(a["image"], b["image"])
        assert all(torch.equal(x, y) for x, y in zip(a["boxes"], b["boxes"]))
        assert all(torch.equal(x, y) for x, y in zip(a["box_labels"], b["box_labels"]))
        for boxes in a["boxes"]:
            assert ((boxes >= 0) & (boxes <= 64)).all()


@pytest.mark.parametrize("t", [ops.RandomResize(100, 120), ops.RandomShortestSize([100, 110]),
                               ops.ScaleJitter((4000, 4000), (1.0, 1.5)),
                               ops.RandomZoomOut(side_range=(30.0, 40.0), p=1.0)])
def test_a_drawn_size_is_checked_against_max_pixels_before_it_is_allocated(t, monkeypatch):
    chain = Chain([t, ops.CenterCrop(32)], None, max_pixels=50_000)
    img = photo(4, 600)  # elongated: its shorter side scaled to 100+ is 15000+ wide
    calls = []
    monkeypatch.setattr(type(t), "apply", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(type(t), "apply_geometry", lambda *a, **k: calls.append(a))
    with pytest.raises(TransformError, match="would produce a .* above max_pixels=50000"):
        chain.run(img, 7, SampleContext((4, 600)), np.empty((32, 32, 3), np.uint8))
    assert not calls  # refused before the transform ran
    assert t.planned_size_for(4, 600, SampleRNG(7, 0)) is not None


def test_resize_max_size_through_the_feeder_with_reduced_scale_decode(jpeg_blobs):
    from tests.support import MemorySource
    f = Feeder(MemorySource(list(jpeg_blobs[:8])), 4, [ops.Resize(20, max_size=24), ops.CenterCrop(20)],
               seed=0, shuffle=False)
    fused = drain(f)
    f2 = Feeder(MemorySource(list(jpeg_blobs[:8])), 4,
                [ops.Resize(20, max_size=24), ops.RandomHorizontalFlip(p=0.0), ops.CenterCrop(20)],
                seed=0, shuffle=False)
    plain = drain(f2)  # not fused: the resize's full output, then the crop
    # The first image is 64x80: shorter side 20 would make it 20x25, so the cap
    # makes it 19x24, and the 20x20 crop pads its last row with zeros.
    assert ops.Resize(20, max_size=24).target(64, 80) == (19, 24)
    assert (fused[0][0][0, :, 19, :] == 0).all() and (fused[0][0][0, :, 18, :] != 0).any()
    for a, b in zip(fused, plain):
        assert a[0].shape == (4, 3, 20, 20)
        assert (a[0].int() - b[0].int()).abs().max() <= 2  # the fused window: weights rounded


def test_a_mask_fill_an_8_bit_mask_cannot_hold_names_the_option():
    from feeder import Feeder
    from feeder.errors import SampleError
    import simplejpeg
    import cv2

    image = simplejpeg.encode_jpeg(np.zeros((16, 16, 3), np.uint8))
    mask = cv2.imencode(".png", np.ones((16, 16), np.uint8))[1].tobytes()

    class Seg:
        def __len__(self):
            return 2

        def read(self, i):
            return {"image": image, "mask": mask}

    with Feeder(Seg(), 2, [ops.RandomCrop(24, mask_fill=300)], decode_threads=1) as f:
        with pytest.raises(SampleError, match=r"mask_fill=300 does not fit the sample's uint8 mask"):
            next(iter(f))


def _first_drawing(t, name):
    """A SampleRNG key for which ``t`` draws the op ``name`` first on a 16x16 image."""
    for k in range(2000):
        if t.draw(SampleRNG(k), 16, 16)[0][0] == name:
            return k
    raise AssertionError(f"{t!r} never draws {name}")


@pytest.mark.parametrize("make", [lambda: ops.TrivialAugmentWide(mask_fill=300),
                                  lambda: ops.RandAugment(num_ops=1, mask_fill=300)])
@pytest.mark.parametrize("op", ["ShearX", "Rotate", "TranslateY", "Identity"])
def test_a_policy_refuses_a_mask_fill_the_mask_cannot_hold_whatever_it_draws(make, op):
    # Before: a shear or a rotation wrote 255 (cv2 saturates the fill), a
    # translation failed, the others passed: which depended on the draw.
    t = make()
    img, mask = photo(16, 16), np.ones((16, 16), np.uint8)
    with pytest.raises(ConfigError, match=r"mask_fill=300 does not fit the sample's uint8 mask "
                                          r"\(field 'mask'") as info:
        t.apply_fields(img, SampleRNG(_first_drawing(t, op)), {"mask": mask}, Geometry.identity(16, 16))
    assert info.value.field == "mask"
    # 16-bit masks hold it.
    k = _first_drawing(t, "ShearX")
    _, moved, _ = t.apply_fields(img, SampleRNG(k), {"mask": mask.astype(np.uint16)},
                                 Geometry.identity(16, 16))
    assert (moved["mask"] == 300).any()


def test_zoom_out_refuses_a_mask_fill_the_mask_cannot_hold_on_every_sample():
    # p=0: no sample gets a canvas, and still the mask_fill is refused from the first.
    chain = Chain([ops.RandomZoomOut(p=0.0, mask_fill=300), ops.Resize((8, 8))], None)
    mask = np.ones((16, 16), np.uint8)
    with pytest.raises(ConfigError, match="mask_fill=300 does not fit"):
        chain.run_fields(photo(16, 16), 0, SampleContext((16, 16)), np.zeros((8, 8, 3), np.uint8),
                         {"mask": mask}, Geometry.identity(16, 16))


def test_a_policy_mask_fill_mistake_is_not_skipped():
    def make(i):
        return {"image": rgb_png(photo(16, 16, seed=i)), "mask": np.ones((16, 16), np.uint8)}
    f = Feeder(DictSource(8, make), 4, [ops.TrivialAugmentWide(mask_fill=300)], image_size=(16, 16), seed=0,
               on_error="skip")
    with f, pytest.raises(SampleError, match=r"on sample \d+ .*field 'mask'.*mask_fill=300"):
        drain(f)
