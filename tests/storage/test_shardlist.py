"""feeder.storage.shardlist: what names a set of tar shards (folders, brace
patterns, globs, lists, train.json shard lists) and what a list says of each shard."""

from __future__ import annotations

import json
import logging

import pytest

from feeder.storage import shardlist
from feeder.storage.shardlist import expand_braces, is_url, resolve
from feeder.storage.tar import ShardFormatError, encode_image_sizes

HASH = "AB" * 32


def test_expand_braces():
    assert expand_braces("t-{000..002}.tar") == ["t-000.tar", "t-001.tar", "t-002.tar"]
    assert expand_braces("{a,b}-{8..10}") == ["a-8", "a-9", "a-10", "b-8", "b-9", "b-10"]
    with pytest.raises(ValueError, match="backwards"):
        expand_braces("x{3..1}")


def test_expand_braces_edges():
    assert expand_braces("plain.tar") == ["plain.tar"]
    assert expand_braces("s-{7..7}.tar") == ["s-7.tar"]  # a one-element range
    # Padded to the first bound's width; numbers wider than it keep their digits.
    assert expand_braces("{08..11}") == ["08", "09", "10", "11"]
    assert expand_braces("{98..100}") == ["98", "99", "100"]
    assert expand_braces("x{a}y") == ["xay"]
    with pytest.raises(ValueError, match="integer bounds") as err:
        expand_braces("t-{a..c}.tar")
    assert "t-{a..c}.tar" in str(err.value)


def test_is_url():
    assert is_url("https://h/x.tar") and is_url("s3://b/k.tar")
    assert not is_url("file:///data/x.tar") and not is_url("/data/x.tar") and not is_url("x.tar")


def _touch(folder, *names):
    for n in names:
        (folder / n).write_bytes(b"")


def test_resolve_folder_glob_path_and_url(tmp_path):
    _touch(tmp_path, "b.tar", "a.tar", "c.idx", "notes.txt")
    assert resolve(tmp_path) == ([str(tmp_path / "a.tar"), str(tmp_path / "b.tar")], None, {})
    assert resolve(str(tmp_path / "*.idx"))[0] == [str(tmp_path / "c.idx")]
    assert resolve(f"file://{tmp_path}/a.tar")[0] == [str(tmp_path / "a.tar")]
    # A single path is taken as given (its absence is the reader's error, naming it).
    assert resolve(str(tmp_path / "missing.tar"))[0] == [str(tmp_path / "missing.tar")]
    assert resolve("https://host/d/s-{0..1}.tar")[0] == ["https://host/d/s-0.tar", "https://host/d/s-1.tar"]
    assert resolve("s3://bucket/one.tar") == (["s3://bucket/one.tar"], None, {})


def test_resolve_folder_with_glob_characters_in_its_name(tmp_path):
    odd = tmp_path / "run[1]"
    odd.mkdir()
    _touch(odd, "x.tar")
    assert resolve(str(odd))[0] == [str(odd / "x.tar")]


def test_resolve_nothing_found_names_the_place(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.tar shard in directory") as err:
        resolve(tmp_path)
    assert str(tmp_path) in str(err.value)
    with pytest.raises(FileNotFoundError, match="no file matches"):
        resolve(str(tmp_path / "*.tar"))


def test_resolve_list(tmp_path):
    names, classes, facts = resolve([tmp_path / "a.tar", "s-{0..1}.tar", "file:///d/x.tar",
                                     "https://h/y.tar"])
    assert names == [str(tmp_path / "a.tar"), "s-0.tar", "s-1.tar", "/d/x.tar", "https://h/y.tar"]
    assert classes is None and facts == {}
    with pytest.raises(TypeError, match="must be str or path-like, got 3"):
        resolve(["a.tar", 3])
    with pytest.raises(TypeError, match="expected a directory"):
        resolve(42)


def _write_list(path, entries, **extra):
    path.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": entries, **extra}))
    return path


def test_local_shard_list_names_classes_and_facts(tmp_path):
    lst = _write_list(tmp_path / "train.json", [
        {"url": "s-0.tar", "nsamples": 3, "filesize": 10240, "sha256": HASH},
        {"url": "/abs/s-1.tar", "nsamples": 0},
        {"url": "https://h/s-2.tar"},
    ], classes=["cat", "dog"])
    names, classes, facts = resolve(lst)
    assert names == [f"{tmp_path}/s-0.tar", "/abs/s-1.tar", "https://h/s-2.tar"]
    assert classes == ["cat", "dog"]
    assert facts[names[0]] == {"nsamples": 3, "filesize": 10240, "sha256": HASH.lower()}
    assert facts[names[1]] == {"nsamples": 0} and facts[names[2]] == {}


def test_shard_list_image_sizes(tmp_path, caplog):
    sizes = [[10, 20], [30, 40]]
    lst = _write_list(tmp_path / "l.json", [
        {"url": "a.tar", "nsamples": 2, "image_sizes": encode_image_sizes(sizes)},
        {"url": "b.tar", "nsamples": 3, "image_sizes": encode_image_sizes(sizes)},
    ])
    with caplog.at_level(logging.WARNING, logger="feeder.shards"):
        names, _, facts = resolve(lst)
    assert facts[names[0]]["image_sizes"].tolist() == sizes
    # A count that disagrees: the hint is dropped, with a warning naming the shard.
    assert "image_sizes" not in facts[names[1]] and facts[names[1]]["nsamples"] == 3
    assert "'b.tar'" in caplog.text and "nsamples 3" in caplog.text
    bad = _write_list(tmp_path / "bad.json", [{"url": "a.tar", "image_sizes": "AAA"}])
    with pytest.raises(ShardFormatError, match="shard 'a.tar'"):
        resolve(bad)


@pytest.mark.parametrize("entry, what", [
    ({"url": "a.tar", "nsamples": -1}, "nsamples -1 is not an int >= 0"),
    ({"url": "a.tar", "nsamples": True}, "nsamples True is not an int >= 0"),
    ({"url": "a.tar", "filesize": "9"}, "filesize '9' is not an int >= 0"),
    ({"url": "a.tar", "sha256": "abc"}, "sha256 'abc' is not a sha256 hex digest"),
    # Counts no shard can hold (their sum would pass the 64-bit sample numbers):
    ({"url": "a.tar", "nsamples": 2**62}, f"nsamples {2**62} is more than a shard holds (at most {2**32})"),
    ({"url": "a.tar", "nsamples": 10**30}, "nsamples 1000000000000000000000000000000 is more than"),
    ({"url": "a.tar", "nsamples": 101, "filesize": 51200},
     "nsamples 101 is more than a shard of 51200 bytes can hold (one 512-byte tar header per member: "
     "at most 100)"),
])
def test_shard_list_bad_fact_names_list_shard_and_key(tmp_path, entry, what):
    lst = _write_list(tmp_path / "train.json", [entry])
    with pytest.raises(ShardFormatError) as err:
        resolve(lst)
    assert str(lst) in str(err.value) and "shard 'a.tar'" in str(err.value) and what in str(err.value)


@pytest.mark.parametrize("text", [
    "not json", "[]", '{"shardlist": [{"name": "a.tar"}]}', '{"shardlist": [{"url": ""}]}',
    '{"shardlist": [{"url": 5}]}', '{"shardlist": 3}',
])
def test_not_a_shard_list(tmp_path, text):
    path = tmp_path / "train.json"
    path.write_text(text)
    with pytest.raises(ShardFormatError, match="not a shard list") as err:
        resolve(path)
    assert str(path) in str(err.value)


def test_deeply_nested_list_is_a_format_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ShardFormatError, match="nested too deeply"):
        resolve(path)


def _remote(entries, where):
    return shardlist._manifest(json.dumps({"shardlist": [{"url": u} for u in entries]}), where)[0]


def test_remote_list_entries_join_its_location():
    assert _remote(["a.tar", "sub/b.tar", "https://o/c.tar"], "https://h/d/train.json") == [
        "https://h/d/a.tar", "https://h/d/sub/b.tar", "https://o/c.tar"]
    # '..' and a query: the web's joining rules (the query is not part of the folder).
    assert _remote(["../x.tar"], "https://h/d/e/train.json?sig=1") == ["https://h/d/x.tar"]
    # Other schemes join the same way, '..' staying inside the bucket.
    assert _remote(["../x.tar", "./y.tar"], "s3://bucket/a/b/list.json") == [
        "s3://bucket/a/x.tar", "s3://bucket/a/b/y.tar"]
    assert _remote(["../../../x.tar"], "s3://bucket/a/list.json") == ["s3://bucket/x.tar"]


@pytest.mark.parametrize("entry", ["/etc/passwd", "file:///etc/passwd", "~/x.tar", "file:x"])
def test_remote_list_may_not_name_local_files(entry):
    with pytest.raises(ShardFormatError, match="names a local file") as err:
        _remote([entry], "https://h/d/train.json")
    assert "https://h/d/train.json" in str(err.value) and repr(entry) in str(err.value)


def test_remote_list_entry_neither_relative_nor_url():
    with pytest.raises(ShardFormatError, match="not a relative name or a URL"):
        _remote(["c:odd"], "https://h/d/train.json")
