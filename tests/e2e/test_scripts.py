"""The helper scripts of the checkout: scripts/env.sh sets up the virtual
environment that docs.sh, example.sh and test.sh share."""

from __future__ import annotations

import os
import stat
import subprocess
from tests.support import REPO_DIR

ROOT = REPO_DIR


def _env_sh(venv: str, extras: str) -> subprocess.CompletedProcess:
    # CC=true: the "headers" check passes without a compiler, so the script never reaches for apt-get.
    env = {**os.environ, "FEEDER_VENV": venv, "FEEDER_EXTRAS": extras, "CC": "true"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "env.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_scripts_wanting_other_extras_share_one_installation(tmp_path):
    """docs.sh (test,docs) then example.sh (test) then docs.sh again: one
    installation, of the union, not one per switch."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    python = venv / "bin" / "python"
    # A stand-in interpreter: torch "imports", and pip only records what it was asked.
    python.write_text(f'#!/bin/sh\nif [ "$1" = -m ]; then echo "$@" >> "{log}"; fi\nexit 0\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    for extras in ("test,docs", "test", "test,docs", "test"):
        assert _env_sh(str(venv), extras).stdout.strip() == str(python)
    installs = log.read_text().splitlines()
    assert len(installs) == 1 and installs[0].endswith(f"-e {ROOT}[docs,test]"), installs
    _env_sh(str(venv), "bench")  # an extra not yet there: installed with the others
    installs = log.read_text().splitlines()
    assert len(installs) == 2 and installs[1].endswith(f"-e {ROOT}[bench,docs,test]"), installs
