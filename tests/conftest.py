"""Shared fixtures: small generated image sets, sources, transforms, and the
thread-leak guard every test runs under. Helpers shared by the tests are in
``tests.support``."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

from feeder.synthetic import make_image
from tests.support import (SIZES, MemorySource, encode_jpeg, encode_png, pack_numbered, reaped,
                           wait_no_feeder_threads)
from tests.support.servers import file_server  # noqa: F401 - a fixture

# The GPU suite: skipped without a GPU, and a skipped test's fixtures are never
# looked up, so a test naming a fixture that does not exist (a misplaced
# @pytest.fixture) would error on the first GPU and pass unnoticed here.
CUDA_TESTS = Path(__file__).resolve().parent / "cuda"


def missing_fixtures(items) -> list[str]:
    """``"test id: name"`` for every fixture a test under ``tests/cuda`` names
    (directly or through its fixtures) that no conftest, plugin or module defines."""
    problems = []
    for item in items:
        if CUDA_TESTS not in Path(str(item.path)).resolve().parents:
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        callspec = getattr(item, "callspec", None)
        params = set(callspec.params) if callspec is not None else set()
        for name in item.fixturenames:
            if name != "request" and name not in params and name not in info.name2fixturedefs:
                problems.append(f"{item.nodeid}: {name}")
    return problems


def unmarked_skips(items) -> list[str]:
    """``"test id: why"`` for every test under ``tests/cuda`` that skips other than by
    ``real_cuda(reason=...)``: on a machine without CUDA the suite runs under the
    stand-in, and a test that needs the device says why in that one marker."""
    problems = []
    for item in items:
        if CUDA_TESTS not in Path(str(item.path)).resolve().parents:
            continue
        for mark in item.iter_markers():
            if mark.name in ("skip", "skipif"):
                problems.append(f"{item.nodeid}: marked {mark.name} (use real_cuda(reason=...))")
            elif mark.name == "real_cuda" and not str(mark.kwargs.get("reason", "")).strip():
                problems.append(f"{item.nodeid}: real_cuda without a reason")
    return problems


def bad_calls(module) -> list[str]:
    """``"file:line: call: error"`` for every call in ``module`` (a test module) of a
    function or class defined in the test suite (its helpers, fixtures' factories,
    the module's own functions) whose arguments do not fit its signature.

    A test that skips never makes its calls; a helper whose signature changed
    would fail only on the machine that runs it. Calls with ``*`` or ``**``
    arguments, and names a function binds locally, are left out."""
    import ast
    import inspect

    tests_root = CUDA_TESTS.parent
    path = Path(module.__file__)
    tree = ast.parse(path.read_text(), str(path))
    problems = []

    def local_names(fn) -> set[str]:
        names = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
                names.add(node.name)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
        return names

    def visit(node, shadowed: frozenset) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            shadowed = shadowed | local_names(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in shadowed:
            target = getattr(module, node.func.id, None)
            try:
                source = inspect.getsourcefile(target) if callable(target) else None
            except TypeError:
                source = None
            splat = any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords)
            if source and tests_root in Path(source).resolve().parents and not splat:
                try:
                    signature = inspect.signature(target)
                except (TypeError, ValueError):
                    signature = None
                if signature is not None:
                    try:
                        signature.bind(*node.args, **{k.arg: k.value for k in node.keywords})
                    except TypeError as exc:
                        problems.append(f"{path.name}:{node.lineno}: {node.func.id}(): {exc}")
        for child in ast.iter_child_nodes(node):
            visit(child, shadowed)

    visit(tree, frozenset())
    return problems


# What marks a test file that may start fsspec's event loop thread.
_REMOTE = re.compile(r"fsspec|s3fs|moto|file_server|http://|s3://|SyntheticServer|synthetic_server")


@functools.lru_cache(maxsize=None)
def _remote(path: str) -> bool:
    return bool(_REMOTE.search(Path(path).read_text(errors="replace")))


def _run_order(item) -> int:
    path = str(item.path)
    if Path(path).name == "test_isolation_start.py":
        return 0
    return 2 if _remote(path) else 1


def pytest_collection_modifyitems(session, config, items):
    """Fail the run at collection when a GPU test names a fixture that does not exist,
    skips without saying why it needs the device, or calls a test helper with
    arguments its signature refuses (checked on every machine; see
    ``missing_fixtures``, ``unmarked_skips`` and ``bad_calls``)."""
    # The start-method tests first, the tests of remote storage last: those leave
    # fsspec's event loop thread running for the rest of the process, after which
    # start_method="auto" must spawn (seconds of importing torch per worker
    # process) where it would fork, and the rule's fork cases need a process
    # without it. (A stable sort: every other test keeps its order.)
    items.sort(key=_run_order)
    problems = missing_fixtures(items)
    if problems:
        raise pytest.UsageError("tests under tests/cuda name fixtures that do not exist (they "
                                "would error on a GPU): " + "; ".join(problems))
    problems = unmarked_skips(items)
    if problems:
        raise pytest.UsageError("tests under tests/cuda skip without saying why they need a "
                                "GPU: " + "; ".join(problems))
    modules = {id(item.module): item.module for item in items
               if CUDA_TESTS in Path(str(item.path)).resolve().parents
               and getattr(item, "module", None) is not None}
    problems = [p for module in modules.values() for p in bad_calls(module)]
    if problems:
        raise pytest.UsageError("tests under tests/cuda call test helpers with arguments their "
                                "signatures refuse: " + "; ".join(problems))


def pytest_sessionfinish(session, exitstatus):
    from tests.support.warm import close_warm_python

    close_warm_python()  # the command-line tests' warm interpreter, if one started


def pytest_configure(config):
    config.addinivalue_line("markers", "real_cuda(reason): a test under tests/cuda that needs a "
                                       "real CUDA device; skipped under the CUDA stand-in")


@pytest.fixture(autouse=True)
def cuda(request):
    """Under ``tests/cuda`` on a machine without CUDA: the CUDA stand-in
    (``tests/support/cuda_standin.py``), recording every CUDA call, or a skip for a test
    marked ``real_cuda``. None elsewhere, and on a CUDA machine (the device itself)."""
    from tests.support.cuda_standin import REAL_CUDA, Standin

    if REAL_CUDA or CUDA_TESTS not in Path(str(request.node.path)).resolve().parents:
        yield None
        return
    marker = request.node.get_closest_marker("real_cuda")
    if marker is not None:
        pytest.skip("needs a real CUDA device: " + marker.kwargs["reason"])
    patches = pytest.MonkeyPatch()
    standin = Standin().install(patches)
    # An isolated feeder forks here, as before any real CUDA call (the
    # stand-in's state is plain Python, safe to fork): spawning would start an
    # interpreter without the stand-in, seconds per test.
    patches.setattr("torch.cuda.is_initialized", lambda: False)
    try:
        yield standin
    finally:
        # Every feeder's threads and clean-ups end before torch.cuda is restored:
        # a late one would reach the real (absent) CUDA.
        import gc
        gc.collect()
        reaped()
        wait_no_feeder_threads(10.0)
        from feeder.engine.engine import live_engines
        for engine in live_engines():  # kept alive, say by a failed test's traceback
            engine.free()
            if getattr(engine, "side", None) is not None:
                engine.side.device = None  # exit's free() then touches no device
        patches.undo()


@pytest.fixture(autouse=True)
def no_feeder_thread_leak():
    """Fail any test that leaves a feeder thread alive (after a short grace to exit)."""
    yield
    leaked = wait_no_feeder_threads(2.0)
    assert not leaked, f"feeder threads left running: {leaked}"


@pytest.fixture(scope="session")
def jpeg_blobs() -> list[bytes]:
    """60 small photograph-like JPEGs of several sizes."""
    return [encode_jpeg(make_image(*SIZES[i % len(SIZES)], seed=i), 85 + i % 10) for i in range(60)]


@pytest.fixture(scope="session")
def mixed_blobs(jpeg_blobs) -> list[bytes]:
    """JPEGs and PNGs mixed (every fourth is a PNG)."""
    out = list(jpeg_blobs)
    for i in range(0, len(out), 4):
        out[i] = encode_png(make_image(*SIZES[i % len(SIZES)], seed=1000 + i))
    return out


@pytest.fixture
def source(mixed_blobs) -> MemorySource:
    return MemorySource(mixed_blobs)


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory, jpeg_blobs) -> str:
    """root/{cat,dog,emu}/... with JPEGs and PNGs, nested folders, mixed-case extensions."""
    root = tmp_path_factory.mktemp("imagefolder")
    layout = {"dog": 7, "cat": 5, "emu": 4}
    k = 0
    for cls, n in layout.items():
        os.makedirs(root / cls / "sub", exist_ok=True)
        for i in range(n):
            if i % 3 == 2:
                name = root / cls / "sub" / f"{i}.PNG"
                data = encode_png(make_image(70, 60, seed=k))
            else:
                name = root / cls / f"{i}.jpg"
                data = jpeg_blobs[k % len(jpeg_blobs)]
            name.write_bytes(data)
            k += 1
        (root / cls / "notes.txt").write_text("not an image")
    return str(root)


@pytest.fixture(scope="module")
def packed(tmp_path_factory, jpeg_blobs):
    """The 60 ``jpeg_blobs`` (label = sample number) packed by ``feeder-pack`` into
    several shards of about 40 KB, with their indices and ``train.json`` list:
    ``(folder, number of shards)``. One copy per test module; tests that change
    files serve a copy of their own."""
    out, shards = pack_numbered(tmp_path_factory.mktemp("packed"), jpeg_blobs, "40KB")
    assert shards >= 4
    return out, shards
