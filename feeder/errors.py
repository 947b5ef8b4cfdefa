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

from collections.abc import Callable


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
        self._message = message

    def __reduce__(self):  # picklable with its attributes (the isolated engine's errors cross processes)
        return (_rebuild, (self.__class__, (self.stage, self._message), self.__cause__))


class SampleError(FeederError):
    """Processing one sample failed.

    Attributes:
        stage: The stage that failed (``"read"``, ``"decode"`` or ``"augment"``).
        index: The sample's index in the source.
        path: The sample's path or description, exactly as the source describes
            it (a path that can be opened, even when it is not valid UTF-8); the
            message shows it through :func:`safe_text`.
        field: The sample's field that failed (``"mask"``, ``"boxes"``,
            ``"label"``...), when the failure is one field's; else None.
    """

    def __init__(self, stage: str, index: int, path: str, cause: BaseException) -> None:
        detail = f"{type(cause).__name__}: {cause}"
        notes = getattr(cause, "__notes__", None)
        if notes:
            detail += f" ({'; '.join(str(n) for n in notes)})"
        self.field: str | None = getattr(cause, "field", None)
        where = f", field {self.field!r}" if self.field is not None else ""
        super().__init__(safe_text(f"feeder stage {stage!r} failed on sample {index} ({path}){where}: "
                                   f"{detail}"))
        self.stage = stage
        self.index = index
        self.path = path
        self.__cause__ = cause

    def __reduce__(self):  # keep the exception picklable (pytest-xdist, multiprocessing)
        return (self.__class__, (self.stage, self.index, self.path, self.__cause__))


def _rebuild(cls: type, args: tuple, cause: BaseException | None) -> BaseException:
    err = cls(*args)
    err.__cause__ = cause
    return err


class DecodeError(ValueError):
    """Encoded bytes could not be decoded into an image (corrupt, unsupported or too large)."""


class TransformError(ValueError):
    """A transform returned something that does not fit the batch buffer."""


class ConfigError(TransformError):
    """The configuration does not fit the data: the transforms' output is not the
    batch's ``image_size``, a field's shape or dtype differs between samples, a
    plain transform changes the geometry of a sample with a mask or boxes, or
    the source's ``read`` returns something that is not a sample
    (:class:`SourceError`). Raised whatever ``on_error`` says, since every
    sample would fail alike; reaches the loop as a :class:`SampleError` naming
    the first sample found, with this as its cause."""

    #: The field concerned, when there is one (see :attr:`SampleError.field`).
    field: str | None = None


class SourceError(ConfigError, TypeError):
    """A source's ``read`` returned something that is not a sample: neither
    ``(image, label)`` nor a dict with an image under ``"image"`` (an image is
    encoded bytes, a uint8 array or tensor, or a PIL image).
    The message says what ``read`` must return and names the source's class and
    the sample. A mistake in the source, never skipped."""


class FieldError(ValueError):
    """One field of a sample is malformed (boxes that are not ``[N, 4]``, a mask
    that is not a single-channel PNG, a per-box array of another length...).

    A fault of that sample's data, so ``on_error="skip"`` skips it.

    Attributes:
        field: The field's name.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"field {field!r} {message}")
        self.field = field

    def __reduce__(self):
        return (self.__class__, (self.field, str(self).split(" ", 2)[2]))


def with_field(exc: BaseException, field: str) -> BaseException:
    """Mark ``exc`` as a failure of ``field`` (shown by :class:`SampleError`); returns it."""
    if getattr(exc, "field", None) is None:
        try:
            exc.field = field  # type: ignore[attr-defined]
        except AttributeError:  # an exception type with __slots__
            exc.add_note(f"field {field!r}")
    return exc


class UserCodeError(RuntimeError):
    """Code a command line was pointed at (``MODULE:NAME``: a source, a factory,
    transforms, a model step) raised. The message says which argument named it
    and what it raised; the original is chained as ``__cause__``."""


def call_user(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, with anything it raises turned into a
    :class:`UserCodeError` whose message starts with ``what`` (the argument
    that named ``fn``, as in ``"--model mymodel:train_step"``)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise UserCodeError(f"{what} raised {type(exc).__name__}: {exc}") from exc


def error_line(exc: BaseException) -> str:
    """``exc`` as the one line a command prints for it after ``PROG: error: ``.

    feeder's own errors, ``ValueError`` and ``OSError`` name what is at fault in
    their message; any other type is shown before its message (a bare
    ``KeyError`` says ``'x'``). Line breaks in the message become ``"; "``.
    """
    text = str(exc)
    own = type(exc).__module__.split(".")[0] == "feeder" or type(exc) is ValueError
    if not (own or isinstance(exc, OSError)) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return safe_text("; ".join(line.strip() for line in text.splitlines() if line.strip()))


def run_script(main: Callable[[], object]) -> None:
    """Run a script's ``main()``: a bad argument or input ends the process in one
    line, ``SCRIPT: error: ...`` (:func:`error_line`, exit status 1), and Ctrl-C
    with status 130, instead of a traceback (``if __name__ == "__main__":
    run_script(main)``)."""
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415

    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - said in one line, as feeder's commands do
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {error_line(exc)}")


def name_tuple(value: object, what: str) -> tuple[str, ...]:
    """An option that names things (file extensions, fields) as a tuple of
    strings; one string names one thing (as torchvision's ``extensions``), never
    one per character.

    Raises:
        TypeError: ``what`` (the option, with its owner) is neither a string nor
            an iterable of strings.
    """
    if isinstance(value, str):
        return (value,)
    try:
        names = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be a string or a list of strings, got "
                        f"{type(value).__name__}") from None
    bad = [v for v in names if not isinstance(v, str)]
    if bad:
        raise TypeError(f"{what} must be a string or a list of strings, got "
                        f"{type(bad[0]).__name__} {bad[0]!r} in it")
    return names
