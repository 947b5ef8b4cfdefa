"""The helper scripts of the checkout: scripts/env.sh sets up the virtual
environment that docs.sh, example.sh and test.sh share."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

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


def _example(name: str, argv: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["train_loop.py", "train_segmentation.py", "train_detection.py"])
@pytest.mark.parametrize("argv, says", [(["--epochs", "0"], "--epochs must be at least 1"),
                                        (["--batch-size", "0"], "batch_size must be a positive int")])
def test_the_examples_end_bad_arguments_in_one_line(tmp_path, name, argv, says):
    """The main job's scripts: a bad argument is one line naming it, no traceback."""
    r = _example(name, [*argv, "--images", "20"] if "epochs" not in argv else argv, tmp_path)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert says in r.stderr.strip().splitlines()[-1], r.stderr


def test_the_training_loop_names_a_missing_data_folder(tmp_path):
    r = _example("train_loop.py", ["--data", str(tmp_path / "nowhere")], tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    missing = str(tmp_path / "nowhere")
    assert r.stderr.strip() == f"train_loop.py: error: ImageFolder: {missing!r} is not a directory"
