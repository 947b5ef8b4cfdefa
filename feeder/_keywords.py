"""The Feeder's keywords: its options' names, and an unknown keyword answered
as the option table answers it rather than with Python's bare TypeError."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import fields
from typing import ParamSpec, TypeVar

from .engine.config import DEFAULTS, Config, unknown_options_message

__all__ = ["OPTION_NAMES", "answer_unknown_keywords"]

# Feeder's keyword-only options: every entry of the option table but batch_size.
OPTION_NAMES = frozenset(DEFAULTS)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def answer_unknown_keywords(init: Callable[_P, _R]) -> Callable[_P, _R]:
    """``init`` with a keyword it does not take answered as the option table
    answers it (DataLoader's keywords with what to pass instead, a misspelling
    with the option meant), not with Python's bare TypeError. Editors, type
    checkers and ``inspect.signature`` see ``init``'s own parameters."""
    accepted = {"source", "batch_size", "transforms"} | OPTION_NAMES

    @functools.wraps(init)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(unknown_options_message(unknown, [f.name for f in fields(Config)]))
        return init(*args, **kwargs)
    return checked
