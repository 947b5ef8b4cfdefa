"""The command lines run as a user runs them (a process of their own, forked
from a warm interpreter: see :mod:`tests.support.warm`), over hostile
arguments, and what their failure must look like: a non-zero exit status, no
traceback, and a last line on stderr naming what is at fault.

Also importable as ``tests.support.cli:NAME`` by the commands (the tests put the
repository on ``PYTHONPATH``): user code that raises, a factory of the wrong thing.
"""

from __future__ import annotations

import os
import socket
import subprocess

import numpy as np
import simplejpeg

from tests.support import REPO_DIR
from tests.support.warm import run_module

# A command's start (torch's import) takes a few seconds; on a busy machine
# much longer. A hang is what this bounds, not the speed.
TIMEOUT_S = 300


def raising_step(images, labels):
    raise ValueError("the step blew up")


def raising_source():
    raise RuntimeError("the source blew up")


def forty_two():
    return 42


class BrokenReads:
    """A source whose every read fails."""

    def __len__(self) -> int:
        return 8

    def read(self, index: int):
        raise OSError(f"disk gone at {index}")


class NoneAtTwo:
    """A source whose sample 2 is None (not a sample), the others small pairs."""

    def __len__(self) -> int:
        return 8

    def read(self, index: int):
        import numpy as np  # noqa: PLC0415

        return None if index == 2 else (np.zeros((8, 8, 3), np.uint8), index)


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hostile_files(root) -> dict[str, str]:
    """Tiny inputs: a folder of 8 small JPEGs in 2 classes, a folder of files
    named .jpg that are not images, an empty folder, a class folder with no
    image, a plain file, a missing path, a file list naming a missing file and a
    closed port."""
    photos = root / "photos"
    for c in range(2):
        os.makedirs(photos / f"c{c}")
        for i in range(4):
            img = np.full((24, 32, 3), 40 * i + c, np.uint8)
            (photos / f"c{c}" / f"{i}.jpg").write_bytes(simplejpeg.encode_jpeg(img, colorspace="RGB"))
    os.makedirs(root / "notimg" / "a")
    for i in range(4):
        (root / "notimg" / "a" / f"{i}.jpg").write_bytes(b"not an image at all")
    os.makedirs(root / "empty")
    os.makedirs(root / "noimage" / "a")
    (root / "afile").write_text("x\n")
    (root / "list.txt").write_text("gone.jpg 0\n")
    (root / "latin1.txt").write_bytes(b"ok.jpg 0\ncaf\xe9.jpg 1\n")
    return {"latin1": str(root / "latin1.txt"),
            "photos": str(photos), "notimg": str(root / "notimg"), "empty": str(root / "empty"),
            "noimage": str(root / "noimage"), "afile": str(root / "afile"),
            "missing": str(root / "missing"), "list": str(root / "list.txt"),
            "port": str(closed_port())}


def run_cli(module: str, argv: list[str], files: dict[str, str], cwd) -> subprocess.CompletedProcess:
    """``python -m module argv`` in ``cwd``, with ``{name}`` in ``argv`` replaced from
    ``files`` (``{out}``: a folder of this run's own, under ``cwd``)."""
    files = {**files, "out": os.path.join(str(cwd), "out")}
    argv = [a.format(**files) for a in argv]
    env = {**os.environ, "PYTHONPATH": REPO_DIR}
    return run_module(module, argv, str(cwd), env, TIMEOUT_S)


def assert_one_line_error(r: subprocess.CompletedProcess, prog: str, names: list[str],
                          files: dict[str, str], status: int | None = None) -> None:
    """A failure said in one line: non-zero status (``status`` if given), no
    traceback, the last stderr line ``PROG: error: ...`` holding every name."""
    err = r.stderr
    assert r.returncode != 0, (r.returncode, err)
    if status is not None:
        assert r.returncode == status, (r.returncode, err)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: "), err
    for name in names:
        assert name.format(**files) in last, (name, last)
