"""The command-line tests' warm interpreter (tests/support/warm.py) runs a
command as a cold ``python -m`` does: the same exit status, streams, folder,
arguments and environment."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import REPO_DIR
from tests.support.warm import WarmPython

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the warm interpreter forks")


@pytest.fixture(scope="module")
def warm():
    server = WarmPython({**os.environ, "PYTHONPATH": REPO_DIR})
    yield server
    server.close()


@pytest.mark.parametrize("what", ["ok", "exit-3", "raise", "message"])
def test_a_forked_command_ends_as_a_cold_one(warm, tmp_path, what):
    env = {**os.environ, "PYTHONPATH": REPO_DIR, "PROBE_VALUE": f"v-{what}"}
    argv = [what, "--flag"]
    cold = subprocess.run([sys.executable, "-m", "tests.support.exit_probe", *argv],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    hot = warm.run("tests.support.exit_probe", argv, str(tmp_path), env, 120)
    assert hot.returncode == cold.returncode
    assert hot.stdout == cold.stdout == f"{tmp_path} {argv!r} v-{what}\n"
    assert hot.stderr.splitlines()[0] == cold.stderr.splitlines()[0] == "to stderr"
    assert hot.stderr.splitlines()[-1] == cold.stderr.splitlines()[-1]
    assert ("Traceback" in hot.stderr) == ("Traceback" in cold.stderr) == (what == "raise")


def test_a_command_that_hangs_is_killed_at_its_timeout(warm, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run("tests.support.exit_probe", ["hang"], str(tmp_path),
                 {**os.environ, "PYTHONPATH": REPO_DIR}, 1.0)
    # The server goes on serving.
    assert warm.run("tests.support.exit_probe", ["exit-0"], str(tmp_path),
                    {**os.environ, "PYTHONPATH": REPO_DIR}, 120).returncode == 0
