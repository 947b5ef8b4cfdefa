"""Shared fixtures: small generated image sets, sources, transforms, and the
thread-leak guard every test runs under."""

from __future__ import annotations

import collections
import hashlib
import os
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import simplejpeg

from feeder.synthetic import make_image

JOIN_TIMEOUT_S = 30.0  # bound on any wait for a whole pass in a test

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


def pytest_collection_modifyitems(session, config, items):
    """Fail the run at collection when a GPU test names a fixture that does not exist,
    skips without saying why it needs the device, or calls a test helper with
    arguments its signature refuses (checked on every machine; see
    ``missing_fixtures``, ``unmarked_skips`` and ``bad_calls``)."""
    # The start-method tests first: tests of remote storage leave fsspec's event
    # loop thread running for the rest of the process, after which
    # start_method="auto" must spawn; the rule's fork cases need a process
    # without it. (A stable sort: every other test keeps its order.)
    items.sort(key=lambda item: 0 if Path(str(item.path)).name == "test_isolation_start.py" else 1)
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


def pytest_configure(config):
    config.addinivalue_line("markers", "real_cuda(reason): a test under tests/cuda that needs a "
                                       "real CUDA device; skipped under the CUDA stand-in")


@pytest.fixture(autouse=True)
def cuda(request):
    """Under ``tests/cuda`` on a machine without CUDA: the CUDA stand-in
    (``tests/cuda_standin.py``), recording every CUDA call, or a skip for a test
    marked ``real_cuda``. None elsewhere, and on a CUDA machine (the device itself)."""
    from cuda_standin import REAL_CUDA, Standin

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


def feeder_threads() -> list[threading.Thread]:
    """Threads of feeder passes (not the process-wide reaper, which idles on its queue)."""
    return [t for t in threading.enumerate()
            if t.name.startswith("feeder-") and t.name != "feeder-reaper"]


def wait_no_feeder_threads(timeout: float = 2.0) -> list[str]:
    """Join feeder threads for up to ``timeout`` s; return the names still alive."""
    deadline = time.monotonic() + timeout
    # Report the very list that ended the wait: a second look could see a thread
    # started after it (by a garbage-collected feeder) that was never waited for.
    alive = feeder_threads()
    while alive and time.monotonic() < deadline:
        for t in alive:
            t.join(timeout=0.02)
        alive = feeder_threads()
    return [t.name for t in alive]


@pytest.fixture(autouse=True)
def no_feeder_thread_leak():
    """Fail any test that leaves a feeder thread alive (after a short grace to exit)."""
    yield
    leaked = wait_no_feeder_threads(2.0)
    assert not leaked, f"feeder threads left running: {leaked}"


def encode_jpeg(img: np.ndarray, quality: int = 90) -> bytes:
    return simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=quality, colorspace="RGB")


def encode_png(img: np.ndarray) -> bytes:
    """PNG of an RGB, RGBA, gray or 16-bit image (cv2 wants BGR order)."""
    if img.ndim == 3 and img.shape[2] == 3:
        img = img[..., ::-1]
    elif img.ndim == 3 and img.shape[2] == 4:
        img = img[..., [2, 1, 0, 3]]
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(img))
    assert ok
    return buf.tobytes()


class MemorySource:
    """An in-memory source; labels default to the sample index (for exactly-once checks)."""

    def __init__(self, blobs: list[bytes], labels: list[int] | None = None, names: list[str] | None = None):
        self.blobs = blobs
        self.labels = list(range(len(blobs))) if labels is None else labels
        self.names = names

    def __len__(self) -> int:
        return len(self.blobs)

    def read(self, index: int):
        return self.blobs[index], self.labels[index]

    def describe(self, index: int) -> str:
        return self.names[index] if self.names else f"mem://{index}"


class CountingSource(MemorySource):
    """A :class:`MemorySource` that counts ``read()`` calls per index (``reads``)."""

    def __init__(self, blobs: list[bytes], labels: list[int] | None = None):
        super().__init__(blobs, labels)
        self.reads: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def read(self, index: int):
        with self._lock:
            self.reads[index] += 1
        return super().read(index)


class BlockingSource(MemorySource):
    """``read(stuck)`` blocks until ``release`` is set (storage that hangs on one
    sample); ``entered`` is set once it is blocked. A read never released fails
    with TimeoutError after ``JOIN_TIMEOUT_S``."""

    def __init__(self, blobs: list[bytes], stuck: int = 0):
        super().__init__(blobs)
        self.stuck = stuck
        self.entered = threading.Event()
        self.release = threading.Event()

    def read(self, index: int):
        if index == self.stuck:
            self.entered.set()
            if not self.release.wait(JOIN_TIMEOUT_S):
                raise TimeoutError(f"read({index}) was never released")
        return super().read(index)


SIZES = [(64, 80), (96, 72), (120, 150), (50, 50), (130, 90)]


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


def pack_numbered(root, blobs, shard_size: str) -> tuple[str, int]:
    """``blobs`` (label = sample number) packed by ``feeder-pack`` into shards of
    about ``shard_size`` under ``root/out``: ``(that folder, number of shards)``."""
    from feeder.pack import pack, parse_size

    lines = []
    for i, blob in enumerate(blobs):
        (root / f"{i}.jpg").write_bytes(blob)
        lines.append(f"{i}.jpg {i}")
    (root / "list.txt").write_text("\n".join(lines))
    res = pack(str(root / "list.txt"), str(root / "out"), shard_size=parse_size(shard_size))
    return str(root / "out"), len(res.shards)


def content_hash(img) -> str:
    return hashlib.sha1(np.ascontiguousarray(img).tobytes()).hexdigest()


def drain(iterable, timeout: float = JOIN_TIMEOUT_S, limit: int | None = None):
    """Iterate ``iterable`` in a helper thread; fail the test if it does not finish in time.

    Returns (batches, error): batches as a list of (images, labels) numpy pairs.
    """
    return collect(iterable, timeout, limit, keep=numpy_pair)


def numpy_pair(batch) -> tuple[np.ndarray, np.ndarray]:
    """An (images, labels) batch as numpy copies (a CPU uint8 batch is a view of a
    pool buffer that the next batch reuses)."""
    x, y = batch
    return x.cpu().numpy().copy(), y.cpu().numpy().copy()


def collect(feeder, timeout: float = JOIN_TIMEOUT_S, limit: int | None = None, keep=None):
    """Every batch of one pass (up to ``limit``) as returned (dict or pair), in a
    helper thread; fail the test if the pass does not end within ``timeout``.

    Args:
        keep: What to keep of each batch (say, a copy); the batch itself by default.

    Returns:
        (batches, the exception that ended the pass or None).
    """
    out: list = []
    err: list = []

    def run():
        try:
            for batch in feeder:
                out.append(batch if keep is None else keep(batch))
                if limit is not None and len(out) >= limit:
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            err.append(exc)

    t = threading.Thread(target=run, name="test-collect", daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the pass did not finish within {timeout} s (hang)"
    return out, (err[0] if err else None)


def collected(feeder, **kw) -> list:
    """:func:`collect`'s batches; the error that ended the pass, if any, is raised."""
    out, err = collect(feeder, **kw)
    if err is not None:
        raise err
    return out


def labels_of(batches) -> list[int]:
    return [int(v) for _, y in batches for v in y]


def reaped() -> None:
    """Wait until the reaper thread has run every clean-up queued so far (it runs
    them in order): a dropped batch's buffer, a collected feeder's close."""
    from feeder.engine import reaper as _reaper

    _reaper.ensure_running()  # a process where no feeder has run yet has none
    done = threading.Event()
    _reaper.defer(done.set)
    assert done.wait(JOIN_TIMEOUT_S)


def run_in_thread(fn, timeout: float = JOIN_TIMEOUT_S):
    """Run ``fn`` in a helper thread; fail the test if it does not return in time."""
    out: list = []

    def target():
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(("err", exc))

    t = threading.Thread(target=target, name="test-helper", daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} did not return within {timeout} s (deadlock or hang)"
    kind, value = out[0]
    if kind == "err":
        raise value
    return value
