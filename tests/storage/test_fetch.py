"""feeder.storage.fetch: which remote failures are retried and how they are
reported (Retrier), the index URL of a shard, and small whole files read within
a bound (fetch_bounded, fetch_small) through fsspec's in-memory file system."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from feeder.storage import http as _http
from feeder.storage.fetch import (RemoteError, Retrier, ShardChangedError, fetch_bounded, fetch_small,
                                  filesystem, remote_index_url)
from feeder.storage.tar import ShardFormatError

URL = "https://h/d/s.tar"


class Flaky:
    """Raises the given errors in turn, then returns ``"ok"``; counts its calls."""

    def __init__(self, *errors):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def _retrier(retries=3, stop=None):
    return Retrier(retries, 0.0, stop or threading.Event())


@pytest.mark.parametrize("retries, backoff", [(-1, 0.1), (True, 0.1), (1.5, 0.1), (2, -0.1),
                                              (2, float("nan"))])
def test_retrier_refuses_bad_settings(retries, backoff):
    with pytest.raises(ValueError, match="retries must be an int >= 0|backoff_s must be >= 0"):
        Retrier(retries, backoff, threading.Event())


@pytest.mark.parametrize("error", [
    ConnectionResetError("reset"), TimeoutError("slow"), _http.HTTPStatusError(503),
    _http.HTTPStatusError(429), _http.HTTPStatusError(408), _http.BadAnswer("short body"),
    OSError("io"),
])
def test_transient_failures_are_retried(error):
    fn = Flaky(error, error)
    assert _retrier(3)(URL, "read", fn) == "ok" and fn.calls == 3


def test_retries_run_out_naming_url_what_and_tries():
    fn = Flaky(*[ConnectionResetError("reset")] * 5)
    with pytest.raises(RemoteError) as err:
        _retrier(2)(URL, "range read", fn)
    assert fn.calls == 3
    msg = str(err.value)
    assert URL in msg and "range read failed after 3 tries" in msg and "ConnectionResetError" in msg


@pytest.mark.parametrize("error, kind, says", [
    (_http.HTTPStatusError(404), FileNotFoundError, "HTTP 404"),
    (FileNotFoundError("gone"), FileNotFoundError, "HTTP 404"),
    (_http.HTTPStatusError(403), RemoteError, "HTTP 403"),
    (PermissionError("no"), RemoteError, "HTTP 403"),
    (_http.HTTPStatusError(400), RemoteError, "HTTP 400"),
    (_http.RangesIgnored("no ranges"), RemoteError, "RangesIgnored"),
    (_http.TooLarge(10, 5), RemoteError, "TooLarge"),
    (ValueError("odd"), RemoteError, "ValueError"),
])
def test_permanent_failures_are_not_retried(error, kind, says):
    fn = Flaky(error)
    with pytest.raises(kind) as err:
        _retrier(5)(URL, "read", fn)
    assert fn.calls == 1 and URL in str(err.value) and says in str(err.value)
    assert err.value.__cause__ is error


@pytest.mark.parametrize("error", [ShardChangedError(f"{URL}: changed"), ShardFormatError(f"{URL}: bad")])
def test_errors_that_say_what_is_wrong_pass_through(error):
    fn = Flaky(error)
    with pytest.raises(type(error)) as err:
        _retrier(5)(URL, "read", fn)
    assert err.value is error and fn.calls == 1


def test_deadline_passed_is_a_stall():
    fn = Flaky(_http.DeadlinePassed())
    with pytest.raises(RemoteError, match="read stalled: no answer before the deadline"):
        _retrier(5)(URL, "read", fn)
    assert fn.calls == 1


def test_no_retry_past_the_deadline():
    fn = Flaky(ConnectionResetError("reset"))
    r = Retrier(5, 5.0, threading.Event())  # the first wait is 2.5 s at least
    with pytest.raises(RemoteError, match="the deadline leaves no time to retry"):
        r(URL, "read", fn, deadline=time.monotonic() + 1.0)
    assert fn.calls == 1


def test_stop_cuts_retries_short():
    stop = threading.Event()
    stop.set()
    fn = Flaky(ConnectionResetError("reset"), ConnectionResetError("reset"))
    with pytest.raises(RemoteError, match="failed after 1 tries"):
        Retrier(5, 60.0, stop)(URL, "read", fn)  # no 60 s wait: the reader is closing
    assert fn.calls == 1


def test_remote_index_url_keeps_the_query():
    assert remote_index_url("https://h/d/s-000.tar") == "https://h/d/s-000.idx"
    assert remote_index_url("s3://b/s.tar?X-Sig=a.tar&b=1") == "s3://b/s.idx?X-Sig=a.tar&b=1"


@pytest.fixture
def memfile():
    """A file in fsspec's in-memory file system, removed after the test."""
    fs, _ = filesystem("memory://x")
    path = f"/feeder-test-{uuid.uuid4().hex}/list.json"
    fs.pipe_file(path, b"0123456789")
    yield f"memory://{path}"
    fs.rm(path)


def test_filesystem_is_kept_per_protocol_and_options():
    a, path = filesystem("memory://one/two")
    b, _ = filesystem("memory://three")
    assert a is b and path == "/one/two"


def test_fetch_small_and_bounded(memfile):
    assert fetch_small(memfile) == b"0123456789"
    data, validator = fetch_bounded(memfile, 10, _retrier())
    assert data == b"0123456789" and validator is None


def test_fetch_bounded_refuses_a_larger_file_naming_it(memfile):
    with pytest.raises(RemoteError) as err:
        fetch_bounded(memfile, 9, _retrier())
    assert memfile in str(err.value) and "10 bytes, more than the 9 bytes" in str(err.value)
    with pytest.raises(RemoteError, match="more than the 4 bytes"):
        fetch_small(memfile, limit=4)


def test_fetch_of_a_missing_file_is_not_found(memfile):
    with pytest.raises(FileNotFoundError) as err:
        fetch_small(memfile + ".missing", retrier=_retrier(3))
    assert "list.json.missing" in str(err.value)


def test_filesystem_of_an_unknown_protocol_names_it():
    with pytest.raises((ImportError, ValueError), match="nosuchproto"):
        filesystem("nosuchproto://x/y")
