"""The benchmark suite runs end to end on a tiny dataset and writes sane files.

Each subcommand runs in a subprocess (as users run it) with a timeout. Only the
shape of the outputs is checked: speed figures are measured, never asserted.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
import subprocess
import textwrap
import threading
import sys

import pytest
import torch

from feeder.engine.threads import available_cores
from tests.support import REPO_DIR, run_in_thread
from tests.support.warm import run_module

pytest.importorskip("feeder.bench")

TIMEOUT_S = 240  # generous for a loaded 2-core machine; a normal run takes seconds


# The subprocesses import the feeder package under test, whatever their folder.
ROOT = REPO_DIR


def bench(*args: str, cwd: str, env: dict[str, str] | None = None,
          timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``feeder-bench ARGS`` as its own process, forked from the test process's warm
    interpreter (:mod:`tests.support.warm`: no torch import per command); the
    measurement runs it starts are fresh interpreters, as ever."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = run_module("feeder.bench", list(args), cwd=str(cwd), env=env, timeout=timeout)
    assert proc.returncode == 0, f"feeder-bench {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
    return proc


def bench_here(*args: str, cwd, monkeypatch, capsys) -> tuple[int, str, str]:
    """``feeder-bench`` run through its ``main()`` in this process (in a helper
    thread, bounded by TIMEOUT_S): ``(exit status, stdout, stderr)``. For the
    checks of where results go and of refused arguments, where a subprocess
    would add only an interpreter's start (seconds of importing torch)."""
    from feeder.bench.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()

    def run():
        try:
            return main(list(args))
        except SystemExit as exc:  # what the interpreter makes of it, as a subprocess would
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
                return 1
            return exc.code

    code = run_in_thread(run, TIMEOUT_S)
    out, err = capsys.readouterr()
    return code, out, err


def read_csv(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("bench")
    data = str(base / "data")
    bench("make-data", data, "--n-classes", "2", "--per-class", "12", "--seed", "3", cwd=str(base))
    return {"base": str(base), "data": data}


def test_make_data_is_an_image_folder(tiny):
    from feeder import ImageFolder

    folder = ImageFolder(tiny["data"])
    assert len(folder) == 24 and folder.classes == ["class_00", "class_01"]


def test_make_data_is_deterministic(tiny, tmp_path, monkeypatch, capsys):
    again = str(tmp_path / "again")
    code, _, _ = bench_here("make-data", again, "--n-classes", "2", "--per-class", "12", "--seed", "3",
                            cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0
    for cls in ("class_00", "class_01"):
        for name in sorted(os.listdir(os.path.join(tiny["data"], cls))):
            with open(os.path.join(tiny["data"], cls, name), "rb") as a, \
                    open(os.path.join(again, cls, name), "rb") as b:
                assert a.read() == b.read()


def test_ceiling(tiny, tmp_path):
    out = str(tmp_path / "out")
    proc = bench("ceiling", tiny["data"], "--out", out, "--repeats", "1", "--limit", "10",
                 "--processes", "2", cwd=tiny["base"])
    assert "ceiling img/s" in proc.stdout
    single, parallel = read_csv(os.path.join(out, "ceiling.csv"))
    assert int(single["images"]) == 10 and int(single["cores"]) >= 1
    assert parallel["how"] == "2 processes at once" and int(parallel["cores"]) == 2
    assert int(parallel["images"]) == 20  # 10 per process, none twice (24 images in the set)
    for row in (single, parallel):
        assert float(row["ceiling_images_per_s"]) > 0
        assert float(row["decode_ms"]) > 0 and float(row["per_image_ms"]) >= float(row["decode_ms"])
    assert float(parallel["of_single_x_cores"]) > 0
    doc = json.load(open(os.path.join(out, "ceiling.json")))
    assert doc["machine"]["available_cores"] >= 1 and doc["machine"]["torch_version"]


@pytest.mark.parametrize("size,limit,shards", [(24, 10, 2), (24, 10, 3), (2000, 500, 2), (7, 5, 4), (5, 5, 1)])
def test_ceiling_shares_are_disjoint_and_spread(size, limit, shards):
    from feeder.bench.ceiling import timed_indices

    shares = [timed_indices(size, limit, k, shards) for k in range(shards)]
    every = [i for share in shares for i in share]
    assert len(every) == len(set(every)) == min(limit * shards, size)
    assert all(len(share) <= limit for share in shares)
    assert set(every) == set(timed_indices(size, limit * shards))
    assert min(every) == 0 and max(every) == size - 1


def test_parallel_ceiling_names_a_failing_process(tmp_path):
    from feeder.bench.ceiling import measure_parallel

    missing = str(tmp_path / "no-such-dataset")
    with pytest.raises(RuntimeError, match=r"process ceiling-\d failed: .*no-such-dataset"):
        measure_parallel(missing, processes=2, limit=4, timeout_s=60)


@pytest.mark.timeout(TIMEOUT_S + 30)  # several loaders in subprocesses: minutes on a loaded 2-core machine
def test_compare(tiny, tmp_path):
    """The whole comparison, every run a real child process: the rows, the scan
    and the ratios. (The consumer's model step is checked on one run below, where
    it costs seconds instead of minutes; the table's column for it on stood-in
    runs.)"""
    out = str(tmp_path / "out")
    # One DataLoader point per kind (the scan's pick among several is checked on
    # stood-in runs below).
    proc = bench("compare", tiny["data"], "--out", out, "--repeats", "1", "--workers-grid", "0",
                 "--threads-grid", "2x0", "--batch-size", "8", "--ceiling-images", "8",
                 "--targets", cwd=tiny["base"], env={"OMP_NUM_THREADS": "1"},
                 # About 10 child runs, each importing torch: minutes on a loaded 2-core machine.
                 timeout=3 * TIMEOUT_S)
    assert "feeder auto" in proc.stdout and "acceptance targets" in proc.stdout
    assert os.path.exists(os.path.join(out, "compare_targets.csv"))
    rows = {r["row"]: r for r in read_csv(os.path.join(out, "compare.csv"))}
    expected = {"idle baseline", "ceiling", "parallel ceiling", "DataLoader+cv2", "feeder auto",
                "feeder best grid"}
    try:
        import PIL  # noqa: F401

        expected.add("DataLoader+PIL")
    except ImportError:
        pass
    assert expected <= set(rows)
    assert float(rows["parallel ceiling"]["images_per_s"]) > 0
    assert float(rows["feeder auto"]["of_parallel"]) > 0
    for name in expected - {"idle baseline", "ceiling", "parallel ceiling"}:
        r = rows[name]
        assert float(r["images_per_s"]) > 0, r
        assert float(r["cpu_ms_per_image"]) > 0, r
        assert 0 < float(r["first_batch_s"]) < TIMEOUT_S, r
        assert float(r["images"]) == 24, r  # every sample, once, per epoch
        assert 0 < float(r["consumer_wait"]) <= 1, r
    if os.path.exists("/proc/self/smaps_rollup"):
        assert float(rows["feeder auto"]["peak_pss_mib"]) > 10
        assert float(rows["idle baseline"]["peak_pss_mib"]) > 10
    scan = read_csv(os.path.join(out, "compare_scan.csv"))
    assert sum(r["best"] == "*" for r in scan) == len({r["kind"] for r in scan})
    ratios = read_csv(os.path.join(out, "compare_ratios.csv"))
    assert {r["versus"] for r in ratios} >= {"DataLoader+cv2"}
    assert {r["feeder"] for r in ratios} == {"feeder auto", "feeder best grid", "parallel ceiling"}
    assert all(float(r["throughput"]) > 0 for r in ratios)
    doc = json.load(open(os.path.join(out, "compare.json")))
    assert doc["meta"]["raw_rounds"] and doc["targets"]
    # Without --model the loop runs no step.
    assert all("model_steps" not in x["extra"] for x in doc["meta"]["raw_rounds"][0].values())


@pytest.mark.parametrize("kind", ["feeder", "dl-cv2"])
def test_a_loader_run_with_the_model_steps_once_per_batch(tiny, kind):
    """``--model``: the consumer runs the ResNet-style step on every batch it takes,
    and the run reports how many (here in this process, at 64 px, on the
    benchmark's own loaders)."""
    from feeder.bench.runner import execute

    got = execute({"mode": "loader", "root": tiny["data"], "batch_size": 8, "epochs": 2, "device": "cpu",
                   "seed": 0, "model": True, "kind": kind, "workers": 0, "decode_threads": 2,
                   "augment_threads": 0, "size": 64})
    assert got["images"] == 48 and got["extra"]["model_steps"] == 6  # 24 images, batches of 8, 2 epochs
    assert got["extra"]["epoch_images"] == [24, 48]
    assert 0 <= got["extra"]["consumer_wait_s"] < got["wall_s"]


@pytest.mark.parametrize("targets", [False, True])
def test_compare_shows_a_users_table_and_targets_only_when_asked(tiny, tmp_path, monkeypatch, capsys, targets):
    """The last table puts the feeder against DataLoader in speed, first batch and
    memory; the acceptance targets come only with --targets; the scan marks the
    fastest point of each loader, which the rounds then measure. (The measured runs
    are stood in for: this checks the report, test_compare the measuring.)"""
    from feeder.bench import cli, compare
    from feeder.bench.measure import RunResult

    mib = 2**20
    rates = {"dl-pil": 100.0, "dl-cv2": 150.0, "feeder": 300.0}

    def child(spec):
        mode, kind = spec.get("mode"), spec.get("kind")
        if mode == "idle":
            return RunResult(spec, ok=True, wall_s=1.0, peak_pss=100 * mib)
        if mode in ("ceiling", "ceiling-parallel"):
            return RunResult(spec, ok=True, images=450, wall_s=1.0, cpu_s=1.0,
                             extra={"ceiling_images_per_s": 500.0})
        rate = rates[kind] * (0.5 if spec.get("workers") == 0 else 1.0)  # DataLoader: 1 worker is best
        return RunResult(spec, ok=True, images=300, wall_s=300 / rate, cpu_s=1.0,
                         first_batch_s=0.5 if kind == "feeder" else 2.0,
                         peak_pss=(220 if kind == "feeder" else 500) * mib)

    monkeypatch.setattr(compare, "run_child", child)
    out = str(tmp_path / "out")
    # With the targets the stood-in runs are of --model too: the loop's wait gets its column.
    argv = ["compare", tiny["data"], "--out", out, "--repeats", "1", "--workers-grid", "0,1",
            "--threads-grid", "2x0"] + (["--targets", "--model"] if targets else [])
    capsys.readouterr()
    assert compare.run(cli.build_parser().parse_args(argv)) == 0
    text = capsys.readouterr().out
    scan = read_csv(os.path.join(out, "compare_scan.csv"))
    kinds = {r["kind"] for r in scan}
    assert len(scan) == 2 * (len(kinds) - 1) + 1  # two worker counts per DataLoader kind, one feeder point
    assert sorted((r["kind"], r["setting"]) for r in scan if r["best"] == "*") == sorted(
        [(k, "num_workers=1") for k in kinds - {"feeder"}] + [("feeder", "decode=2 augment=0 queue=4")])
    rows = {r["row"]: r for r in read_csv(os.path.join(out, "compare.csv"))}
    assert rows["DataLoader+cv2"]["setting"] == "num_workers=1"
    assert "first batch, s" in text and "memory above idle, MiB" in text
    ratios = {(r["feeder"], r["versus"]): r for r in read_csv(os.path.join(out, "compare_ratios.csv"))}
    auto = ratios[("feeder auto", "DataLoader+cv2")]
    assert float(auto["throughput"]) == 2.0
    assert auto["first_batch_both"] == "0.50 vs 2.00" and float(auto["first_batch"]) == 0.25
    assert auto["pss_added_both"] == "120 vs 400" and float(auto["pss_added"]) == 0.3
    doc = json.load(open(os.path.join(out, "compare.json")))
    assert ("acceptance targets" in text) == targets and (" NO " in text or " yes " in text) == targets
    assert ("loop waited" in text) == targets
    assert os.path.exists(os.path.join(out, "compare_targets.csv")) == targets
    assert ("targets" in doc) == targets


def test_sweep(tiny, tmp_path):
    out = str(tmp_path / "out")
    proc = bench("sweep", tiny["data"], "--out", out, "--decode", "1,2", "--augment", "1",
                 "--step-ms", "0,5", "--batch-size", "8", cwd=tiny["base"])
    assert "auto" in proc.stdout and "within noise of the best" in proc.stdout
    rows = read_csv(os.path.join(out, "sweep.csv"))
    assert {float(r["step_ms"]) for r in rows} == {0.0, 5.0}
    assert sum(r["auto"] == "auto" for r in rows) == 2  # the auto point, once per step
    for r in rows:
        assert float(r["images_per_s"]) > 0
        assert 0.0 <= float(r["starvation"]) <= 1.0
        runs = json.loads(r["repeats_images_per_s"])
        assert len(runs) == 3  # three runs per point unless told otherwise
        assert float(r["low"]) == min(runs) <= float(r["images_per_s"]) <= max(runs) == float(r["high"])
    for step in (0.0, 5.0):
        at = [r for r in rows if float(r["step_ms"]) == step]
        assert [r["vs_best"] for r in at].count("best") == 1
    best = read_csv(os.path.join(out, "sweep_auto.csv"))
    assert {r["auto_vs_best"] for r in best} <= {"best", "~best", "below"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert os.path.getsize(os.path.join(out, "sweep.png")) > 1000


def test_sweep_marks_the_points_whose_runs_reach_the_best():
    from feeder.bench.sweep import mark_equivalent

    def row(name, low, median, high):
        return {"name": name, "low": low, "images_per_s": median, "high": high}

    rows = [row("a", 90, 100, 110), row("b", 85, 90, 91), row("c", 60, 70, 89), row("d", 95, 96, 97)]
    best = mark_equivalent(rows)
    assert best["name"] == "a"
    assert {r["name"]: r["vs_best"] for r in rows} == {"a": "best", "b": "~best", "c": "", "d": "~best"}
    single = [row("a", 100, 100, 100), row("b", 99, 99, 99)]  # one run each: no spread, no equivalence
    mark_equivalent(single)
    assert [r["vs_best"] for r in single] == ["best", ""]


def test_scaled_decode(tmp_path, monkeypatch, capsys):
    data = str(tmp_path / "large")
    # The data in this process (make-data has tests of its own); the measurement as users run it.
    code, _, _ = bench_here("make-data", data, "--large", "--n-classes", "1", "--per-class", "6",
                            cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0
    out = str(tmp_path / "out")
    proc = bench("scaled-decode", data, "--out", out, "--repeats", "1", "--batch-size", "4",
                 "--ceiling-images", "4", cwd=str(tmp_path))
    assert "full (forced)" in proc.stdout
    rows = read_csv(os.path.join(out, "scaled_decode.csv"))
    assert [r["row"] for r in rows] == ["scaled (default)", "full (forced)"]
    assert all(float(r["images_per_s"]) > 0 for r in rows)
    doc = json.load(open(os.path.join(out, "scaled_decode.json")))
    diff = doc["meta"]["output_difference"]
    # Same crop boxes: only the resampling path differs, so the mean difference is small.
    assert diff["mean_abs_diff"] < 12 and diff["reduced_share"] > 0


def test_make_data_small_and_large_exclude_each_other(tmp_path, monkeypatch, capsys):
    status, _, err = bench_here("make-data", str(tmp_path / "x"), "--small", "--large", cwd=tmp_path,
                                monkeypatch=monkeypatch, capsys=capsys)
    assert status == 2 and "not allowed with" in err
    assert not os.path.exists(tmp_path / "x")


def test_make_data_small_writes_small_images(tmp_path):
    import simplejpeg

    data = str(tmp_path / "small")
    proc = bench("make-data", data, "--small", "--n-classes", "2", "--per-class", "5", cwd=str(tmp_path))
    assert "10 JPEGs in 2 classes" in proc.stdout
    for folder in sorted(os.listdir(data)):
        for name in os.listdir(os.path.join(data, folder)):
            with open(os.path.join(data, folder, name), "rb") as f:
                h, w, _, _ = simplejpeg.decode_jpeg_header(f.read())
            assert 64 <= h <= 96 and 64 <= w <= 96


def test_the_feeder_loader_holds_no_batch_the_loop_dropped(tiny):
    """``Loader.epoch`` hands the first batch on and keeps no reference to it: a
    batch held for the whole epoch keeps its buffer from coming back, and the
    pool grows by one (memory no training loop spends, counted as the feeder's)."""
    import gc
    import weakref

    from feeder.bench.loaders import Loader

    loader = Loader("feeder", tiny["data"], 4, decode_threads=1, augment_threads=0)
    try:
        epoch = loader.epoch(0)
        first = run_in_thread(lambda: next(epoch))
        gone = weakref.ref(first[0])
        del first
        run_in_thread(lambda: next(epoch))
        gc.collect()
        assert gone() is None
        run_in_thread(lambda: [None for _ in epoch])
        assert loader.stats()["memory"]["batch_buffers"] > 0
    finally:
        loader.close()


def test_full_decode_transforms_keep_the_crops():
    """The full-decode variant disables the hint without changing any random stream."""
    import numpy as np

    import simplejpeg

    from feeder.bench.loaders import sample_work, full_decode_transforms, transforms
    from feeder.synthetic import make_image

    scaled, full = sample_work(transforms()), sample_work(full_decode_transforms())
    assert scaled.plan is not None and full.plan is None
    # Small enough that the hint never asks for a reduced scale: outputs must be equal.
    data = simplejpeg.encode_jpeg(make_image(300, 400, seed=1), quality=90, colorspace="RGB")
    a, b = np.empty((224, 224, 3), np.uint8), np.empty((224, 224, 3), np.uint8)
    for key in range(5):
        scaled(data, key, a)
        full(data, key, b)
        assert np.array_equal(a, b)


def test_image_source_limit_spreads_over_the_folder(tiny):
    """A limit takes images from every class, the same ones each time, and the
    loaders run over them with any crop side."""
    from feeder import ImageFolder
    from feeder.bench.loaders import FeederWorkDataset, image_source

    folder = ImageFolder(tiny["data"])
    assert image_source(tiny["data"]).paths == folder.paths
    assert image_source(tiny["data"], 100).paths == folder.paths  # a limit above the size: all
    part = image_source(tiny["data"], 6)
    assert len(part) == 6 and len(set(part.paths)) == 6 and set(part.paths) <= set(folder.paths)
    assert sorted(set(int(x) for x in part.labels)) == [0, 1]
    assert [folder.labels[folder.paths.index(p)] for p in part.paths] == [int(x) for x in part.labels]
    assert image_source(tiny["data"], 6).paths == part.paths
    dataset = FeederWorkDataset(tiny["data"], limit=6)
    image, label = dataset.sample(5, epoch=1)
    assert len(dataset) == 6 and tuple(image.shape) == (224, 224, 3) and label == part.labels[5]


def test_table_and_csv_without_matplotlib(tmp_path):
    from feeder.bench import report

    rows = [{"a": "x", "b": 1.5, "c": None}, {"a": "yy", "b": float("nan"), "c": [1, 2]}]
    text = report.format_table(rows, [("a", "A", "{}"), ("b", "B", "{:.1f}"), ("c", "C", "{}")])
    assert "1.5" in text and "-" in text
    path = str(tmp_path / "t.csv")
    report.write_csv(path, rows)
    assert read_csv(path)[1]["c"] == "[1, 2]"


def test_decode_cost_experiment(tiny):
    script = os.path.join(ROOT, "bench", "experiments", "decode_cost.py")
    proc = subprocess.run([sys.executable, script, tiny["data"], "--limit", "8", "--repeats", "1"],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    full = next(line for line in lines if line.startswith("simplejpeg, full size"))
    assert "100%" in full
    assert any(line.startswith("simplejpeg, 1/8 scale") for line in lines)
    model = proc.stdout[proc.stdout.index("region-of-interest model"):]
    assert "% of a full decode" in model


def _span(name, cat, ts, dur, stream):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlap_summary_of_a_side_stream_copy():
    from feeder.bench.overlap import summarize

    h2d = "Memcpy HtoD (Pinned -> Device)"
    events = [
        _span("conv", "kernel", 0, 100, 7), _span("gemm", "kernel", 150, 150, 7),
        _span("tiny", "kernel", 400, 10, 20),           # the copy stream's own kernel: not compute
        _span(h2d, "gpu_memcpy", 50, 70, 20),           # 50 us under conv, 20 in the gap
        _span(h2d, "gpu_memcpy", 290, 30, 20),          # 10 us under gemm
        {"ph": "i", "name": h2d, "ts": 0},              # instant events are ignored
        _span("cudaMemcpyAsync", "cuda_runtime", 0, 5, None),
    ]
    s = summarize(events)
    assert s["copies"] == 2 and s["copy_us"] == 100
    assert s["compute_stream"] == 7 and s["on_compute_stream"] == 0
    assert s["overlapped_us"] == 60 and s["overlapped"] == 0.6
    assert s["copy_streams"] == ["20"] and s["kernels"] == 3 and s["pageable"] == 0


def test_overlap_summary_of_copies_on_the_compute_stream():
    from feeder.bench.overlap import summarize

    events = [_span("conv", "kernel", 0, 100, 7), _span("conv", "kernel", 90, 100, 7),
              _span("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 200, 40, 7)]
    s = summarize(events)
    assert s["on_compute_stream"] == 1 and s["overlapped_us"] == 0 and s["overlapped"] == 0
    assert s["pageable"] == 1 and s["kernel_us"] == 200
    assert summarize([])["overlapped"] is None


@pytest.mark.parametrize("kind", ["feeder", "dl-cv2"])
def test_overlap_profiles_a_training_step(tiny, tmp_path, kind):
    import gzip

    from feeder.bench.overlap import profile_loader

    import torch

    trace = str(tmp_path / "trace.json.gz")
    # The model's step on one torch thread, as in test_compare (a second thread
    # spins for a core the other test process holds); the count is restored.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        s = profile_loader(kind, tiny["data"], batch_size=4, workers=0, batches=2, warmup=1,
                           trace_path=trace, device="cpu")
    finally:
        torch.set_num_threads(threads)
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    assert any("conv" in e.get("name", "") for e in events)  # the model's step was traced
    assert s["copies"] == 0 and s["overlapped"] is None  # no device: no host-to-device copy
    assert s["images_per_s"] > 0 and 0 <= s["consumer_wait"] <= 1 and s["batches"] == 2


def test_overlap_command_refuses_without_cuda_or_with_a_wrong_loader(tiny, tmp_path, monkeypatch, capsys):
    import torch

    cmd = ["overlap", tiny["data"], "--out", str(tmp_path)]
    code, _, err = bench_here(*cmd, "--loaders", "feeder,nope", cwd=tmp_path, monkeypatch=monkeypatch,
                              capsys=capsys)
    assert code == 2 and "unknown loader 'nope'" in err
    if not torch.cuda.is_available():
        code, _, err = bench_here(*cmd, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
        assert code == 2 and "needs a CUDA GPU" in err


# -- where results go without --out --------------------------------------------------------

def _tree(path: str) -> dict[str, float]:
    """Every file under ``path`` with its modification time."""
    return {os.path.join(d, n): os.stat(os.path.join(d, n)).st_mtime_ns
            for d, _, names in os.walk(path) for n in names}


def test_default_out_is_a_new_folder_in_the_current_folder(tiny, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    code, _, err = bench_here("ceiling", tiny["data"], "--repeats", "1", "--limit", "4", "--processes", "1",
                              cwd=work, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0
    made = sorted(os.listdir(work))
    assert len(made) == 1 and made[0].startswith("feeder-bench-results-")
    assert os.path.isfile(work / made[0] / "ceiling.csv")
    assert made[0] in err  # the run says where its results went


def test_default_out_never_reuses_a_folder(tmp_path):
    from feeder.bench.cli import default_out

    first, second = default_out(str(tmp_path)), default_out(str(tmp_path))
    assert first != second and os.listdir(first) == os.listdir(second) == []
    assert {os.path.dirname(first), os.path.dirname(second)} == {str(tmp_path.resolve())}


def test_default_out_inside_the_checkout_goes_to_the_temp_folder(tiny, tmp_path, monkeypatch, capsys):
    import tempfile

    from feeder.bench.cli import checkout_root

    assert checkout_root() is not None and str(checkout_root()) == os.path.realpath(ROOT)
    temp = tmp_path / "temp"
    temp.mkdir()
    results = os.path.join(ROOT, "bench", "results")
    before, top = _tree(results), set(os.listdir(ROOT))
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    code, _, _ = bench_here("ceiling", tiny["data"], "--repeats", "1", "--limit", "4", "--processes", "1",
                            cwd=os.path.join(ROOT, "bench"), monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0
    assert _tree(results) == before and set(os.listdir(ROOT)) == top
    assert not any(n.startswith("feeder-bench-results-") for n in os.listdir(os.path.join(ROOT, "bench")))
    made = os.listdir(temp)
    assert len(made) == 1 and os.path.isfile(temp / made[0] / "ceiling.csv")


def test_the_regeneration_scripts_write_into_bench_results():
    for script in ("run_all.sh", "run_gpu.sh"):
        text = open(os.path.join(ROOT, "bench", script)).read()
        assert 'out="${FEEDER_BENCH_OUT:-bench/results' in text
        # A command, or a step of run_gpu.sh running one: "step NAME BUDGET bench ...".
        calls = [line for line in text.splitlines()
                 if re.match(r"\s*(step \w+ \d+ )?bench ", line) and "make-data" not in line]
        assert calls and all('--out "$out' in line for line in calls), script


@pytest.mark.parametrize("command, extra, name, runs", [
    ("read-latency", ["--limit", "16", "--latency-ms", "2"], "read_latency",
     {"feeder, no latency", "feeder, defaults", "feeder, blocking reads", "DataLoader, 0 workers"}),
    ("remote", ["--latency-ms", "1", "--shard-size", "200KB"], "remote",
     {"feeder, epoch 1, defaults", "feeder, epoch 1, blocking reads", "DataLoader, 0 workers, no cache",
      "feeder, epoch 2 (cache)"}),
    ("shards", ["--shard-size", "200KB", "--epochs", "1"], "shards",
     {"feeder, folder of files", "feeder, local shards", "DataLoader 0 workers, files",
      "DataLoader 0 workers, shards"}),
])
def test_storage_benchmarks(tiny, tmp_path, command, extra, name, runs):
    out = str(tmp_path / "out")
    proc = bench(command, tiny["data"], "--out", out, "--rounds", "1", "--workers", "0",
                 "--batch-size", "8", *extra, cwd=tiny["base"])
    assert "target" in proc.stdout
    rows = read_csv(os.path.join(out, f"{name}.csv"))
    assert {r["run"] for r in rows} == runs
    assert all(float(r["img_s"]) > 0 for r in rows)
    targets = read_csv(os.path.join(out, f"{name}_targets.csv"))
    assert targets and all(t["met"] in ("yes", "NO") for t in targets)
    if command == "remote":
        by_run = {r["run"]: r for r in rows}
        assert float(by_run["feeder, epoch 2 (cache)"]["requests"]) == 0
        assert float(by_run["feeder, epoch 1, blocking reads"]["requests"]) >= 24


# -- interference ----------------------------------------------------------------------------

def test_interference(tiny, tmp_path):
    import statistics

    out = str(tmp_path / "out")
    # The proxy step only: every run is a child process (the model step is covered below).
    proc = bench("interference", tiny["data"], "--out", out, "--rounds", "2", "--batch-size", "4",
                 "--steps", "proxy", "--windows", "2", "--window-s", "0.05", "--capacity-s", "0.05",
                 # A slow pace: each fed window takes one batch, ready in the loader's full queue.
                 "--feed-share", "0.05",
                 "--proxy-ops", "20", "--warmup", "1", "--device", "cpu", cwd=tiny["base"],
                 # Without --raw-out the per-step data goes under the cache folder.
                 env={"FEEDER_CACHE": str(tmp_path / "cache")})
    assert "fed/idle" in proc.stdout
    rows = read_csv(os.path.join(out, "interference.csv"))
    loaders = ["alone", "work-thread", "feeder", "feeder-process", "dataloader"]
    assert [(r["step"], r["loader"]) for r in rows] == [("proxy", n) for n in loaders]
    # The results folder keeps the summary (settings, machine, rows), not the step times:
    # those are in the compressed raw file the summary names, outside the results folder.
    summary = json.load(open(os.path.join(out, "interference.json")))
    assert "raw_rounds" not in summary["meta"] and summary["meta"]["failed_runs"] == 0
    raw_path = summary["meta"]["raw"]
    assert os.path.dirname(raw_path) == str(tmp_path / "cache" / "bench") and raw_path.endswith(".json.gz")
    with gzip.open(raw_path, "rt") as f:
        doc = json.load(f)
    assert doc["rows"] == summary["rows"] and doc["command"] == summary["command"]
    raw = doc["meta"]["raw_rounds"]
    assert len(raw) == 2 and doc["meta"]["failed_runs"] == 0
    for row in doc["rows"]:
        step, name = row["step"], row["loader"]
        runs = [rnd[f"{step} {name}"] for rnd in raw]
        loop, mean = [], []
        for r in runs:
            idle, fed = r["extra"]["idle"], r["extra"]["fed"]
            # Every fed window sits between two idle ones, and each window timed steps.
            assert len(fed) == 2 and len(idle) == 3
            assert all(w["steps"] for w in idle) and all(w["steps"] for w in fed)
            ref = [statistics.mean(w["steps"]) for w in idle]
            for k, w in enumerate(fed):
                # The loop's busy time per step: every step it ran and its work in next(),
                # not its sleep waiting for a late batch.
                busy = (w["span_s"] - w["slept_s"]) / (len(w["steps"]) + w["stalls"])
                loop.append(busy / ((ref[k] + ref[k + 1]) / 2))
                mean.append(statistics.mean(w["steps"]) / ((ref[k] + ref[k + 1]) / 2))
                assert 0 <= w["slept_s"] <= w["wait_s"] <= w["span_s"]
                assert w["batches"] * 4 == w["images"]
        # Each fed window against the mean of its idle neighbours, median of all.
        assert row["slowdown"] == pytest.approx(statistics.median(loop))
        assert row["step_mean"] == pytest.approx(statistics.median(mean))
        assert row["pairs"] == 4 and row["runs"] == 2
        assert row["idle_ms"] == pytest.approx(
            1e3 * statistics.mean(x for r in runs for w in r["extra"]["idle"] for x in w["steps"]))
        if name == "alone":
            assert row["images_per_s"] is None and row["loader_busy"] is None
        else:
            # Throughput in the same runs: the images the loop took over the fed windows.
            assert row["images_per_s"] == pytest.approx(
                statistics.median(r["images"] / r["wall_s"] for r in runs))
            for r in runs:
                assert r["images"] == sum(w["images"] for w in r["extra"]["fed"]) > 0
                assert r["images"] % 4 == 0
                assert r["extra"]["capacity_images_per_s"] > 0
            assert row["loader_busy"] >= 0 and row["loader_idle"] >= 0
    pinned = doc["meta"]["loop_cores"] is not None
    assert pinned == (len(os.sched_getaffinity(0)) >= 2)
    if pinned:
        assert not set(doc["meta"]["loop_cores"]) & set(doc["meta"]["loader_cores"])


def test_interference_idle_windows_wait_until_the_loader_is_dry():
    """An idle window starts only once the loader's CPU use has fallen, and says so."""
    from feeder.bench.fedloop import Windows

    spent = {"cpu": 0.0, "steps": 0}

    def step(*batch):
        spent["steps"] += 1
        # A loader that keeps working for the first 50 steps, then stops.
        if spent["steps"] <= 50:
            spent["cpu"] += 0.01

    loop = Windows(step, iter(()), ((), ()), lambda: spent["cpu"], window_s=0.01, probe_s=0.0)
    got = loop.idle()
    assert got["drained"] and spent["steps"] > 50
    assert got["steps"] and got["loader_cpu"] == 0.0
    # A loader that never stops: the drain gives up at its limit and the window says so.
    busy = Windows(step, iter(()), ((), ()), lambda: spent["steps"] * 1.0, window_s=0.01,
                   probe_s=0.0, drain_limit_s=0.05)
    got = busy.idle()
    assert not got["drained"] and got["loader_cpu"] > 0


def test_interference_fed_windows_take_batches_at_the_pace(monkeypatch):
    import itertools

    import torch

    from feeder.bench import fedloop
    from feeder.bench.fedloop import Windows

    # A clock of our own: each reading moves it 1 ms, wall and thread time
    # alike, so that a next() that returns at once is never taken for a wait
    # (on the real clock, a busy machine that preempts the test inside next()
    # made it one).
    ticks = itertools.count()
    monkeypatch.setattr(fedloop, "now", lambda: next(ticks) * 1e-3)
    cpu_ticks = itertools.count()
    monkeypatch.setattr(fedloop.time, "thread_time", lambda: next(cpu_ticks) * 1e-3)
    taken = []

    def batches():
        while True:
            taken.append(1)
            yield (torch.zeros(4, 1), torch.zeros(4))

    loop = Windows(lambda *b: None, batches(), (torch.zeros(4, 1), torch.zeros(4)), lambda: 0.0,
                   window_s=0.2)
    got = loop.fed(period_s=1.0)
    # One batch at the window's start, none after: the next is due after the window.
    assert got["images"] == 4 and len(taken) == 1
    assert got["stalls"] == 0 and len(got["steps"]) > 1


def test_interference_fed_window_outlasting_its_span_still_times_a_clean_step(monkeypatch):
    """A late first batch that takes longer than the window (a busy machine) does
    not leave the window without a step to compare: it runs on to one clean step."""
    import itertools

    import torch

    from feeder.bench import fedloop
    from feeder.bench.fedloop import Windows

    clock = {"t": 0.0}

    def tick():
        clock["t"] += 1e-3
        return clock["t"]

    monkeypatch.setattr(fedloop, "now", tick)
    cpu_ticks = itertools.count()
    monkeypatch.setattr(fedloop.time, "thread_time", lambda: next(cpu_ticks) * 1e-6)

    def batches():
        first = True
        while True:
            if first:
                clock["t"] += 0.5  # the first next() sleeps for ten windows
                first = False
            yield (torch.zeros(4, 1), torch.zeros(4))

    loop = Windows(lambda *b: None, batches(), (torch.zeros(4, 1), torch.zeros(4)), lambda: 0.0,
                   window_s=0.05)
    got = loop.fed(period_s=1.0)
    assert got["stalls"] == 1 and got["batches"] == 1
    assert len(got["steps"]) == 1 and got["span_s"] > 0.5


def test_interference_rejects_an_unknown_loader(tiny, tmp_path, monkeypatch, capsys):
    code, _, err = bench_here("interference", tiny["data"], "--out", str(tmp_path), "--loaders", "feeder,nope",
                              cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code != 0 and "unknown step or loader 'nope'" in err


@pytest.mark.parametrize("cores,loop,loader,expected", [
    ([0, 1], 1, 1, ([0], [1])),
    ([3, 1, 2, 0], 1, 2, ([0], [1, 2])),
    ([5], 1, 1, (None, None)),       # not enough cores: not pinned
    ([0, 1, 2], 2, 2, (None, None)),
])
def test_interference_splits_the_cores(cores, loop, loader, expected):
    from feeder.bench.fedloop import split_cores

    assert split_cores(cores, loop, loader) == expected


def test_interference_feeder_rows_pass_their_options_to_the_feeder(tiny):
    """A row is a loader kind and its options: an engine option is a one-line entry."""
    from feeder.bench import fedloop

    spec = {"root": tiny["data"], "batch_size": 4, "queue_size": 2, "seed": 0, "device": "cpu",
            "proxy_ops": 5, "model_batch": 1, "warmup": 1, "windows": 1, "window_s": 0.05,
            "feed_share": 0.7, "capacity_s": 0.05, "step": "proxy",
            "loop_cores": None, "loader_cores": None, "loader_threads": 1,
            "loader": {"kind": "feeder", "options": {"ordered": False}}}
    got = fedloop.child(spec)
    assert len(got["extra"]["fed"]) == 1 and got["images"] > 0
    assert got["extra"]["stages"]["decode"]["items"] >= 8
    spec["loader"] = {"kind": "feeder", "options": {"ordered": "no"}}
    with pytest.raises(ValueError, match="ordered"):
        fedloop.child(spec)


def test_interference_model_step_runs_alone_and_fed(tiny):
    from feeder.bench import fedloop, interference

    # One-second windows: a step that follows a wait in next() is not timed, and on a
    # busy machine a short window could hold only such steps, or none (a half-second
    # window held none beside a second test process and a benchmark on 2 cores).
    spec = {"root": tiny["data"], "batch_size": 4, "queue_size": 2, "seed": 0, "device": "cpu",
            "proxy_ops": 5, "model_batch": 1, "warmup": 1, "windows": 1, "window_s": 1.0,
            "feed_share": 0.7, "capacity_s": 0.05, "step": "model",
            "loop_cores": None, "loader_cores": None, "loader_threads": 1, "loader": None}
    alone = fedloop.child(spec)
    assert [len(w["steps"]) > 0 for w in alone["extra"]["idle"] + alone["extra"]["fed"]] == [True] * 3
    assert alone["images"] == 0
    spec["loader"] = interference.LOADERS["work-thread"]
    fed = fedloop.child(spec)
    assert len(fed["extra"]["fed"]) == 1 and fed["images"] >= 4 and fed["images"] % 4 == 0


def test_gil_profile_summary_tells_threads_by_their_stacks(tmp_path):
    """py-spy names threads by a cached id: a decode thread may carry an old sampler's name."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "experiments"))
    try:
        import gil_profile
    finally:
        sys.path.pop(0)
    boot = "Thread._bootstrap (threading.py:1002);Stage._main (feeder/engine/stage.py:185)"
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join([
        f"thread (11): feeder-sampler;{boot};MapStage.work (feeder/engine/stage.py:251);"
        "steps.<locals>.decode (feeder/engine/steps.py:99);SampleWork.decode (feeder/engine/steps.py:53) 30",
        f"thread (12): feeder-decode-0;{boot};MapStage.work (feeder/engine/stage.py:251);"
        "Channel.get (feeder/engine/queue.py:200) 10",
        f"thread (13): feeder-sampler;{boot};Sampler.work (feeder/engine/sampler.py:160);"
        "Stage.put (feeder/engine/stage.py:210) 5",
        "thread (14): MainThread;<module> (train.py:3);ProxyStep.__call__ (feeder/bench/fedloop.py:60) 5",
    ]) + "\n")
    threads = gil_profile.parse(str(raw))
    assert sorted(threads) == ["decode (map stage)", "sampler", "training thread"]
    text = gil_profile.summarize(threads, rate=100, images=10, seconds=1.0, top=5)
    # 40 samples at 100 Hz over 10 images: 40 ms per image, 30 of them the per-sample work.
    decode = next(line for line in text.splitlines() if line.startswith("decode (map stage)"))
    assert decode.split()[3:] == ["0.40", "40000.0", "80%", "30000.0", "10000.0"]
    assert "steps.<locals>.decode > SampleWork.decode" in text and "Channel.get" in text


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin apart")
def test_interference_pins_a_feeders_pass_threads_to_the_loader_cores(tiny):
    """A pass starts its threads at its first next(): that must happen on the loader's cores."""
    import threading

    from feeder.bench.fedloop import on_cores
    from feeder.bench.loaders import Loader

    cores = sorted(os.sched_getaffinity(0))
    loop, loader_cores = cores[:1], cores[1:2]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, loop)
    try:
        loader = Loader("feeder", tiny["data"], 4, decode_threads=1, augment_threads=0,
                        starting=lambda: on_cores(loader_cores))
        try:
            batches = loader.epoch(0)
            next(batches)
            # Back on the loop's cores between batches; the pass's threads stay on the loader's.
            assert sorted(os.sched_getaffinity(0)) == loop
            mine = [t for t in threading.enumerate()
                    if t.name.startswith("feeder-") and t.name != "feeder-reaper" and t.is_alive()]
            assert mine, [t.name for t in threading.enumerate()]
            for t in mine:
                try:
                    got = sorted(os.sched_getaffinity(t.native_id))
                except ProcessLookupError:
                    continue  # ended meanwhile
                assert got == loader_cores, t.name
            batches.close()
        finally:
            loader.close()
    finally:
        os.sched_setaffinity(0, before)


def test_interference_report_recomputes_a_saved_run(tiny, tmp_path, monkeypatch, capsys):
    """--report renders the table of a saved interference.json without measuring."""
    out = str(tmp_path / "out")
    raw = str(tmp_path / "raw" / "run.json.gz")
    bench("interference", tiny["data"], "--out", out, "--rounds", "1", "--batch-size", "4",
          "--steps", "proxy", "--loaders", "feeder", "--windows", "1", "--window-s", "0.05",
          "--capacity-s", "0.05", "--feed-share", "0.05", "--proxy-ops", "20", "--warmup", "1",
          "--device", "cpu", "--raw-out", raw, cwd=tiny["base"])
    assert json.load(open(os.path.join(out, "interference.json")))["meta"]["raw"] == raw
    first = read_csv(os.path.join(out, "interference.csv"))
    # The compressed raw file, and the same data uncompressed (as an earlier version's
    # interference.json held it), recompute the same table.
    plain = tmp_path / "plain.json"
    with gzip.open(raw, "rt") as f:
        plain.write_text(f.read())
    for i, saved in enumerate((raw, str(plain))):
        again = str(tmp_path / f"again{i}")
        code, stdout, _ = bench_here("interference", "--report", saved, "--out", again, cwd=tiny["base"],
                                     monkeypatch=monkeypatch, capsys=capsys)
        assert code == 0 and "recomputed from the measurements saved in" in stdout
        second = read_csv(os.path.join(again, "interference.csv"))
        assert [(r["loader"], r["slowdown"], r["step_mean"]) for r in first] == \
            [(r["loader"], r["slowdown"], r["step_mean"]) for r in second]
        assert json.load(open(os.path.join(again, "interference.json")))["meta"]["raw"] == saved
    bad = tmp_path / "bad.json"
    bad.write_text('{"meta": {}}')
    code, _, err = bench_here("interference", "--report", str(bad), cwd=tiny["base"], monkeypatch=monkeypatch,
                              capsys=capsys)
    assert code != 0 and "holds no windowed interference measurements" in err
    # A summary names where its raw data went.
    code, _, err = bench_here("interference", "--report", os.path.join(out, "interference.json"),
                              cwd=tiny["base"], monkeypatch=monkeypatch, capsys=capsys)
    assert code != 0 and f"raw measurements were written to {raw}" in err


def test_interference_measures_count_the_slow_tail_and_skip_undrained_windows():
    from feeder.bench.interference import pair_ratios

    idle = {"steps": [1.0] * 100, "span_s": 100.0, "drained": True}
    # 5% of the fed steps wait 4 extra units behind a loader thread: the median does not move.
    fed = {"steps": [1.0] * 95 + [5.0] * 5, "span_s": 130.0, "slept_s": 10.0, "stalls": 0,
           "batches": 10, "images": 40}
    extra = {"idle": [idle, idle], "fed": [fed]}
    assert pair_ratios(extra, "median") == [1.0]
    assert pair_ratios(extra, "mean") == [pytest.approx(1.2)]
    # The loop: 130 s less 10 s asleep in next(), over 100 steps, against 1.0 per idle step.
    assert pair_ratios(extra, "loop") == [pytest.approx(1.2)]
    # An idle neighbour that never ran dry is no reference: the window is left out.
    wet = {**idle, "drained": False}
    assert pair_ratios({"idle": [idle, wet], "fed": [fed]}, "mean") == []
    # Runs saved before the loop's sleep was recorded have no loop measure.
    old = {k: v for k, v in fed.items() if k != "slept_s"}
    assert pair_ratios({"idle": [idle, idle], "fed": [old]}, "loop") == []


def test_interference_stall_is_a_sleep_in_next_not_work_in_next():
    """A step after next() slept for a late batch is not timed; next() doing work is no stall."""
    import time as _time

    import torch

    from feeder.bench.fedloop import Windows

    def batches(kind):
        while True:
            if kind == "sleeps":
                threading.Event().wait(0.005)  # the batch is late: the loop sleeps
            else:
                end = _time.thread_time() + 0.005  # the loop's own work receiving the batch
                while _time.thread_time() < end:
                    pass
            yield (torch.zeros(4, 1), torch.zeros(4))

    batch = (torch.zeros(4, 1), torch.zeros(4))
    for kind, stalls in (("sleeps", True), ("works", False)):
        loop = Windows(lambda *b: None, batches(kind), batch, lambda: 0.0, window_s=0.1)
        got = loop.fed(period_s=0.02)
        assert got["batches"] >= 2
        # Sleep in next() is its wall time less the training thread's CPU time there.
        assert got["slept_s"] == pytest.approx(got["wait_s"] - got["next_cpu_s"], abs=1e-3)
        if stalls:
            assert got["stalls"] == got["batches"] and got["slept_s"] >= 0.004 * got["batches"]
            assert got["next_cpu_s"] < 0.3 * got["wait_s"]
        else:
            # Work, not sleep (a loaded machine may deschedule the thread a little meanwhile).
            assert got["next_cpu_s"] >= 0.004 * got["batches"]
            assert got["next_cpu_s"] > 0.3 * got["wait_s"]


def test_region_decode(tiny, tmp_path, monkeypatch, capsys):
    """The region-decode subcommand: the rows asked for, their ratios (whole runs and
    after the first epoch), the load columns and the per-stage table (the stage
    figures add up)."""
    from feeder import decode as _decode

    if _decode._jpeg is None:
        pytest.skip(f"region decoder not in use: {_decode._jpeg_missing}")
    out = str(tmp_path / "out")
    proc = bench("region-decode", tiny["data"], "--large", tiny["data"], "--out", out, "--rounds", "1",
                 "--epochs", "2", "--batch-size", "4", "--ceiling-images", "6", "--stage-images", "6",
                 "--only", "feeder region,ceiling full decode,parallel ceiling region work",
                 cwd=tiny["base"])
    rows = read_csv(os.path.join(out, "region_decode.csv"))
    assert [r["row"] for r in rows] == ["feeder region", "ceiling full decode", "parallel ceiling region work"]
    assert all(float(r["images_per_s"]) > 0 and float(r["other_cores"]) >= 0 for r in rows)
    assert float(rows[0]["images_per_s_after_epoch_1"]) > 0  # the loader's epochs after its first
    doc = json.load(open(os.path.join(out, "region_decode.json")))
    for label in ("feeder region / ceiling full decode (1-thread x cores)",
                  "feeder region / parallel ceiling region work",
                  "parallel ceiling region work / ceiling full decode"):
        ratio = doc["meta"]["ratios"][label]
        assert ratio["median"] > 0 and len(ratio["rounds"]) == 1
        assert ratio["after_epoch_1"] > 0 and len(ratio["rounds_after_epoch_1"]) == 1
    # The parallel row ran one process per core, each timing its own share of the images.
    parallel = doc["meta"]["rounds"][0]["parallel ceiling region work"]
    assert parallel["cores_used"] > 0 and parallel["cpu_ms"] > 0
    for stage in doc["meta"]["stages"].values():
        assert all(stage[k] > 0 for k in ("full", "full_decode", "region", "region_first", "region_c",
                                          "region_c_first", "crc", "entropy_to_bottom", "entropy_whole"))
        assert 0 <= stage["scaled_share"] <= 1
    assert "from the checkpoints before the crop" in proc.stdout and "region path, first epoch" in proc.stdout
    assert open(os.path.join(out, "region_decode.txt")).read().strip() == proc.stdout.strip()
    # The tables recomputed from the saved runs (in this process: no measurement runs).
    code, again, _ = bench_here("region-decode", tiny["data"], "--report",
                                os.path.join(out, "region_decode.json"), "--out", str(tmp_path / "again"),
                                cwd=tiny["base"], monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and again.strip() == proc.stdout.strip()


# -- peers ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_small(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("bench-small")
    data = str(base / "small")
    bench("make-data", data, "--small", "--n-classes", "2", "--per-class", "10", "--seed", "4", cwd=str(base))
    return {"base": str(base), "data": data}


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_peers_with_the_peers_absent(tiny_small, tmp_path, monkeypatch, capsys):
    """feeder and DataLoader rows, first and steady epochs, ratios to feeder; a peer
    that is not installed is one line saying how to install it, and no row."""
    from feeder.bench import peers

    monkeypatch.setattr(peers, "installed", lambda name: False)
    out = str(tmp_path / "out")
    code, stdout, err = bench_here("peers", tiny_small["data"], "--out", out, "--size", "64",
                                   "--batch-size", "8", "--epochs", "2", "--repeats", "1",
                                   "--workers-grid", "1", "--limit", "18", "--name", "peers_small",
                                   cwd=tiny_small["base"], monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    assert "dali: not installed (pip install nvidia-dali-cuda120)" in stdout.splitlines()
    assert "spdl: not installed (pip install spdl)" in stdout.splitlines()
    assert "Traceback" not in err
    assert sorted(os.listdir(out)) == ["machine.json", "peers_small.csv", "peers_small.json",
                                       "peers_small.txt"]
    assert open(os.path.join(out, "peers_small.txt")).read() == stdout
    rows = read_csv(os.path.join(out, "peers_small.csv"))
    bare_label = f"bare work ({available_cores()} processes, no loader)"
    assert [r["row"] for r in rows] == ["feeder", "DataLoader (num_workers=1)", bare_label]
    for r in rows:
        assert float(r["steady_images_per_s"]) > 0 and float(r["steady_ratio"]) > 0, r
        assert float(r["steady_cpu_ms_per_image"]) > 0 and float(r["steady_cores"]) > 0, r
        assert float(r["other_cores"]) >= 0, r
        assert float(r["images"]) == 2 * 18, r  # every image of the limit, once per epoch
    feeder, loader, bare = rows
    # The bare row's first epoch reads every file in every process: no first-epoch rate or ratio.
    assert bare["first_images_per_s"] == bare["first_ratio"] == "", bare
    doc_rows = json.load(open(os.path.join(out, "peers_small.json")))["rows"]
    (bare_doc,) = [r for r in doc_rows if r["kind"] == "bare"]
    assert bare_doc["first_rounds"] == bare_doc["first_ratio_rounds"] == [], bare_doc
    assert len(bare_doc["steady_ratio_rounds"]) == 1, bare_doc
    assert float(feeder["first_ratio"]) == float(feeder["steady_ratio"]) == 1.0
    assert loader["best"] == "*"
    doc = json.load(open(os.path.join(out, "peers_small.json")))
    assert doc["meta"]["skipped"] == ["dali: not installed (pip install nvidia-dali-cuda120)",
                                      "spdl: not installed (pip install spdl)"]
    assert doc["meta"]["images_per_epoch"] == 18 and doc["machine"]["torch_version"]
    assert doc["meta"]["versions"]["dali"] is None and doc["meta"]["versions"]["spdl"] is None
    assert "peers: dali not installed, spdl not installed" in stdout
    (raw,) = doc["meta"]["raw_rounds"]
    for label, row in (("feeder", feeder), ("DataLoader (num_workers=1)", loader)):
        ends, counts = raw[label]["extra"]["epoch_end_s"], raw[label]["extra"]["epoch_images"]
        assert counts == [18, 36] and 0 < ends[0] < ends[1]
        # The first epoch from building the loader; the steady ones after it; the ratio within the round.
        assert float(row["first_images_per_s"]) == pytest.approx(18 / ends[0])
        assert float(row["steady_images_per_s"]) == pytest.approx(18 / (ends[1] - ends[0]))
    fe, le = (raw[k]["extra"]["epoch_end_s"] for k in ("feeder", "DataLoader (num_workers=1)"))
    assert float(loader["steady_ratio"]) == pytest.approx((18 / (le[1] - le[0])) / (18 / (fe[1] - fe[0])))


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_peers_rows_of_installed_peers(tiny_small, tmp_path):
    """Where DALI or SPDL is installed (not in CI), its row runs the same job."""
    from feeder.bench.peers import PEERS, installed

    present = [name for name in PEERS if installed(name)]
    if not present:
        pytest.skip("neither DALI nor SPDL is installed (pip install 'feeder[peers]')")
    out = str(tmp_path / "out")
    proc = bench("peers", tiny_small["data"], "--out", out, "--size", "64", "--batch-size", "8",
                 "--epochs", "2", "--repeats", "1", "--loaders", ",".join(["feeder", *present]),
                 cwd=tiny_small["base"])
    rows = {r["row"]: r for r in read_csv(os.path.join(out, "peers.csv"))}
    assert set(rows) == {"feeder", *(PEERS[name].label for name in present)}
    for name in present:
        r = rows[PEERS[name].label]
        assert float(r["first_images_per_s"]) > 0 and float(r["steady_images_per_s"]) > 0, r
        assert float(r["steady_ratio"]) > 0 and float(r["images"]) == 2 * 20, r
    doc = json.load(open(os.path.join(out, "peers.json")))
    assert all(doc["meta"]["versions"][name] for name in present)
    assert doc["command"].startswith("feeder-bench peers ") and "peers:" in proc.stdout


def test_peer_loaders_give_every_image_once_per_epoch(tiny_small):
    """Each installed peer's loader: uint8 [B, 3, S, S] batches, the last one partial,
    every label of the folder once per epoch."""
    import torch

    from feeder import ImageFolder
    from feeder.bench.peers import PEERS, installed, peer_loader

    present = [name for name in PEERS if installed(name)]
    if not present:
        pytest.skip("neither DALI nor SPDL is installed (pip install 'feeder[peers]')")
    labels = sorted(int(x) for x in ImageFolder(tiny_small["data"]).labels)
    for name in present:
        loader = peer_loader(name, tiny_small["data"], 8, size=64, seed=1)
        try:
            for epoch in range(2):
                batches = list(loader.epoch(epoch))
                assert [b.shape[0] for b, _ in batches] == [8, 8, 4], name
                assert all(b.dtype == torch.uint8 and tuple(b.shape[1:]) == (3, 64, 64) for b, _ in batches)
                assert sorted(int(y) for _, ys in batches for y in ys) == labels, name
        finally:
            loader.close()


# -- hostile arguments: one line naming the culprit, never a traceback -----------------

@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, str]:
    from tests.support.cli import hostile_files

    return hostile_files(tmp_path_factory.mktemp("bench-hostile"))


BENCH_HOSTILE = [
    # (argv, status, names the last line must hold)
    (["compare", "{missing}", "--out", "{out}"], 2, ["DIR '{missing}'"]),
    (["sweep", "{afile}", "--out", "{out}"], 2, ["DIR '{afile}'"]),
    (["compare", "{photos}", "--out", "{afile}"], 2, ["--out '{afile}'"]),
    (["compare", "{photos}", "--out", "{out}", "--device", "bogus"], 2, ["--device 'bogus'"]),
    (["compare", "{photos}", "--out", "{out}", "--device", "mps"], 2, ["--device 'mps'"]),
    (["compare", "{photos}", "--out", "{out}", "--batch-size", "-1"], 2, ["--batch-size"]),
    (["sweep", "{photos}", "--out", "{out}", "--step-ms", "nan"], 2, ["--step-ms"]),
    (["sweep", "{photos}", "--out", "{out}", "--decode", "-1"], 2, ["--decode"]),
    (["sweep", "{photos}", "--out", "{afile}/sub", "--decode", "1", "--augment", "0", "--repeats",
      "1"], 2, ["--out '{afile}/sub'", "cannot make the folder"]),
    (["make-data", "{afile}"], 2, ["DIR '{afile}'"]),
    (["make-data", "{out}", "--n-classes", "0"], 2, ["--n-classes"]),
    (["make-data", "{out}", "--seed", "-1"], 2, ["--seed"]),
    (["make-data", "{noimage}"], 1, ["{noimage}", "holds no JPEG", "--force"]),
    (["ceiling", "{notimg}", "--out", "{out}", "--repeats", "1", "--limit", "4", "--processes", "1"], 1,
     ["{notimg}/a/", "not a decodable image"]),
    (["shards", "{photos}", "--out", "{out}", "--shards", "{missing}"], 2, ["--shards '{missing}'"]),
    (["shards", "{photos}", "--out", "{out}", "--shard-size", "-1"], 2, ["--shard-size", "'-1'"]),
    (["remote", "{photos}", "--out", "{out}", "--shard-size", "lots"], 2, ["--shard-size", "'lots'"]),
    (["region-decode", "{photos}", "--out", "{out}", "--report", "{afile}"], 1, ["--report {afile}"]),
    (["region-decode", "{photos}", "--out", "{out}", "--report", "{missing}"], 1, ["{missing}"]),
    (["scale", "--out", "{out}", "--shards", "-1"], 2, ["--shards"]),
    (["peers", "{missing}", "--out", "{out}"], 2, ["DIR '{missing}'"]),
    (["peers", "{photos}", "--out", "{out}", "--size", "0"], 2, ["--size"]),
    (["peers", "{photos}", "--out", "{out}", "--workers-grid", "-1"], 2, ["--workers-grid"]),
    (["peers", "{photos}", "--out", "{out}", "--limit", "0"], 2, ["--limit"]),
    (["peers", "{notimg}", "--out", "{out}", "--loaders", "feeder", "--repeats", "1"], 1,
     ["feeder failed in every round"]),
    # A folder that holds no ImageFolder: refused before any run (each run would fail in turn).
    (["compare", "{empty}", "--out", "{out}"], 2, ["DIR '{empty}'", "no class folders"]),
    (["interference", "{empty}", "--out", "{out}"], 2, ["DIR '{empty}'", "no class folders"]),
    (["scaled-decode", "{noimage}", "--out", "{out}"], 2, ["DIR '{noimage}'", "no image in class"]),
    (["region-decode", "{photos}", "--large", "{empty}", "--out", "{out}"], 2, ["--large '{empty}'"]),
    (["scale", "--out", "{out}", "--rank", "3", "--world-size", "2"], 2,
     ["--rank 3 must be below --world-size 2"]),
]


if not torch.cuda.is_available():
    BENCH_HOSTILE.append((["compare", "{photos}", "--out", "{out}", "--device", "cuda"], 2,
                          ["--device 'cuda'", "CUDA is not available"]))


@pytest.mark.parametrize("argv, status, names", BENCH_HOSTILE)
def test_bench_hostile_arguments_end_in_one_line(hostile, tmp_path, argv, status, names):
    from tests.support.cli import assert_one_line_error, run_cli

    r = run_cli("feeder.bench", ["-q", *argv], hostile, tmp_path)
    assert_one_line_error(r, "feeder-bench", names, hostile, status)


def test_ctrl_c_ends_a_run_in_one_line(hostile, tmp_path):
    """Ctrl-C reaches the terminal's whole process group, feeder-bench and the
    measurement children it started: one line and status 130, no traceback."""
    import select
    import signal

    argv = [sys.executable, "-m", "feeder.bench", "compare", hostile["photos"], "--out",
            str(tmp_path / "out"), "--epochs", "50", "--repeats", "3"]
    p = subprocess.Popen(argv, cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, "PYTHONPATH": REPO_DIR})
    try:
        # its first progress line: it is measuring (waited for with a bound)
        ready, _, _ = select.select([p.stderr], [], [], 120)
        assert ready, "feeder-bench printed nothing within 120 s"
        first = p.stderr.readline()
        assert first, "feeder-bench printed nothing"
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    err = first + err
    assert p.returncode == 130, (p.returncode, err)
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "feeder-bench: interrupted", err


@pytest.mark.parametrize("argv, names", [
    (["--loaders", "dali,spdl"], ["--loaders", "must include feeder"]),
    (["--loaders", "feeder,nope"], ["--loaders", "unknown loader 'nope'"]),
    (["--name", "sub/peers"], ["--name", "'sub/peers'"]),
])
def test_peers_refuses_a_bad_loader_list_or_name(hostile, tmp_path, argv, names):
    from tests.support.cli import assert_one_line_error, run_cli

    r = run_cli("feeder.bench", ["-q", "peers", "{photos}", "--out", "{out}", *argv], hostile, tmp_path)
    assert_one_line_error(r, "feeder-bench peers", names, hostile, 2)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("option", ["--decode", "--step-ms"])
def test_sweep_refuses_an_empty_grid(hostile, tmp_path, option):
    from tests.support.cli import assert_one_line_error, run_cli

    r = run_cli("feeder.bench", ["-q", "sweep", "{photos}", "--out", "{out}", "--repeats", "1",
                                 option, " , "], hostile, tmp_path)
    assert_one_line_error(r, "feeder-bench sweep", [option, "' , '"], hostile, 2)


def test_bench_interference_report_of_a_missing_file_is_one_line(hostile, tmp_path):
    from tests.support.cli import run_cli

    r = run_cli("feeder.bench", ["-q", "interference", "--report", "{missing}"], hostile, tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert hostile["missing"] in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("data_made", [True, False])
def test_run_gpu_goes_on_after_a_failing_step_and_returns_the_worst(tmp_path, data_made):
    """bench/run_gpu.sh with a Python that claims a GPU, whose pytest fails: the
    check and the short benchmarks still run, each step's status and log are
    recorded, the exit status is 1."""
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent("""\
        #!/usr/bin/env bash
        case "$*" in
          "-m pytest"*) echo "1 failed"; exit 1 ;;
          *gpu_check.py*) echo "gpu-check table"; exit 0 ;;
          *make-data*) [ -n "$MAKES_DATA" ] && mkdir -p "$4"; exit 0 ;;
          *) cat > /dev/null; exit 0 ;;
        esac
    """))
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(fake), OUT=str(out), FEEDER_BENCH_DATA=str(tmp_path / "data"),
               MAKES_DATA="1" if data_made else "")
    env.pop("FEEDER_BENCH_OUT", None)
    result = subprocess.run(["bash", os.path.join(ROOT, "bench", "run_gpu.sh")], env=env, cwd=ROOT,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    status = (out / "status.txt").read_text().splitlines()
    # Without the dataset the benchmarks that need it are skipped, not run to fail.
    after = "PASS" if data_made else "SKIP"
    assert [line.split()[:2] for line in status] == [
        ["cuda_tests", "FAIL"], ["gpu_check", "PASS"], ["make_data", "PASS"], ["overlap", after],
        ["interference8", after]]
    assert (out / "cuda_tests.txt").read_text().startswith("1 failed")
    assert (out / "gpu_check.txt").read_text().startswith("gpu-check table")
