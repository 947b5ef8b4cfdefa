"""feeder.storage.sizes: byte sizes written as text (feeder-pack's --shard-size,
FEEDER_CACHE_BYTES)."""

from __future__ import annotations

import pytest

from feeder.storage.sizes import parse_size


def test_parse_size():
    assert parse_size("64MB") == 64_000_000
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("500") == 500
    for bad in ("", "12XB", "0", "-5MB"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("text, size", [
    ("1k", 1000), ("1KB", 1000), ("2m", 2_000_000), ("3G", 3_000_000_000), ("3gb", 3_000_000_000),
    ("1KiB", 1024), ("4mib", 4 << 20), ("2GIB", 2 << 30), ("7b", 7), ("7B", 7),
    ("1.5KB", 1500), ("0.5MiB", 1 << 19), ("  12 MB  ", 12_000_000),
])
def test_units_decimal_and_binary_any_case(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["MB", "1.2.3MB", "1 M B", "1e6", "64TB", "0x10", "-1", "+5"])
def test_not_a_size_names_the_text_and_gives_examples(bad):
    with pytest.raises(ValueError, match="not a size") as err:
        parse_size(bad)
    assert repr(bad) in str(err.value) and "64MB" in str(err.value)


@pytest.mark.parametrize("bad", ["0", "0KB", "0.0001KB", "0.4"])
def test_zero_is_refused_as_not_positive(bad):
    # A fraction that rounds down to no byte is no size either.
    with pytest.raises(ValueError, match="must be positive") as err:
        parse_size(bad)
    assert repr(bad) in str(err.value)
