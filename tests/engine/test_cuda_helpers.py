"""The GPU suite's device-independent halves, run on the CPU in every CI run:
the CPU reference each GPU test drains, the comparison helpers on what
``drain()`` returns (numpy) and on tensors, and the collection-time check that
every fixture a GPU test names exists."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support import TESTS_DIR, drain
from tests.support.warm import run_module
from tests.support.cuda import (MEAN, STD, assert_same_batches, assert_sums, batch_sum, big_source,
                          close_after_layout, close_to_cpu_path, make, make_isolated,
                          reference_sums)
from feeder.testing import pool_of

TESTS = Path(TESTS_DIR).resolve()


@pytest.fixture
def source(jpeg_blobs):
    return big_source(jpeg_blobs)


def test_consumer_stream_waits_for_the_batch_event_cpu_half(source):
    """tests/cuda/test_cuda.py::test_consumer_stream_waits_for_the_batch_event with the
    CPU in place of the GPU: the reference sums (numpy) equal the per-batch tensor sums."""
    with make(source, device="cpu", normalize=(MEAN, STD)) as cpu:
        expect = reference_sums(cpu, "float")
    with make(source, device="cpu", normalize=(MEAN, STD)) as other:
        got = [batch_sum(x, "float") for x, _ in other]
    assert len(expect) == 15
    assert_sums(got, expect, "float")


@pytest.mark.parametrize("isolated", [False, True])
def test_lagging_consumer_cpu_half(source, isolated):
    """The caching-allocator tests of tests/cuda (thread and isolated engine), CPU half."""
    build = make_isolated if isolated else make
    kw = {"isolation": "process"} if isolated else {}
    with build(source, device="cpu", shuffle=False) as cpu:
        expect = reference_sums(cpu, "int")
    with build(source, device="cpu", shuffle=False, queue_size=2, **kw) as other:
        sums = [batch_sum(x, "int") for x, _ in other]
    assert len(expect) == 15 and all(isinstance(v, int) for v in expect)
    assert_sums(sums, expect, "int")


@pytest.mark.parametrize("kw, close", [
    ({}, close_after_layout),
    ({"dtype": torch.float32}, close_after_layout),
    ({"dtype": torch.float16, "normalize": (MEAN, STD)}, close_after_layout),
    ({"normalize": (MEAN, STD)}, close_to_cpu_path),
    ({"dtype": torch.float16, "normalize": (MEAN, STD)}, close_to_cpu_path),
])
def test_same_batches_cpu_half(source, kw, close):
    """test_contiguous_memory_format_on_device and test_values_identical_to_cpu_path:
    their CPU reference against the same settings in the other layout, compared as
    the GPU tests compare; a changed value is caught."""
    with make(source, device="cpu", **kw) as a, make(source, device="cpu",
                                                     memory_format="contiguous", **kw) as b:
        a.set_epoch(1)
        b.set_epoch(1)
        first, err_a = drain(a)
        second, err_b = drain(b)
    assert_same_batches(first, err_a, second, err_b, close)
    changed = [(x.copy(), y) for x, y in second]
    changed[3][0].flat[5] = changed[3][0].flat[5] + (1 if changed[3][0].dtype == np.uint8 else 0.5)
    with pytest.raises(AssertionError):
        assert_same_batches(first, err_a, changed, err_b, close)
    relabelled = [(x, y.copy()) for x, y in second]
    relabelled[0][1][0] += 1
    with pytest.raises(AssertionError):
        assert_same_batches(first, err_a, relabelled, err_b, close)


def test_sum_helpers_catch_a_difference():
    x = torch.arange(12, dtype=torch.uint8).view(1, 3, 2, 2)
    assert_sums([batch_sum(x, "int")], [66], "int")
    assert_sums([batch_sum(x, "float")], [66.0], "float")
    with pytest.raises(AssertionError):
        assert_sums([batch_sum(x, "int")], [65], "int")
    with pytest.raises(AssertionError):
        assert_sums([batch_sum(x, "float")], [66.5], "float")


def _collect(directory: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    # A process of its own, forked from the warm interpreter (tests/support/warm.py).
    return run_module("pytest", ["--collect-only", "-q", "-p", "no:cacheprovider", str(directory)],
                      str(directory), env, 120)


def test_collection_fails_on_a_gpu_test_naming_a_missing_fixture(tmp_path):
    """The conftest check: a misplaced @pytest.fixture in tests/cuda fails CPU CI at
    collection (the module is skipped without a GPU, so nothing else would)."""
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "cuda").mkdir()
    body = textwrap.dedent("""
        import pytest
        pytestmark = pytest.mark.real_cuda(reason="needs a CUDA GPU")

        @pytest.fixture
        def helper(a, b):
            pass

        def big_source(jpeg_blobs):
            return jpeg_blobs

        @pytest.mark.parametrize("kw", [1, 2])
        def test_uses_it(big_source, kw, tmp_path):
            pass
    """)
    (tmp_path / "cuda" / "test_bad.py").write_text(body)
    bad = _collect(tmp_path)
    assert bad.returncode != 0
    assert "test_uses_it[1]: big_source" in bad.stderr + bad.stdout
    (tmp_path / "cuda" / "test_bad.py").write_text(body.replace("def big_source",
                                                                "@pytest.fixture\ndef big_source"))
    good = _collect(tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "2 tests collected" in good.stdout


def test_collection_fails_on_a_gpu_test_calling_a_helper_wrongly_or_skipping_unmarked(tmp_path):
    """A test under tests/cuda that calls a test helper with arguments its signature
    refuses (as after the helper's signature changed) fails collection even when the
    test itself is skipped; so does a skip that is not real_cuda(reason=...)."""
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "helpers.py").write_text("class Source:\n    def __init__(self, n, make):\n"
                                         "        self.n = n\n")
    (tmp_path / "cuda").mkdir()
    body = textwrap.dedent("""
        import pytest
        from helpers import Source

        def local(n):
            return n

        @pytest.mark.real_cuda(reason="needs the device")
        def test_uses_it():
            Source(4, len)
            Source(n=4, make=len)
            Source(*[4, len])
            make = Source
            make()
            local(n=1)
    """)
    wrong = {"Source()": "missing a required argument: 'n'",
             "local(1, 2)": "too many positional arguments",
             "Source(4, len, names=1)": "got an unexpected keyword argument 'names'"}
    (tmp_path / "cuda" / "test_bad.py").write_text(body + "".join(f"    {c}\n" for c in wrong))
    bad = _collect(tmp_path)
    assert bad.returncode != 0
    for line, (call, expect) in enumerate(wrong.items(), 16):
        assert f"test_bad.py:{line}: {call.split('(')[0]}(): {expect}" in bad.stdout + bad.stderr
    (tmp_path / "cuda" / "test_bad.py").write_text(body)
    good = _collect(tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    marks = ['pytest.mark.skipif(True, reason="no GPU")', "pytest.mark.real_cuda",
             'pytest.mark.real_cuda(reason=" ")']
    (tmp_path / "cuda" / "test_bad.py").write_text("import pytest\n" + "".join(
        f"@{mark}\ndef test_{i}():\n    pass\n" for i, mark in enumerate(marks)))
    bad = _collect(tmp_path)
    assert bad.returncode != 0
    for i in range(len(marks)):
        assert f"test_bad.py::test_{i}: " in bad.stdout + bad.stderr


def test_the_gpu_suite_names_only_existing_fixtures():
    result = _collect(TESTS / "cuda")
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_check_script_parts_without_a_gpu(monkeypatch):
    """scripts/gpu-check's device-independent parts: the byte-for-byte comparison,
    the copy-slowing patch (restored after), its feeders, and a clear exit without CUDA."""
    sys.path.insert(0, str(TESTS.parent / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    from feeder.engine import transfer as _transfer
    a = [(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.arange(2))]
    b = [(a[0][0].clone(), a[0][1].clone())]
    assert gpu_check.identical(a, b) == ""
    b[0][0][1, 2, 3, 3] = 1
    assert "batch 0: images differ" == gpu_check.identical(a, b)
    assert "labels differ" in gpu_check.identical(a, [(a[0][0], torch.arange(1, 3))])
    real = _transfer.SideStream.copying
    with gpu_check.slowed_copies():
        assert _transfer.SideStream.copying is not real
    assert _transfer.SideStream.copying is real
    with gpu_check.make(gpu_check.MemorySource(8), batch_size=4, num_buffers=2) as f:
        assert pool_of(f).capacity == 2 and len(list(f)) == 2
    assert gpu_check.error_lines("ok\nTraceback (most recent call last):\n") == [
        "Traceback (most recent call last):"]
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 2


def _gpu_check():
    sys.path.insert(0, str(TESTS.parent / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_gpu_check_verdicts_from_recorded_figures():
    """Each new gpu-check row's verdict, from figures such as a GPU run records."""
    g = _gpu_check()
    assert g.sync_verdict({"uint8 pairs": 0, "MixUp": 0})[0] == "PASS"
    status, detail = g.sync_verdict({"uint8 pairs": 0, "variable size": 3})
    assert status == "FAIL" and "variable size 3" in detail
    assert g.context_verdict({"thread": (False, [0]), "process": (False, [0])})[0] == "PASS"
    assert g.context_verdict({"thread": (True, [0])})[0] == "FAIL"  # CUDA initialized at build
    assert g.context_verdict({"process": (False, [])})[0] == "FAIL"  # no context where expected
    gb = 38.5e6 * 10  # ten batches; rows: bytes, copy s, transfer CPU s, batches
    assert g.h2d_verdict({"thread": (gb, gb / 40e9, 0.005, 10)}, 45.0)[0] == "PASS"
    assert g.h2d_verdict({"thread": (gb, gb / 6e9, 0.005, 10)}, 7.0)[0] == "FAIL"  # pageable speed
    # Pinned, but far below a plain copy from the same kind of memory.
    assert g.h2d_verdict({"thread": (gb, gb / 20e9, 0.005, 10)}, 45.0)[0] == "FAIL"
    detail = g.h2d_verdict({"thread": (gb, gb / 40e9, 0.005, 10)}, 45.0)[1]
    assert "40.0 GB/s" in detail and "0.50 ms per batch" in detail and "plain copy 45.0" in detail
    # Fast copies, but a transfer thread that burns CPU (a spinning wait).
    assert g.h2d_verdict({"thread": (gb, gb / 40e9, 0.05, 10)}, 45.0)[0] == "FAIL"
    pinned, device = g.memory_bounds(256, 224, 4, 2, 1)
    assert pinned == 4 * (256 * 224 * 224 * 3 + 8 * 256)
    assert device == 4 * (256 * 224 * 224 * 3 + 8 * 256)
    assert g.memory_verdict(pinned, pinned, device, device)[0] == "PASS"
    assert g.memory_verdict(pinned + (4 << 20), pinned, device, device)[0] == "FAIL"
    assert g.memory_verdict(pinned, pinned, 2 * device, device)[0] == "FAIL"
    # Seconds per step alone, per batch of the loader alone, fed by feeder, by DataLoader:
    # overlapped, a fed step costs the slower of the first two, not their sum.
    assert g.overlap_verdict(0.0078, 0.004, 0.0085, 0.019)[0] == "PASS"
    assert g.overlap_verdict(0.0078, 0.030, 0.032, None)[0] == "PASS"  # loader-bound
    status, detail = g.overlap_verdict(0.0078, 0.004, 0.012, None)  # loader and step in turn
    assert status == "FAIL" and "x1.54 the slower" in detail
    assert "DataLoader" in g.overlap_verdict(0.1, 0.05, 0.1, 0.12)[1]


def test_gpu_check_prints_skip_rows_without_a_gpu():
    """Without CUDA, scripts/gpu-check prints every row as SKIP and exits with 2."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent))
    result = subprocess.run([sys.executable, str(TESTS.parent / "scripts" / "gpu_check.py")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    g = _gpu_check()
    rows = [line for line in result.stdout.splitlines() if "no CUDA device" in line]
    assert len(rows) == len(g.CHECKS) and all("SKIP" in row for row in rows)
    assert "Traceback" not in result.stderr


def _audit(monkeypatch, names):
    from tests.support.cuda_standin import Standin
    g = _gpu_check()
    Standin().install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # fork, as tests/cuda
    return {name: g.sync_warnings(build, use) for name, build, use in g.audit_cases()
            if name in names}


AUDITED = ["uint8 pairs", "fp16 normalized", "MixUp", "CutMix", "dict, masks and boxes",
           "isolated engine"]


def test_gpu_check_sync_audit_under_the_stand_in(monkeypatch):
    """The synchronisation audit's cases run under the CUDA stand-in, which warns on
    the calls that make the host wait for the device (item, tolist, a copy to the
    host) as set_sync_debug_mode("warn") does on a GPU: none in steady state."""
    assert _audit(monkeypatch, AUDITED) == dict.fromkeys(AUDITED, 0)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchronizing"):
            torch.zeros(2, device="cuda").sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_gpu_check_sync_audit_images_and_targets(monkeypatch):
    # images_and_targets takes the sizes from the batch's host copy: no read-back.
    name = "variable size, images_and_targets"
    assert _audit(monkeypatch, [name]) == {name: 0}
