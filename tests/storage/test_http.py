"""The HTTP reads of remote shards (``feeder/storage/http.py``) against a real
server on the loopback interface: a range is exactly the bytes asked for or an
error that says what the server did; a whole copy is all of its bytes, bounded,
with its hash; a file's version is told by size, ETag and Last-Modified.
(The same through TarShards and a Feeder: tests/storage/test_storage_hostile.py.)"""

from __future__ import annotations

import hashlib
import io
import threading
import time

import pytest

from feeder.storage.http import (DeadlinePassed, HTTPStatusError, RangesIgnored, TooLarge,
                                 Validator, is_http, read_range, read_whole)

pytest.importorskip("aiohttp")
fsspec = pytest.importorskip("fsspec")

DATA = bytes(range(256)) * 40  # 10240 bytes
T = 10.0  # deadline of every request, seconds


@pytest.fixture
def server(tmp_path, file_server):
    (tmp_path / "f.bin").write_bytes(DATA)
    with file_server(tmp_path) as srv:
        yield srv


@pytest.fixture
def fs():
    return fsspec.filesystem("http", skip_instance_cache=True)


def deadline() -> float:
    return time.monotonic() + T


def test_a_range_is_the_bytes_asked_for_with_the_files_validator(server, fs):
    body, seen = read_range(fs, server.url + "/f.bin", 100, 300, threading.Event(), deadline())
    assert body == DATA[100:300]
    assert seen.size == len(DATA) and seen.etag and seen.modified
    # Past the end: fewer bytes, only because the file ends there.
    body, _ = read_range(fs, server.url + "/f.bin", len(DATA) - 10, len(DATA) + 50, threading.Event(),
                         deadline())
    assert body == DATA[-10:]
    with pytest.raises(HTTPStatusError, match="416.*shorter than its index"):
        read_range(fs, server.url + "/f.bin", len(DATA) + 5, len(DATA) + 9, threading.Event(), deadline())


def test_a_server_that_ignores_ranges_is_named(tmp_path, fs, file_server):
    (tmp_path / "f.bin").write_bytes(DATA)
    with file_server(tmp_path, ignore_ranges=True) as srv:
        with pytest.raises(RangesIgnored, match="status 200"):
            read_range(fs, srv.url + "/f.bin", 0, 10, threading.Event(), deadline())


def test_error_statuses_and_cut_bodies_are_errors(server, fs):
    url = server.url + "/f.bin"
    server.fail("f.bin", 404)
    with pytest.raises(HTTPStatusError) as caught:
        read_range(fs, url, 0, 10, threading.Event(), deadline())
    assert caught.value.status == 404
    server.fail("f.bin", "truncate", whole=True)  # half the body, then the connection closes
    with pytest.raises(Exception) as caught:
        read_whole(fs, url, threading.Event(), deadline=deadline())
    assert "ended after" in str(caught.value) or "payload" in str(caught.value).lower(), caught.value
    # Half the body with a Content-Length saying so looks complete to HTTP: what
    # comes back says its size, which the caller checks against the file's.
    server.fail("f.bin", "shortlen", whole=True)
    body, seen, _ = read_whole(fs, url, threading.Event(), deadline=deadline())
    assert seen.size == len(body) < len(DATA) and DATA.startswith(body)
    body, _, digest = read_whole(fs, url, threading.Event(), deadline=deadline())  # faults used up
    assert body == DATA and digest == hashlib.sha256(DATA).hexdigest()


def test_a_whole_copy_is_bounded_and_hashed(server, fs):
    url = server.url + "/f.bin"
    out = io.BytesIO()
    body, seen, digest = read_whole(fs, url, threading.Event(), out=out, deadline=deadline())
    assert body is None and out.getvalue() == DATA and seen.size == len(DATA)
    assert digest == hashlib.sha256(DATA).hexdigest()
    with pytest.raises(TooLarge) as caught:
        read_whole(fs, url, threading.Event(), limit=1000, deadline=deadline())
    assert caught.value.size == len(DATA) and caught.value.limit == 1000  # refused from the header


def test_a_stalled_answer_ends_at_the_deadline_or_on_stop(server, fs):
    url = server.url + "/f.bin"
    server.fail("f.bin", "stall")
    with pytest.raises(DeadlinePassed):
        read_range(fs, url, 0, 10, threading.Event(), time.monotonic() + 0.3)
    server.fail("f.bin", "stall")
    stop = threading.Event()
    stop.set()
    with pytest.raises(InterruptedError):
        read_whole(fs, url, stop, deadline=deadline())


def test_the_clients_own_read_timeout_is_an_error_not_a_wait(server):
    """A server that stops answering, with no deadline: the client's socket read
    timeout (a TimeoutError, as "not done yet" is on Python 3.11+) ends the read
    with that error, rather than being taken for a request still under way."""
    aiohttp = pytest.importorskip("aiohttp")
    fs = fsspec.filesystem("http", skip_instance_cache=True,
                           client_kwargs={"timeout": aiohttp.ClientTimeout(sock_read=0.3)})
    server.fail("f.bin", "stall")
    got: list[BaseException] = []

    def read() -> None:
        try:
            read_range(fs, server.url + "/f.bin", 0, 10, threading.Event(), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            got.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(T)
    assert not reader.is_alive(), "the read is still waiting after its socket timed out"
    assert len(got) == 1 and isinstance(got[0], TimeoutError) and not isinstance(got[0], DeadlinePassed)


def test_validators_compare_only_what_both_know():
    old = Validator(100, '"a"', "Mon, 01 Jan 2024 00:00:00 GMT")
    assert Validator(100, '"a"', None).change_from(old) is None
    assert Validator(None, None, None).change_from(old) is None
    assert Validator(101, '"b"', None).change_from(old) == "size 100 -> 101, ETag '\"a\"' -> '\"b\"'"
    assert Validator(None, '"b"', None).merged(old) == Validator(100, '"b"', old.modified)
    assert Validator.from_dict(old.to_dict()) == old


@pytest.mark.parametrize("saved", [None, [], "x", {"size": -1}, {"size": "100"}, {"size": 1.5},
                                   {"etag": 7}, {"modified": b"x"}])
def test_a_damaged_saved_validator_is_not_trusted(saved):
    assert Validator.from_dict(saved) is None


def test_is_http_by_protocol(fs):
    assert is_http(fs)
    assert not is_http(fsspec.filesystem("memory"))
    assert not is_http(object())
