"""The README's "From DataLoader" blocks are whole programs: the "after" block
runs as written (on the CPU, on a small generated dataset)."""

from __future__ import annotations

import ast
import builtins
import os
import re
import threading

import torch

from conftest import JOIN_TIMEOUT_S
from feeder.synthetic import make_image_folder

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def from_dataloader_blocks() -> list[str]:
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## From DataLoader"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def bound_names(code: str) -> set[str]:
    tree = ast.parse(code)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_before_and_after_are_separate_complete_blocks():
    before, after = from_dataloader_blocks()
    for code in (before, after):
        tree = ast.parse(code)  # each block is valid Python on its own
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert used <= bound_names(code) | set(dir(builtins)), used - bound_names(code)
    assert "from feeder import Feeder, ImageFolder, ops" in after
    assert "feeder" not in bound_names(after)  # the package's name stays the package


def test_after_block_runs_on_cpu(tmp_path):
    _, after = from_dataloader_blocks()
    root = tmp_path / "train"
    # Enough small images for one full batch of 256 with drop_last=True.
    make_image_folder(root, classes=2, per_class=128, size_range=(24, 40), seed=5)
    code = (after.replace('"data/train"', repr(str(root)))
                 .replace('device="cuda"', 'device="cpu"')
                 .replace("epochs = 90", "epochs = 2"))
    assert code.count(str(root)) == 1 and 'device="cpu"' in code and "epochs = 2" in code
    scope: dict = {}
    errors: list[BaseException] = []

    def run():
        try:
            exec(compile(code, "README.md (From DataLoader, after)", "exec"), scope)
        except BaseException as exc:  # handed to the test's thread below
            errors.append(exc)
    t = threading.Thread(target=run)
    t.start()
    t.join(JOIN_TIMEOUT_S * 2)
    assert not t.is_alive(), "the README block did not finish"
    if errors:
        raise errors[0]
    x, y = scope["x"], scope["y"]
    assert x.shape == (256, 3, 224, 224) and x.dtype == torch.float32 and y.shape == (256,)
    assert scope["epoch"] == 1 and scope["loader"].closed


def test_packed_shards_section_runs(tmp_path):
    """The two commands of "Packed shards and remote data": pack, then train."""
    import shlex
    import subprocess
    import sys

    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Packed shards and remote data"):]
    section = section[:section.index("\n## ", 1)]
    command = re.findall(r"```bash\n(.*?)```", section, re.S)[0].strip()
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    make_image_folder(tmp_path / "data" / "train", classes=2, per_class=130, size_range=(24, 40), seed=6)
    args = shlex.split(command)
    assert args[0] == "feeder-pack"
    root = os.path.dirname(README)
    proc = subprocess.run([sys.executable, "-m", "feeder.pack", *args[1:], "-q"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=JOIN_TIMEOUT_S * 2,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr
    code = (code.replace('device="cuda"', 'device="cpu"').replace("range(90)", "range(2)")
                .replace("...", "last = (images.shape, labels.shape)"))
    assert 'device="cpu"' in code and "range(2)" in code
    scope: dict = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, "README.md (Packed shards)", "exec"), scope)
    finally:
        os.chdir(cwd)
    # 260 samples in batches of 256: the last batch of the last epoch holds 4.
    assert scope["last"] == (torch.Size([4, 3, 224, 224]), torch.Size([4]))
    assert len(scope["source"]) == 260 and scope["source"].classes == ["class_00", "class_01"]
