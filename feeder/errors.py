"""The exceptions feeder raises.

Every failure inside the pipeline reaches the training loop from ``next()`` as
a :class:`FeederError`. Failures tied to one sample are :class:`SampleError`:
they name the stage, the sample index and the sample's path, and chain the
original exception as ``__cause__``.

Messages always encode as UTF-8: a file name that is not valid UTF-8 (which
Python holds with surrogate escapes, see :func:`os.fsdecode`) is shown with its
odd bytes as ``\\xNN`` (see :func:`safe_text`).
"""

from __future__ import annotations


def safe_text(text: str) -> str:
    """``text`` in a form that always encodes as UTF-8 (for messages and logs).

    Bytes of a file name that were not valid UTF-8 (surrogate escapes from
    :func:`os.fsdecode`) become ``\\xNN``; any other lone surrogate becomes
    ``\\udNNN``. Valid text is returned unchanged.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


class FeederError(RuntimeError):
    """Base class of the errors raised from a feeder's iterator."""


class FeederTimeoutError(FeederError, TimeoutError):
    """No batch arrived within ``Feeder(timeout=...)`` seconds; the message names the
    samples that were in a stage for longer than that (stage, index, path)."""


class StageError(FeederError):
    """A stage failed outside any one sample (a bug, or the source itself broke).

    Attributes:
        stage: Name of the stage (``"sampler"``, ``"decode"``, ``"augment"``, ``"transfer"``).
    """

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(safe_text(f"feeder stage {stage!r} failed: {message}"))
        self.stage = stage


class SampleError(FeederError):
    """Processing one sample failed.

    Attributes:
        stage: The stage that failed (``"read"``, ``"decode"`` or ``"augment"``).
        index: The sample's index in the source.
        path: The sample's path or description, exactly as the source describes
            it (a path that can be opened, even when it is not valid UTF-8); the
            message shows it through :func:`safe_text`.
    """

    def __init__(self, stage: str, index: int, path: str, cause: BaseException) -> None:
        detail = f"{type(cause).__name__}: {cause}"
        notes = getattr(cause, "__notes__", None)
        if notes:
            detail += f" ({'; '.join(str(n) for n in notes)})"
        super().__init__(safe_text(f"feeder stage {stage!r} failed on sample {index} ({path}): {detail}"))
        self.stage = stage
        self.index = index
        self.path = path
        self.__cause__ = cause

    def __reduce__(self):  # keep the exception picklable (pytest-xdist, multiprocessing)
        return (self.__class__, (self.stage, self.index, self.path, self.__cause__))


class DecodeError(ValueError):
    """Encoded bytes could not be decoded into an image (corrupt, unsupported or too large)."""


class TransformError(ValueError):
    """A transform returned something that does not fit the batch buffer."""


class ConfigError(TransformError):
    """The configuration does not fit the data: the transforms' output is not the
    batch's ``image_size``. Raised whatever ``on_error`` says, since every image of
    that size would fail alike; reaches the loop as a :class:`SampleError` naming
    the first sample found, with this as its cause."""
