"""The two examples that train on the generated segmentation and detection sets,
and the segmentation guide's DataLoader port (docs/guides/segmentation.md), run as
written."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from tests.support import JOIN_TIMEOUT_S, REPO_DIR
from feeder.synthetic import CLASS_COLORS, make_segmentation_set

ROOT = REPO_DIR
GUIDE = os.path.join(ROOT, "docs", "guides", "segmentation.md")


def run_example(name: str, tmp_path) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", f"train_{name}.py"),
                          "--epochs", "2", "--images", "32", "--batch-size", "8", "--device", "cpu"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(300)  # a whole training run in a child process, on a possibly busy machine
def test_the_segmentation_example_trains(tmp_path):
    out = run_example("segmentation", tmp_path)
    losses = [float(m) for m in re.findall(r"loss ([0-9.]+), pixel accuracy", out)]
    assert len(losses) == 2 and losses[1] < losses[0], out
    assert "feeder:" in out and "32 images, 4 classes" in out


@pytest.mark.timeout(300)
def test_the_detection_example_trains(tmp_path):
    out = run_example("detection", tmp_path)
    losses = [float(m) for m in re.findall(r"loss ([0-9.]+), recall", out)]
    assert len(losses) == 2 and losses[1] < losses[0], out


def section_blocks() -> list[str]:
    text = open(GUIDE, encoding="utf-8").read()
    section = text[text.index("## From a DataLoader segmentation loop"):]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_guide_port_runs_as_written(tmp_path):
    before, after = section_blocks()
    ast.parse(before)  # torchvision is not a dependency: the "before" block is only parsed here
    make_segmentation_set(tmp_path / "data" / "seg", count=20, size_range=(100, 140), seed=2)
    code = after.replace('device="cuda"', 'device="cpu"')
    assert 'device="cpu"' in code
    scope: dict = {}
    errors: list[BaseException] = []

    def run():
        try:
            exec(compile(code, "docs/guides/segmentation.md (From a DataLoader segmentation loop, after)",
                         "exec"), scope)
        except BaseException as exc:  # handed to the test's thread below
            errors.append(exc)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the block reads data/seg/ under the working directory
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join(JOIN_TIMEOUT_S * 2)
    finally:
        os.chdir(cwd)
    assert not t.is_alive(), "the guide's block did not finish"
    if errors:
        raise errors[0]
    images, masks = scope["images"], scope["masks"]
    assert images.shape == (16, 3, 96, 96) and images.dtype == torch.float32
    assert masks.shape == (16, 96, 96) and masks.dtype == torch.int64
    assert scope["loader"].closed
    # The crop and flip were the image's: the mask's classes sit on their colours.
    mean, std = torch.tensor(scope["MEAN"]).view(3, 1, 1), torch.tensor(scope["STD"]).view(3, 1, 1)
    rgb = ((images * std + mean) * 255).permute(0, 2, 3, 1)
    for c in range(1, 4):
        here = masks == c
        if here.sum() > 50:
            mean_color = rgb[here].mean(0)
            assert (mean_color - torch.tensor(CLASS_COLORS[c]) * 0.95).abs().max() < 45, (c, mean_color)


def run_reference(name: str, tmp_path, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", f"reference_{name}.py"),
                          "--steps", "3", "--device", "cpu", *args],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(300)  # a child process on a possibly busy machine
def test_the_segmentation_reference_port_runs(tmp_path):
    out = run_reference("segmentation", tmp_path)
    assert len(re.findall(r"train step \d: images \(8, 3, 48, 48\)", out)) == 3, out
    sizes = re.findall(r"eval step \d: native size (\d+)x(\d+)", out)
    assert len(sizes) == 3 and all(min(int(h), int(w)) == 52 for h, w in sizes), out


@pytest.mark.timeout(300)
def test_the_detection_reference_port_runs(tmp_path):
    out = run_reference("detection", tmp_path)
    padded = re.findall(r"train step \d: padded \(4, 3, (\d+), (\d+)\)", out)
    assert len(padded) == 3 and all(int(h) % 32 == 0 and int(w) % 32 == 0 for h, w in padded), out
    assert len(re.findall(r"eval step \d: native size \d+x\d+", out)) == 3, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["hflip", "multiscale"])
@pytest.mark.parametrize("model", ["maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn"])
def test_the_mask_and_keypoint_rcnn_reference_ports_run(tmp_path, model, preset):
    out = run_reference("instances", tmp_path, "--model", model, "--data-augmentation", preset)
    steps = re.findall(r"train step \d: padded \(2, 3, (\d+), (\d+)\), images \[(.*)\], (\d+) instances", out)
    assert len(steps) == 3 and all(int(h) % 32 == 0 and int(w) % 32 == 0 for h, w, _, _ in steps), out
    assert sum(int(n) for *_, n in steps) > 0, out
    if preset == "multiscale":  # the shorter side drawn from 480..800
        sides = [min(int(v) for v in hw) for hw in re.findall(r"\((\d+), (\d+)\)", " ".join(s[2] for s in steps))]
        assert all(480 <= side <= 800 for side in sides), out
    assert len(re.findall(r"eval step \d: native size \d+x\d+", out)) == 3, out
