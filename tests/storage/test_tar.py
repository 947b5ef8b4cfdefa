"""feeder.storage.tar: member names, scanning a tar shard's headers, the DALI-format
offset index, and the shard list's image sizes."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from feeder.storage.tar import (MAX_RECORD_BYTES, ShardFormatError, ShardIndex, decode_image_sizes,
                         encode_image_sizes, index_path, scan, split_name)


def tar_bytes(members, fmt=tarfile.USTAR_FORMAT, end=True) -> bytes:
    """A tar archive of ``(name, data)`` members, in memory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    if not end:  # cut after the last member's data (its padding kept): no end-of-archive marker
        raw = raw.rstrip(b"\0")
        raw += bytes(-len(raw) % 512)
    return raw


def scan_bytes(raw: bytes, strict: bool = False):
    warnings: list[str] = []
    index = scan(lambda n, o: raw[o:o + n], len(raw), "s.tar", warnings.append, strict=strict)
    return index, warnings


def fields(raw: bytes, index: ShardIndex, sample: int) -> dict[str, bytes]:
    return {index.exts[m]: raw[index.offsets[m]:index.offsets[m] + index.sizes[m]]
            for m in index.members(sample)}


def test_split_name_and_index_path():
    assert split_name("a/b/x.seg.png") == ("a/b/x", "seg.png")
    assert split_name("dir.v2/x.JPG") == ("dir.v2/x", "jpg")
    assert split_name("a/.hidden.jpg") is None and split_name("noext") is None
    assert split_name("x.") is None
    assert index_path("/d/train-000001.tar") == "/d/train-000001.idx"
    assert index_path("http://h:1/d.x/s.v2-01.tar") == "http://h:1/d.x/s.v2-01.idx"


def test_scan_groups_members_by_key_and_finds_their_data():
    raw = tar_bytes([("a/0.jpg", b"J0"), ("a/0.cls", b"3"), ("a/1.jpg", b"J1" * 300),
                     ("a/1.cls", b"4"), ("._junk.jpg", b"x"), ("a/0.JSON", b"{}")])
    index, warnings = scan_bytes(raw)
    assert warnings == []
    assert index.keys == ["a/0", "a/1"] and len(index) == 2
    # A key's members need not be adjacent: a/0's json joins its sample.
    assert fields(raw, index, 0) == {"jpg": b"J0", "cls": b"3", "json": b"{}"}
    assert fields(raw, index, 1) == {"jpg": b"J1" * 300, "cls": b"4"}
    assert index.count_with("json") == 1 and index.count_with("jpg") == 2
    assert index.end == max(int(o + s) for o, s in zip(index.offsets, index.sizes))


def test_scan_reads_long_names_in_gnu_and_pax_headers():
    long = "d/" + "n" * 150
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        raw = tar_bytes([(long + ".jpg", b"img"), (long + ".cls", b"1")], fmt=fmt)
        index, warnings = scan_bytes(raw)
        assert warnings == [] and index.keys == [long], fmt
        assert fields(raw, index, 0) == {"jpg": b"img", "cls": b"1"}


def test_scan_warns_of_a_duplicate_member_and_keeps_the_first():
    raw = tar_bytes([("k.jpg", b"first"), ("k.jpg", b"second")])
    index, warnings = scan_bytes(raw)
    assert fields(raw, index, 0) == {"jpg": b"first"}
    assert len(warnings) == 1 and "s.tar" in warnings[0] and "duplicate member 'k.jpg'" in warnings[0]


def test_scan_skips_a_corrupt_header_to_the_next_valid_one():
    raw = bytearray(tar_bytes([("a.jpg", b"A" * 10), ("b.jpg", b"B" * 10)]))
    raw[0:512] = b"\xff" * 512  # the first header: garbage
    index, warnings = scan_bytes(bytes(raw))
    assert index.keys == ["b"]
    assert len(warnings) == 1 and "corrupt tar header at byte 0" in warnings[0]


def test_scan_refuses_what_is_not_a_shard():
    with pytest.raises(ShardFormatError, match="s.tar: empty file"):
        scan_bytes(b"")
    with pytest.raises(ShardFormatError, match="s.tar: not a tar shard.*<html>"):
        scan_bytes(b"<html>error page</html>".ljust(2048, b" "))


def test_scan_refuses_a_shard_cut_between_members():
    raw = tar_bytes([("a.jpg", b"A"), ("b.jpg", b"B")], end=False)
    with pytest.raises(ShardFormatError, match="s.tar: ends at byte .* after member 'b.jpg' without "
                                               "the tar end-of-archive marker"):
        scan_bytes(raw)


def test_scan_keeps_a_member_cut_inside_its_data_unless_strict():
    whole = tar_bytes([("a.jpg", b"A" * 100), ("b.jpg", b"B" * 2000)])
    raw = whole[:512 + 512 + 512 + 1000]  # inside b.jpg's data
    index, warnings = scan_bytes(raw)
    assert index.keys == ["a", "b"] and index.end > len(raw)  # reading b fails later, naming it
    assert len(warnings) == 1 and "shard ends inside member 'b.jpg'" in warnings[0]
    with pytest.raises(ShardFormatError, match="ends inside member 'b.jpg'.*truncated"):
        scan_bytes(raw, strict=True)


def test_scan_bounds_a_header_records_claimed_size():
    raw = bytearray(tar_bytes([("x" * 120 + ".jpg", b"A")], fmt=tarfile.GNU_FORMAT))
    assert raw[156:157] == b"L"  # the long-name record comes first
    raw[124:136] = b"%011o\0" % (MAX_RECORD_BYTES + 1)
    # The header's checksum must still hold for the header to count as valid.
    raw[148:156] = b" " * 8
    raw[148:156] = b"%06o\0 " % sum(raw[:512])
    with pytest.raises(ShardFormatError, match=f"claims {MAX_RECORD_BYTES + 1} bytes"):
        scan_bytes(bytes(raw))


def test_index_text_round_trip():
    raw = tar_bytes([("s/0.jpg", b"a"), ("s/0.cls", b"1"), ("s/1.jpg", b"bb")])
    index, _ = scan_bytes(raw)
    text = index.to_text()
    assert text.splitlines()[0] == "v1.2 2"
    again = ShardIndex.from_text(text, "s.idx")
    assert again.keys == index.keys and again.exts == index.exts and again.names == index.names
    assert np.array_equal(again.offsets, index.offsets) and np.array_equal(again.sizes, index.sizes)
    assert np.array_equal(again.start, index.start)


def test_an_index_cannot_write_names_with_whitespace():
    index = ShardIndex.from_members([("a b.jpg", 512, 3)])
    assert index.to_text() is None


def test_older_index_versions_have_no_member_names():
    index = ShardIndex.from_text("v1.1 2\njpg 512 10 cls 1024 1\njpg 1536 7\n", "old.idx")
    assert len(index) == 2 and index.exts == ["jpg", "cls", "jpg"]
    assert list(index.members(1)) == [2] and int(index.offsets[2]) == 1536


@pytest.mark.parametrize("text, message", [
    ("", "bad.idx: empty index file"),
    ("v9 1\n", "bad.idx: line 1 must be 'v1.2 <samples>'"),
    ("v1.2 two\n", "bad.idx: line 1: sample count 'two' is not an int"),
    ("v1.2 2\njpg 512 3 a.jpg\n", "bad.idx: line 1 announces 2 samples but the index has 1 lines"),
    ("v1.2 1\njpg 512 3\n", "bad.idx: line 2: expected groups of 4 values"),
    ("v1.2 1\njpg x 3 a.jpg\n", "bad.idx: line 2: offset/size of field 'jpg' are not ints"),
    ("v1.2 1\njpg -1 3 a.jpg\n", "bad.idx: line 2: negative offset or size"),
    ("v1.2 2\njpg 512 3 a.jpg\ncls 1024 1 a.cls\n", "bad.idx: 2 index lines but 1 distinct keys"),
])
def test_a_malformed_index_is_named_with_its_line(text, message):
    with pytest.raises(ShardFormatError) as info:
        ShardIndex.from_text(text, "bad.idx")
    assert str(info.value).startswith(message)


def test_image_sizes_round_trip_and_are_checked():
    sizes = np.array([[480, 640], [-1, -1], [1, 2]])
    text = encode_image_sizes(sizes)
    assert np.array_equal(decode_image_sizes(text, 3), sizes)
    assert decode_image_sizes(text, None).shape == (3, 2)
    for value, n in ((text, 2), ("not base64!", 3), (12, 3), (encode_image_sizes([[0, 5]]), 1),
                     (encode_image_sizes([[-2, 5]]), 1)):
        with pytest.raises(ValueError, match="image_sizes"):
            decode_image_sizes(value, n)


def test_the_shard_size_line_round_trips_and_is_checked():
    ix = ShardIndex.from_members([("a.jpg", 512, 10), ("a.cls", 1536, 1)])
    ix.shard_size = 10240
    text = ix.to_text()
    assert "# shard_size 10240\n" in text
    assert ShardIndex.from_text(text, "x.idx").shard_size == 10240
    assert ShardIndex.from_text(text.replace("# shard_size 10240\n", ""), "x.idx").shard_size is None
    for bad, match in (("# shard_size ten", "shard size"), ("# shard_size 1000", "past the 1000 bytes")):
        with pytest.raises(ShardFormatError, match=rf"x\.idx: .*{match}"):
            ShardIndex.from_text(text.replace("# shard_size 10240", bad), "x.idx")
