"""Every Python block of README.md and docs/**/*.md runs, the API reference covers
the public surface, and the docs site builds in strict mode.

The conventions a page follows (docs/contributing.md explains them to writers):

* Every ```python block runs on its own, as a script (``__name__`` is
  ``"__main__"``), in a fresh namespace, with the working directory at a
  generated data tree (``data/train``, ``data/val``,
  ``data/seg``, ``data/det``, ``shards/``: see :func:`data_tree`).
* The one change made to a block: the device string ``"cuda"`` becomes
  ``"cpu"`` (and ``x.cuda(...)`` becomes ``x.to("cpu", ...)``), so that CI,
  which has no GPU, runs the code users read.
* ``<!-- continue -->`` on the line before a block: it continues the previous
  block of the same page, in that block's namespace.
* ``<!-- requires: mod1, mod2 -->``: the block needs these optional modules;
  without one of them the test is skipped, naming it (never silently passed).
* ``<!-- s3 -->``: the block reads ``s3://my-bucket/``: it runs against an
  S3-compatible server on the loopback interface (moto in server mode), whose
  bucket ``my-bucket`` holds ``shards/``'s files, with ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY`` and ``AWS_ENDPOINT_URL`` set for it (the block
  also requires moto, s3fs and boto3).
"""

from __future__ import annotations

import ast
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import pytest

from tests.support import JOIN_TIMEOUT_S, REPO_DIR

ROOT = REPO_DIR
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
# A block's whole run (a chain of continued blocks) may take this long: the data
# is tiny, so a block that needs longer is a block to make smaller.
SNIPPET_TIMEOUT_S = JOIN_TIMEOUT_S * 2

# A fence, possibly indented (a block inside a list item): group 1 is the indent.
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(continue|s3|requires:[^>]*?)\s*-->\s*\Z")
S3_MODULES = ["moto", "s3fs", "boto3"]
S3_BUCKET = "my-bucket"


@dataclass
class Block:
    page: str
    line: int
    code: str
    continues: bool = False
    requires: list[str] = field(default_factory=list)
    s3: bool = False


def page_blocks(page: str) -> list[Block]:
    """The page's ```python blocks, with the markers on the lines just before them."""
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    blocks = []
    for m in FENCE.finditer(text):
        if m.group(2) != "python":
            continue
        before = text[:m.start()].rstrip("\n")
        # Markers stack, one per line, right above the fence.
        continues, requires, s3 = False, [], False
        while True:
            found = MARKER.search(before)
            if not found:
                break
            if found.group(1) == "continue":
                continues = True
            elif found.group(1) == "s3":
                s3 = True
                requires += S3_MODULES
            else:
                requires += [x.strip() for x in found.group(1).split(":", 1)[1].split(",") if x.strip()]
            before = before[:found.start()].rstrip("\n")
        indent = len(m.group(1))
        code = "".join(line[indent:] if line.startswith(" " * indent) else line.lstrip(" ")
                       for line in m.group(3).splitlines(keepends=True))
        blocks.append(Block(page, text.count("\n", 0, m.start()) + 2, code, continues, requires, s3))
    return blocks


def chains() -> list[list[Block]]:
    """Blocks grouped into runs: a block and the ``continue`` blocks after it."""
    out: list[list[Block]] = []
    for page in PAGES:
        for block in page_blocks(page):
            if block.continues:
                assert out and out[-1][0].page == page, \
                    f"{page}:{block.line}: <!-- continue --> with no block before it on the page"
                out[-1].append(block)
            else:
                out.append([block])
    return out


def on_cpu(code: str) -> str:
    """The block as CI runs it: the CUDA device swapped for the CPU."""
    code = re.sub(r"\.cuda\(\)", '.to("cpu")', code)
    code = re.sub(r"\.cuda\(", '.to("cpu", ', code)
    return code.replace('"cuda"', '"cpu"')


CHAINS = chains()


def test_blocks_are_found():
    """The extraction sees the pages' blocks (a broken fence pattern would find none)."""
    pages = {c[0].page for c in CHAINS}
    assert "README.md" in pages and "docs/getting-started.md" in pages and len(CHAINS) >= 20
    for chain in CHAINS:
        for block in chain:
            ast.parse(block.code, f"{block.page}:{block.line}")  # each block parses alone


def data_tree(base: str) -> None:
    """The files the blocks read, small enough for a block to run in a second or two."""
    # What the guides tell a user to run (2 classes x 128 images: one full batch of
    # 256 with drop_last=True), through its command line.
    proc = subprocess.run([sys.executable, "-m", "feeder.synthetic", base], capture_output=True,
                          text=True, timeout=JOIN_TIMEOUT_S * 2, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    # The shards guide's own command makes shards/ (so that command is tested too).
    text = open(os.path.join(ROOT, "docs", "guides", "shards.md"), encoding="utf-8").read()
    command = next(line for body in re.findall(r"```bash\n(.*?)```", text, re.S)
                   for line in body.splitlines() if line.startswith("feeder-pack "))
    args = shlex.split(command.split("#")[0])
    proc = subprocess.run([sys.executable, "-m", "feeder.pack", *args[1:], "-q"], cwd=base,
                          capture_output=True, text=True, timeout=JOIN_TIMEOUT_S * 2,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, f"docs/guides/shards.md: {command!r} failed:\n{proc.stderr}"


@pytest.fixture(scope="module")
def tree():
    base = tempfile.mkdtemp(prefix="feeder-docs-")
    try:
        data_tree(base)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def chain_id(chain: list[Block]) -> str:
    return f"{chain[0].page}:{chain[0].line}"


@pytest.mark.timeout(SNIPPET_TIMEOUT_S)
@pytest.mark.parametrize("chain", CHAINS, ids=chain_id)
def test_block_runs(chain, tree, tmp_path):
    missing = [m for block in chain for m in block.requires if not _importable(m)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (not installed)")
    # Each run gets its own copy-free view of the data: a block may write files (a
    # checkpoint), so the working directory is a fresh folder linking to the tree.
    for name in os.listdir(tree):
        os.symlink(os.path.join(tree, name), tmp_path / name)
    # A page's script runs as a script would: ``if __name__ == "__main__":`` blocks run.
    # It runs in the test's own (main) thread, as a script's code would, so that a
    # worker process starts as it would there; pytest-timeout bounds it.
    scope: dict = {"__name__": "__main__"}
    where = chain_id(chain)
    cwd = os.getcwd()
    server = _S3Server(os.path.join(tree, "shards")) if any(b.s3 for b in chain) else None
    os.chdir(tmp_path)
    started = time.monotonic()
    try:
        for block in chain:
            where = f"{block.page}:{block.line}"
            exec(compile(on_cpu(block.code), where, "exec"), scope)
    except Exception as exc:
        raise AssertionError(f"{where}: the block raised {exc!r}") from exc
    finally:
        os.chdir(cwd)
        _close_feeders(scope)
        if server is not None:
            server.close()
    print(f"{chain_id(chain)}: {time.monotonic() - started:.2f} s")


class _S3Server:
    """A moto S3 server on the loopback interface, with the variables a block reads
    set for it; ``close()`` stops it and restores them."""

    def __init__(self, files: str) -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        self.server.start()
        host, port = self.server.get_host_and_port()
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
        self.old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
        client.create_bucket(Bucket=S3_BUCKET)
        for name in sorted(os.listdir(files)):
            client.upload_file(os.path.join(files, name), S3_BUCKET, name)

    def close(self) -> None:
        self.server.stop()
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _close_feeders(scope: dict) -> None:
    """Close what a block left open (a page may build a feeder that a later block goes on
    using), so that its threads do not outlive the test."""
    from feeder import Feeder

    for value in scope.values():
        if isinstance(value, Feeder):
            value.close()


def test_on_cpu_swaps_only_the_device():
    code = 'Feeder(src, device="cuda")\nx = x.cuda(non_blocking=True)\ny = y.cuda()\n'
    assert on_cpu(code) == ('Feeder(src, device="cpu")\nx = x.to("cpu", non_blocking=True)\n'
                            'y = y.to("cpu")\n')


def test_markers_are_read():
    page = "docs/guides/detection.md"
    blocks = page_blocks(page)
    assert not blocks[0].continues and blocks[1].continues
    seg = page_blocks("docs/guides/segmentation.md")
    assert any(b.requires == ["torchvision", "PIL"] for b in seg)
    assert any(b.s3 and set(S3_MODULES) <= set(b.requires) for b in page_blocks("docs/guides/shards.md"))


# -- the figures ---------------------------------------------------------------------------------

FIGURES = sorted(glob.glob(os.path.join(ROOT, "docs", "figures", "*.py")))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_figures_are_found():
    assert {os.path.basename(p) for p in FIGURES} >= {"detection_batch.py", "tune_threads.py", "doctor.py"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", FIGURES, ids=os.path.basename)
def test_figure_script_draws_its_figure(script, tmp_path):
    """Each docs/figures/NAME.py draws NAME.png from a real run, into the folder it is
    given (a shorter run, where the script has one: FEEDER_FIGURE_QUICK=1); the
    committed NAME.png is there and a page shows it."""
    pytest.importorskip("matplotlib")
    name = os.path.splitext(os.path.basename(script))[0] + ".png"
    proc = subprocess.run([sys.executable, script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=280, env={**os.environ, "PYTHONPATH": ROOT, "FEEDER_FIGURE_QUICK": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for path in (tmp_path / name, os.path.join(ROOT, "docs", "figures", name)):
        with open(path, "rb") as f:
            head = f.read(24)
        assert head[:8] == PNG_SIGNATURE, path
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        assert width >= 400 and height >= 200, (path, width, height)
    shown = [p for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
             if f"figures/{name})" in open(p, encoding="utf-8").read()]
    assert shown, f"no page of docs/ shows figures/{name}"


# -- the results page ---------------------------------------------------------------------------

def test_results_page_lists_every_file_of_bench_results():
    """docs/results.md's "Every file" section links each file of bench/results/ (served
    as bench-results/) and names each folder, so a new report cannot go unlisted."""
    text = open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8").read()
    section = text[text.index("## Every file"):]
    results = os.path.join(ROOT, "bench", "results")
    names = sorted(os.listdir(results))
    unlisted = [n for n in names if os.path.isfile(os.path.join(results, n))
                and f"](bench-results/{n})" not in section]
    unnamed = [n for n in names if os.path.isdir(os.path.join(results, n)) and f"{n}/" not in section]
    assert not unlisted and not unnamed, (unlisted, unnamed)


# -- the API reference --------------------------------------------------------------------------

def documented_names() -> set[str]:
    """Every ``::: dotted.name`` directive of docs/api/."""
    names = set()
    for path in glob.glob(os.path.join(ROOT, "docs", "api", "*.md")):
        names |= set(re.findall(r"^:::\s+([\w.]+)", open(path, encoding="utf-8").read(), re.M))
    return names


def test_api_reference_covers_the_public_surface():
    import feeder

    names = documented_names()
    missing = [n for n in feeder.__all__
               if f"feeder.{n}" not in names and not (n == "ops" and "feeder.ops" in names)]
    assert not missing, f"docs/api/ has no '::: feeder.<name>' for {missing}"
    for module in ("feeder.ops", "feeder.sources", "feeder.shards", "feeder.synthetic",
                   "feeder.errors", "feeder.pack", "feeder.testing"):
        assert module in names, f"docs/api/ has no '::: {module}'"


# -- the site -----------------------------------------------------------------------------------

def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: a broken link, anchor or API reference fails it."""
    if not os.environ.get("CI"):  # CI installs the docs extra: there a missing one fails
        pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
        pytest.importorskip("mkdocstrings")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert (tmp_path / "site" / "api" / "feeder" / "index.html").exists()
