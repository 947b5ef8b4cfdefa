"""Dict samples in tar shards: ``pack`` writes every field of a source's samples
(masks, boxes, per-box arrays, numbers, text, passed-through values) and
``TarShards`` reads them back to the same samples, so a feeder over the shards
delivers the batches of a feeder over the source; shards written by other tools
(Python's ``tarfile``) with ``.json`` and ``.npy`` members; errors naming the
shard, the key and the field; one range request per sample over HTTP."""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile
import threading

import cv2
import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S
from feeder import Feeder, SampleError, ops
from feeder.decode import decode_mask
from feeder.pack import PackError, main, pack
from feeder.shards import ShardFormatError, TarShards
from feeder.synthetic import make_detection_set, make_segmentation_set
from tests.support.fields import png

T = JOIN_TIMEOUT_S


class SegFiles:
    """The segmentation set as a source, with a passthrough of every kind."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def read(self, i):
        with open(self.pairs[i][0], "rb") as a, open(self.pairs[i][1], "rb") as b:
            return {"image": a.read(), "mask": b.read(), "name": os.path.basename(self.pairs[i][0]),
                    "weight": 0.5 + i, "idx": i, "meta": {"i": i, "tags": ["a", str(i)]},
                    "raw": bytes([i, 0, 255]), "vec": np.arange(3, dtype=np.float32) * i}

    def describe(self, i):
        return self.pairs[i][0]


class DetFiles:
    """The detection set as a source: boxes, per-box labels and an image label."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def read(self, i):
        r = self.records[i]
        with open(r["image"], "rb") as f:
            return {"image": f.read(), "boxes": np.array(r["boxes"], np.float32).reshape(-1, 4),
                    "box_labels": np.array(r["labels"], np.int64), "label": i % 3,
                    "box_area": np.array([(x1 - x0) * (y1 - y0) for x0, y0, x1, y1 in r["boxes"]],
                                         np.float32)}


@pytest.fixture(scope="module")
def seg(tmp_path_factory):
    root = tmp_path_factory.mktemp("seg")
    src = SegFiles(make_segmentation_set(root / "set", count=24, size_range=(40, 64), seed=2))
    res = pack(src, str(root / "out"), shard_size=30_000)
    assert len(res.shards) >= 3 and res.samples == 24
    return src, res


@pytest.fixture(scope="module")
def det(tmp_path_factory):
    root = tmp_path_factory.mktemp("det")
    src = DetFiles(make_detection_set(root / "set", count=24, size_range=(40, 64), seed=3))
    res = pack(src, str(root / "out"), shard_size=30_000)
    assert len(res.shards) >= 3
    return src, res


def _np(value):
    if isinstance(value, torch.Tensor):
        return value.cpu().numpy().copy()
    if isinstance(value, list):
        return [_np(v) for v in value]
    return value


def batches(feeder, timeout=T):
    """Every batch of one pass, as numpy, read in a helper thread with a bound."""
    out, err = [], []

    def run():
        try:
            for b in feeder:
                out.append({k: _np(v) for k, v in b.items()} if isinstance(b, dict)
                           else tuple(_np(v) for v in b))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            err.append(exc)

    t = threading.Thread(target=run, name="test-batches", daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"iteration did not finish within {timeout} s (hang)"
    if err:
        raise err[0]
    return out


def assert_same(a, b, where=""):
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{k}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, \
            (where, a.dtype, a.shape, getattr(b, "dtype", type(b)), getattr(b, "shape", None))
        assert np.array_equal(a, b), where
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def feeder_of(src, **kw):
    return Feeder(src, 5, [ops.RandomResizedCrop(32, scale=(0.4, 1.0)), ops.RandomHorizontalFlip()],
                  seed=11, shuffle=True, decode_threads=2, **kw)


def test_segmentation_round_trip(seg):
    src, res = seg
    shards = TarShards(res.manifest)
    assert shards.plan == {"mask.png": ("mask", "bytes"), "name.txt": ("name", "txt"),
                           "weight.npy": ("weight", "npy"), "idx.npy": ("idx", "npy"),
                           "meta.json": ("meta", "json"), "raw.bin": ("raw", "bytes"),
                           "vec.npy": ("vec", "npy")}
    for i in range(len(src)):
        want, got = src.read(i), shards.read(i)
        assert got["image"] == want["image"] and got["mask"] == want["mask"]
        assert got["name"] == want["name"] and got["meta"] == want["meta"] and got["raw"] == want["raw"]
        assert got["idx"].dtype == np.int64 and int(got["idx"]) == i
        assert got["weight"].dtype == np.float64 and float(got["weight"]) == want["weight"]
        assert_same(want["vec"], got["vec"])
    with feeder_of(src) as a, feeder_of(shards) as b:
        for epoch in (0, 1):
            a.set_epoch(epoch)
            b.set_epoch(epoch)
            want, got = batches(a), batches(b)
            assert len(want) == len(got) == 5  # 24 samples, the last batch short
            assert_same(want, got)
            assert got[0]["mask"].shape[1:] == (32, 32) and got[0]["weight"].dtype == np.float64
            assert sorted(n for bt in got for n in bt["name"]) == sorted(
                os.path.basename(p) for p, _ in src.pairs)


def test_detection_round_trip(det):
    src, res = det
    shards = TarShards(res.manifest)
    assert shards.plan["boxes.npy"] == ("boxes", "npy") and shards.plan["cls"] == ("label", "cls")
    assert shards.plan["box_labels.npy"] == ("box_labels", "npy")
    with tarfile.open(res.shards[0]) as tar:  # the class index where other tools look for it
        names = tar.getnames()
    assert "000000000.cls" in names and "000000000.boxes.npy" in names and "000000000.jpg" in names
    for i in range(len(src)):
        want, got = src.read(i), shards.read(i)
        assert got["label"] == want["label"] and type(got["label"]) is int
        assert_same(want["boxes"], got["boxes"])
        assert_same(want["box_labels"], got["box_labels"])
    with feeder_of(src) as a, feeder_of(shards) as b:
        want, got = batches(a), batches(b)
    assert_same(want, got)
    assert sum(len(bx) for bt in got for bx in bt["boxes"]) > 0
    assert got[0]["label"].dtype == np.int64


def test_pickled_dict_source_reads_the_same(det):
    src, res = det
    shards = TarShards(res.manifest)
    again = pickle.loads(pickle.dumps(shards))
    assert_same(shards.read(5), again.read(5))


def test_auto_pairs_and_explicit_fields(tmp_path, jpeg_blobs):
    """Image + class only: the classic pairs (the fast path); fields= asks for dicts."""
    class Labelled:
        def __len__(self):
            return 6

        def read(self, i):
            return {"image": jpeg_blobs[i], "label": i}

    res = pack(Labelled(), str(tmp_path / "out"))
    assert TarShards(res.manifest).read(3) == (jpeg_blobs[3], 3)
    assert TarShards(res.manifest).plan is None
    assert TarShards(res.manifest, fields=["cls"]).read(3) == {"image": jpeg_blobs[3], "label": 3}
    assert TarShards(res.manifest, fields={"cls": "y"}).read(3) == {"image": jpeg_blobs[3], "y": 3}


def test_max_side_resizes_masks_and_scales_boxes(seg, det, tmp_path):
    src, _ = seg
    res = pack(src, str(tmp_path / "seg"), max_side=30)
    assert res.reencoded == len(src)  # every image is larger than 30 px
    shards = TarShards(res.manifest)
    for i in range(len(src)):
        got, want = shards.read(i), src.read(i)
        img = cv2.imdecode(np.frombuffer(got["image"], np.uint8), cv2.IMREAD_UNCHANGED)
        mask, full = decode_mask(got["mask"]), decode_mask(want["mask"])
        assert max(img.shape[:2]) == 30 and mask.shape == img.shape[:2]
        expected = cv2.resize(full, mask.shape[::-1], interpolation=cv2.INTER_NEAREST)
        assert np.array_equal(mask, expected)  # nearest neighbour, losslessly stored
        assert got["name"] == want["name"]  # other fields untouched
    with feeder_of(shards) as f:  # every mask has its image's size: nothing fails
        assert sum(len(b["name"]) for b in batches(f)) == len(src)

    dsrc, _ = det
    res = pack(dsrc, str(tmp_path / "det"), max_side=30)
    shards = TarShards(res.manifest)
    for i in range(len(dsrc)):
        got, want = shards.read(i), dsrc.read(i)
        h, w = cv2.imdecode(np.frombuffer(want["image"], np.uint8), cv2.IMREAD_UNCHANGED).shape[:2]
        h2, w2 = cv2.imdecode(np.frombuffer(got["image"], np.uint8), cv2.IMREAD_UNCHANGED).shape[:2]
        assert max(h2, w2) == 30
        scale = np.array([w2 / w, h2 / h, w2 / w, h2 / h], np.float32)
        np.testing.assert_allclose(got["boxes"], want["boxes"] * scale, rtol=1e-6)
        assert got["boxes"].dtype == np.float32
        assert_same(want["box_labels"], got["box_labels"])
        assert_same(want["box_area"], got["box_area"])  # not a box: passed as it is


def test_max_side_palette_and_array_masks(tmp_path, jpeg_blobs):
    """A palette PNG's indices (not its colours) and a uint16 array are resized as ids."""
    img = cv2.imdecode(np.frombuffer(jpeg_blobs[0], np.uint8), cv2.IMREAD_UNCHANGED)
    h, w = img.shape[:2]
    ids = ((np.arange(h)[:, None] // 4 + np.arange(w)[None, :] // 4) % 5).astype(np.uint8)
    palette = [(10 * k, 200, 255 - k) for k in range(5)]
    big = (ids.astype(np.uint16) * 1000 + 7)

    class Masks:
        def __len__(self):
            return 2

        def read(self, i):
            return {"image": jpeg_blobs[0], "mask": png(ids, palette=palette) if i == 0 else big}

    side = max(h, w) // 2
    shards = TarShards(pack(Masks(), str(tmp_path / "out"), max_side=side).manifest)
    for i, full in ((0, ids), (1, big)):
        mask = decode_mask(shards.read(i)["mask"])
        assert max(mask.shape) == side and mask.dtype == full.dtype
        assert np.array_equal(mask, cv2.resize(full, mask.shape[::-1], interpolation=cv2.INTER_NEAREST))
    # Without max_side an array mask is stored as a lossless PNG of the same values.
    plain = TarShards(pack(Masks(), str(tmp_path / "plain")).manifest)
    assert np.array_equal(decode_mask(plain.read(1)["mask"]), big)


def _add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def npy_array(arr, **kw):
    buf = io.BytesIO()
    np.save(buf, arr, **kw)
    return buf.getvalue()


def _size(blob):
    return cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_UNCHANGED).shape[:2]


def _foreign(path, jpeg_blobs, n=4, bad=None):
    """A shard as Python's tarfile writes it, with one member per field kind;
    ``bad = (sample, extension, bytes)`` replaces one member."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(n):
            k = f"s{i:03d}"
            boxes = np.array([[1, 2, 10, 12], [3, 3, 5, 9]][: 1 + i % 2], np.float32)
            members = {
                "jpg": jpeg_blobs[i],
                "cls": str(i).encode(),
                "seg.png": png(np.full(_size(jpeg_blobs[i]), i, np.uint8)),
                "json": json.dumps({"caption": f"c{i}", "boxes": boxes.tolist(),
                                    "box_labels": [i] * len(boxes)}).encode(),
                "boxes.npy": npy_array(boxes),
                "box_labels.npy": npy_array(np.full(len(boxes), i, np.int32)),
                "depth.npy": npy_array(np.full((2, 3), i, ">f4")),  # big-endian, as some writers do
                "txt": f"caption {i} é".encode(),
                "xyz": b"\x00unknown",
            }
            if bad is not None and bad[0] == i:
                members[bad[1]] = bad[2]
            for ext, data in members.items():
                _add(tar, f"{k}.{ext}", data)
    return str(path)


def test_foreign_shard_fields(tmp_path, jpeg_blobs):
    path = _foreign(tmp_path / "f-000000.tar", jpeg_blobs)
    shards = TarShards(path)
    s = shards.read(1)
    assert set(s) == {"image", "label", "mask", "json", "boxes", "box_labels", "depth", "txt", "xyz"}
    assert s["image"] == jpeg_blobs[1] and s["label"] == 1 and s["txt"] == "caption 1 é"
    assert s["json"]["caption"] == "c1" and s["xyz"] == b"\x00unknown"
    assert s["depth"].dtype == np.float32 and s["depth"].dtype.isnative and (s["depth"] == 1).all()
    assert s["boxes"].shape == (2, 4) and s["box_labels"].dtype == np.int32
    assert shards.read_record(1).keys() == s.keys()
    # A list chooses the members; a mapping names them; "*" spreads a JSON object.
    picked = TarShards(path, fields=["boxes.npy", ".box_labels.npy"]).read(0)
    assert set(picked) == {"image", "boxes", "box_labels"}
    named = TarShards(path, fields={"seg.png": "seg", "depth.npy": "z", "cls": "y"}).read(2)
    assert set(named) == {"image", "seg", "z", "y"} and named["y"] == 2
    spread = TarShards(path, fields={"json": "*", "cls": "label"}).read(1)
    assert set(spread) == {"image", "caption", "boxes", "box_labels", "label"}
    assert spread["boxes"] == [[1, 2, 10, 12], [3, 3, 5, 9]]
    assert TarShards(path, fields=None).read(3) == (jpeg_blobs[3], 3)
    # Through a feeder: the JSON's boxes become per-image tensors moved with the image.
    src = TarShards(path, fields={"json": "*", "cls": "label"})
    with Feeder(src, 2, [ops.Resize(32), ops.CenterCrop(32)], shuffle=False, decode_threads=1) as f:
        got = batches(f)
    labels = [int(v) for bt in got for v in bt["label"]]
    assert labels == [0, 1, 2, 3]
    boxes = [b for bt in got for b in bt["boxes"]]
    box_labels = [b for bt in got for b in bt["box_labels"]]
    assert sum(len(b) for b in boxes) > 0 and all(b.shape[1:] == (4,) for b in boxes)
    for lab, b, bl in zip(labels, boxes, box_labels):  # rows filtered together, per sample
        assert len(b) == len(bl) <= 1 + lab % 2 and (np.asarray(bl) == lab).all()
    assert got[0]["caption"] == ["c0", "c1"]
    # The label=None rule holds for dicts too: the .cls member is not read.
    assert "label" not in TarShards(path, label=None).read(0)


@pytest.mark.parametrize("ext, data, field, what", [
    ("depth.npy", b"\x93NUMPY garbage", "depth", "is not a .npy array"),
    ("depth.npy", npy_array(np.array([{"a": 1}], dtype=object), allow_pickle=True), "depth",
     "is not a .npy array"),
    ("cls", b"cat", "label", "is not an integer"),
    ("json", b"{not json", "json", "is not JSON"),
    ("txt", b"\xff\xfe bad", "txt", "is not UTF-8 text"),
])
def test_bad_members_name_shard_key_and_field(tmp_path, jpeg_blobs, ext, data, field, what):
    path = _foreign(tmp_path / "bad-000000.tar", jpeg_blobs, bad=(2, ext, data))
    shards = TarShards(path)
    shards.read(1)
    with pytest.raises(ShardFormatError, match=rf"bad-000000\.tar:s002: field '{field}' "
                                               rf"\(\.{ext.replace('.', '[.]')}\) {what}") as info:
        shards.read(2)
    assert info.value.field == field
    # Through a feeder: raise names the field; skip drops that sample alone, counted.
    with Feeder(shards, 1, [ops.Resize(16), ops.CenterCrop(16)], shuffle=False,
                decode_threads=1, on_error="raise") as f:
        with pytest.raises(SampleError, match=r"s002") as err:
            batches(f)
    assert err.value.field == field and err.value.index == 2
    with Feeder(shards, 1, [ops.Resize(16), ops.CenterCrop(16)], shuffle=False,
                decode_threads=1, on_error="skip") as f:
        got = batches(f)
        assert f.stats().skipped == 1
    assert [int(bt["label"][0]) for bt in got] == [0, 1, 3]


def test_fields_configuration_errors(tmp_path, jpeg_blobs):
    path = _foreign(tmp_path / "c-000000.tar", jpeg_blobs)
    with pytest.raises(ValueError, match=r"fields names \.nope\.npy but no sample in .*c-000000\.tar"):
        TarShards(path, fields=["nope.npy"])
    with pytest.raises(ValueError, match=r"\.jpg, an image field"):
        TarShards(path, fields=["jpg"])
    with pytest.raises(ValueError, match=r"\.mask\.png and \.seg\.png would both be named 'mask'|"
                                         r"\.seg\.png and \.mask\.png would both"):
        with tarfile.open(tmp_path / "two.tar", "w") as tar:
            _add(tar, "a.jpg", jpeg_blobs[0])
            _add(tar, "a.seg.png", b"x")
            _add(tar, "b.jpg", jpeg_blobs[1])
            _add(tar, "b.mask.png", b"y")
        TarShards(str(tmp_path / "two.tar"))
    with pytest.raises(ValueError, match=r"'\*' spreads a JSON object's keys; \.txt is not JSON"):
        TarShards(path, fields={"txt": "*"})
    with pytest.raises(ValueError, match=r"fields='dict'"):
        TarShards(path, fields="dict")
    with pytest.raises(ValueError, match=r"would be named \"image\""):
        TarShards(path, fields={"txt": "image"})
    # A sample without a member fields= asks for.
    with tarfile.open(tmp_path / "gap.tar", "w") as tar:
        _add(tar, "a.jpg", jpeg_blobs[0])
        _add(tar, "a.boxes.npy", npy_array(np.zeros((0, 4), np.float32)))
        _add(tar, "b.jpg", jpeg_blobs[1])
    gap = TarShards(str(tmp_path / "gap.tar"), fields=["boxes.npy"], label=None)
    assert gap.read(0)["boxes"].shape == (0, 4)
    with pytest.raises(ShardFormatError, match=r"gap\.tar:b: field 'boxes' \(\.boxes\.npy\) missing"):
        gap.read(1)
    # "*" over a JSON that is not an object, or whose keys clash with a field.
    with tarfile.open(tmp_path / "spread.tar", "w") as tar:
        _add(tar, "a.jpg", jpeg_blobs[0])
        _add(tar, "a.json", b"[1, 2]")
        _add(tar, "a.cls", b"0")
        _add(tar, "b.jpg", jpeg_blobs[1])
        _add(tar, "b.json", b'{"label": 1}')
        _add(tar, "b.cls", b"1")
    spread = TarShards(str(tmp_path / "spread.tar"), fields={"json": "*", "cls": "label"},
                       label="cls")
    with pytest.raises(ShardFormatError, match=r"spread\.tar:a: field 'json' \(\.json\) is list, "
                                               r"not a JSON object"):
        spread.read(0)
    with pytest.raises(ShardFormatError, match=r"spread\.tar:b: field 'label' \(\.json\) is both"):
        spread.read(1)


def test_pack_refuses_what_it_cannot_store(tmp_path, jpeg_blobs):
    def source(make):
        class S:
            def __len__(self):
                return 3

            def read(self, i):
                return make(i)

            def describe(self, i):
                return f"mem://{i}"
        return S()

    cases = [
        ({"image": jpeg_blobs[0], "when": object()}, r"sample 1 \(mem://1\): field 'when' is object"),
        ((jpeg_blobs[0], 0.5), r"sample 1 \(mem://1\): its label is float64.*return a dict"),
        ({"image": jpeg_blobs[0], "mask": jpeg_blobs[1]}, r"sample 1 \(mem://1\): field 'mask' is "
                                                          r"not a PNG"),
        ({"image": jpeg_blobs[0], "a b": 1}, r"field 'a b': a packed field's name"),
        ({"image": b"not an image"}, r"field 'image' is not an image"),
        ({"image": jpeg_blobs[0], "box_labels": [1]}, r"sample 1 \(mem://1\):.*without \"boxes\""),
        ("a path", r"sample 1 \(mem://1\): .*read\(1\) returned str"),
    ]
    for k, (bad, msg) in enumerate(cases):
        good = {"image": jpeg_blobs[0]} if isinstance(bad, dict) else (jpeg_blobs[0], 0)
        src = source(lambda i, bad=bad, good=good: bad if i == 1 else good)
        out = tmp_path / f"out{k}"
        with pytest.raises(PackError, match=msg):
            pack(src, str(out))
        assert not [f for f in os.listdir(out) if f.endswith(".part")], "a temporary file is left"
    # A mask of another size than its image cannot be resized with it.
    h, w = cv2.imdecode(np.frombuffer(jpeg_blobs[0], np.uint8), cv2.IMREAD_UNCHANGED).shape[:2]
    src = source(lambda i: {"image": jpeg_blobs[0], "mask": np.zeros((h + 1, w), np.uint8)})
    with pytest.raises(PackError, match=rf"field 'mask' is \({h + 1}, {w}\) but its image is "
                                         rf"\({h}, {w}\) \(height, width\)"):
        pack(src, str(tmp_path / "sized"), max_side=8)


def test_cli_packs_a_source_named_module_colon_name(tmp_path, monkeypatch, capsys, det):
    src, _ = det
    module = tmp_path / "shard_fields_cli_source.py"
    module.write_text(
        "from feeder.synthetic import make_detection_set\n"
        "import numpy as np\n"
        "class Det:\n"
        "    def __init__(self):\n"
        f"        self.records = make_detection_set({str(tmp_path / 'set')!r}, count=5, "
        "size_range=(40, 50), seed=4)\n"
        "    def __len__(self):\n"
        "        return len(self.records)\n"
        "    def read(self, i):\n"
        "        r = self.records[i]\n"
        "        return {'image': open(r['image'], 'rb').read(), 'boxes': r['boxes'],\n"
        "                'box_labels': r['labels']}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["shard_fields_cli_source:Det", str(tmp_path / "out"), "-q", "--max-side", "30"]) == 0
    assert "5 samples in 1 shard in" in capsys.readouterr().out
    shards = TarShards(str(tmp_path / "out" / "train.json"))
    assert len(shards) == 5 and shards.read(0)["boxes"].dtype == np.float32
    assert main(["shard_fields_cli_source:Nope", str(tmp_path / "o2"), "-q"]) == 2
    assert "cannot find the source" in capsys.readouterr().err


def test_remote_dict_shard_one_request_per_sample(det, tmp_path, file_server):
    src, res = det
    local = TarShards(res.manifest)
    out = os.path.dirname(res.manifest)
    with file_server(out) as server:
        with TarShards(server.url + "/train.json", cache_dir=False, backoff_s=0.01) as remote:
            assert remote.plan == local.plan
            before = server.count()
            for i in range(len(remote)):
                assert_same(local.read(i), remote.read(i))
            ranges = server.count(lambda r: r.method == "GET" and r.path.endswith(".tar")
                                  and r.range is not None)
            assert ranges == len(remote) == server.count() - before  # all its fields in one request
