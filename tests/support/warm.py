"""A warm interpreter for the command-line tests: one server process per test
process imports torch, OpenCV and feeder once, then forks a fresh child per
command, which runs ``python -m MODULE ARGV`` as the interpreter would (its
own process, working folder, environment, standard streams and exit status).

A cold ``python -m feeder.bench`` spends seconds importing torch before it
reads its first argument; the hostile-argument tests run dozens of commands
that fail on their arguments. What a fork cannot give, these commands do not
need: environment variables read when torch is imported (``OMP_NUM_THREADS``)
are already read. ``FEEDER_TEST_COLD_CLI=1`` runs every command cold instead.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tests.support import REPO_DIR

# The server: reads one JSON request a line; answers {"pid": ...} once it has
# forked, then {"status": ...} when the child is gone. The child replaces
# itself with the command: streams, folder, environment, argv, then runpy, as
# ``python -m`` runs a module; what escapes becomes its exit status exactly as
# the interpreter's own top level makes it (a traceback and 1, SystemExit's
# code), and the interpreter's shutdown (atexit, threads) runs as usual.
_SERVER = r"""
import json, os, runpy, sys
import cv2, numpy, torch
import feeder, feeder.bench.cli, feeder.doctor, feeder.pack.cli

def child(job):
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    for target, path in ((1, job["stdout"]), (2, job["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = [job["module"], *job["argv"]]
    # As the interpreter starts: the folder first, then PYTHONPATH's entries.
    extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *(p for p in sys.path[1:] if p not in extra)]
    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)

def serve():
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(job)  # the command's own exit, as the interpreter's
            return
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)

serve()
"""


# Bounds the server's answer that it forked (it answers at once; a hang is what
# this bounds).
FORK_TIMEOUT_S = 120


class WarmPython:
    """The server process; :meth:`run` is ``subprocess.run`` of one command."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.lock = threading.Lock()
        # What the server said and no caller has taken yet. Read here, with a
        # timeout, not by a thread of its own: a thread that lives as long as
        # the test process makes every later isolated Feeder's
        # start_method="auto" spawn instead of fork (seconds each).
        self._said = b""

    def run(self, module: str, argv: list[str], cwd: str, env: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            job = {"module": module, "argv": argv, "cwd": cwd, "env": env, "stdout": out,
                   "stderr": err}
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
            pid = json.loads(self._line(FORK_TIMEOUT_S))["pid"]
            try:
                status = json.loads(self._line(timeout))["status"]
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                self._line(FORK_TIMEOUT_S)  # the server reaped it
                raise subprocess.TimeoutExpired([module, *argv], timeout) from None
            with open(out) as f_out, open(err) as f_err:
                return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], status,
                                                   f_out.read(), f_err.read())

    def _line(self, timeout: float) -> str:
        """The server's next line, or TimeoutExpired after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._said:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired("warm interpreter", timeout)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the warm interpreter exited ({self.proc.wait(30)})")
            self._said += chunk
        line, _, self._said = self._said.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


_server: WarmPython | None = None
_server_lock = threading.Lock()


def warm_python(env: dict[str, str]) -> WarmPython | None:
    """This test process's server (started on first use), or None where commands
    run cold: no ``fork``, or ``FEEDER_TEST_COLD_CLI=1``."""
    global _server
    if not hasattr(os, "fork") or os.environ.get("FEEDER_TEST_COLD_CLI") == "1":
        return None
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = WarmPython(env)
        return _server


def run_module(module: str, argv: list[str], cwd: str, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """``python -m module argv`` in ``cwd`` with ``env``: forked from this test
    process's warm interpreter where there is one, else a cold subprocess."""
    warm = warm_python({**env, "PYTHONPATH": REPO_DIR})
    if warm is not None:
        return warm.run(module, argv, cwd, env, timeout)
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def close_warm_python() -> None:
    """Stop the server, if one runs (at the end of the test session)."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None
