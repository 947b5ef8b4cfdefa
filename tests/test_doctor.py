"""feeder-doctor: the verdict on recorded measurements of each kind, and the whole
command on CPU with a made-slow part that it must name.

The made-slow parts (tests/doctor_helpers.py) are extreme on purpose, so that the
verdict does not depend on how busy the machine is; no test asserts a speed."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import simplejpeg

from feeder import ops
from feeder.doctor import Fed, Measurements, decide, main
from feeder.doctor.report import plot
from feeder.synthetic import make_image

HERE = os.path.dirname(os.path.abspath(__file__))


# -- the verdict on recorded measurements ---------------------------------------------
# Figures recorded from runs on the 2-core development machine (rounded).

def recorded(**changes) -> Measurements:
    """A loader-bound folder run (train transforms, no model) with ``changes``."""
    m = Measurements(data="/data/train", source_kind="folder", samples=1000, batch_size=32, cores=2,
                     device="cpu", transforms="train", decode_threads=2, read_threads=0,
                     read_ms=0.02, read_ms_p90=0.06, read_ms_first=0.07, read_ms_again=0.01,
                     bytes_per_sample=86000, storage_threads=2, storage_rate=33183,
                     storage_mib_s=2607, decode_ms=0.80, transform_ms=0.11, ceiling_rate=2191,
                     loader_rate=699, loader_cpu_cores=1.7, stage_utilization={"sampler": 0.0, "decode": 0.83, "transfer": 0.01},
                     transfer_ms=0.20)
    for k, v in changes.items():
        setattr(m, k, v)
    return m


JITTER = (0.97, 1.0, 1.03)  # three quiet rounds around each recorded figure


def fed(setting, rate, wait, step_ms, interference, active=2, jitter=JITTER) -> Fed:
    """A fed setting measured in three rounds around the figures given."""
    return Fed(setting, 40, rate, wait, step_ms, interference, active,
               rate_rounds=[rate * j for j in jitter], wait_share_rounds=[wait * j for j in jitter],
               step_ms_rounds=[step_ms * j for j in jitter],
               interference_rounds=[interference * j for j in jitter])


def with_model(step_ms, **changes) -> Measurements:
    """``recorded`` with a model whose synthetic step took ``step_ms`` in each of
    three rounds (the fed settings' ratios are against these)."""
    batch = changes.get("batch_size", 32)
    return recorded(step_ms=step_ms, step_ms_rounds=[step_ms] * 3, model_rate=1e3 * batch / step_ms,
                    **changes)


def test_verdict_decode():
    v = decide(recorded())
    assert v.bottleneck == "decode"
    assert v.numbers["decode ms/img"] == 0.8 and v.numbers["CPU ceiling img/s"] == 2191
    assert any("more decode_threads" in f for f in v.fixes)  # 699 of 2191: threads, first
    assert any("feeder-pack --max-side" in f for f in v.fixes)
    assert v.lines()[0] == "bottleneck: decode"


def test_verdict_decode_on_a_busy_machine_says_free_cores_not_more_threads():
    v = decide(recorded(loader_rate=258, loader_cpu_cores=0.8, load_average=8.4))
    assert v.bottleneck == "decode"
    assert "got only 0.80 of 2 cores (load average 8.4)" in v.fixes[0]
    assert not any("more decode_threads" in f for f in v.fixes)


def test_verdict_decode_at_the_ceiling_suggests_no_more_threads():
    v = decide(recorded(loader_rate=2000))
    assert v.bottleneck == "decode" and not any("more decode_threads" in f for f in v.fixes)


def test_verdict_transforms():
    v = decide(recorded(decode_ms=0.55, transform_ms=5.3, ceiling_rate=340, loader_rate=295))
    assert v.bottleneck == "transforms"
    assert any("normalize=(mean, std)" in f for f in v.fixes)


def test_verdict_storage_serialized():
    v = decide(recorded(source_kind="object", read_threads=32, storage_threads=32, read_ms=10.2,
                        storage_rate=95.8, decode_ms=0.58, transform_ms=0.02, ceiling_rate=3348,
                        loader_rate=59.4))
    assert v.bottleneck == "storage"
    assert v.numbers["storage img/s"] == 95.8
    assert any("does not scale with concurrent reads" in f for f in v.fixes)
    assert any("pack into shards" in f for f in v.fixes)


def test_verdict_storage_without_a_read_stage_says_read_threads():
    v = decide(recorded(read_threads=0, storage_threads=2, read_ms=20.0, storage_rate=100,
                        loader_rate=95))
    assert v.bottleneck == "storage" and "read_threads=16" in v.fixes[0]


def test_verdict_storage_needs_both_slow_reads_and_a_lower_rate():
    # Storage below the ceiling but far above what the loader delivers: not storage.
    assert decide(recorded(storage_rate=1500, loader_rate=699)).bottleneck == "decode"


def test_verdict_transfer():
    v = decide(recorded(device="cuda", stage_utilization={"decode": 0.4, "transfer": 0.93},
                        transfer_ms=40.0, loader_rate=790))
    assert v.bottleneck == "transfer"
    assert v.numbers["transfer thread busy"] == 0.93


def test_verdict_model():
    m = recorded(model="simulated 100 ms step", step_ms=100.0, step_ms_rounds=[100.0] * 3, model_rate=320.0,
                 fed={"threads": fed("threads", 318, 0.002, 100.2, 1.0),
                      "tune": fed("tune", 319, 0.003, 100.1, 1.0, active=1)})
    v = decide(m)
    assert v.bottleneck == "model"
    assert v.numbers["loop wait share (threads)"] == 0.002
    assert 'decode_threads="tune" ended at 1 of 2' in v.fixes[0]


def test_verdict_interference_prefers_the_process_engine_when_it_measured_better():
    m = recorded(model="launch-bound", step_ms=56.4, step_ms_rounds=[56.4] * 3, model_rate=17.7, batch_size=1,
                 fed={"threads": fed("threads", 9.0, 0.002, 115.9, 2.05),
                      "process": fed("process", 16.0, 0.01, 60.0, 1.06)})
    v = decide(m)
    assert v.bottleneck == "interference"
    assert v.fixes[0].startswith('isolation="process"')
    assert v.numbers["step fed / synthetic (process)"] == 1.06


def test_verdict_interference_of_gil_holding_transforms():
    # Recorded from the end-to-end test's set-up below (a pure-Python transform of
    # ~8 ms an image, a launch-bound step, batch 1): the loop hardly waits for data,
    # while the step is 2.4x the synthetic one with threads.
    m = recorded(model="doctor_helpers:launch_bound_step", step_ms=8.74, step_ms_rounds=[8.74] * 3, model_rate=114.4,
                 batch_size=1, decode_ms=0.59, transform_ms=7.94, ceiling_rate=234,
                 loader_rate=105,
                 fed={"threads": fed("threads", 44.2, 0.004, 20.8, 2.38),
                      "process": fed("process", 79.9, 0.134, 11.1, 1.28)})
    v = decide(m)
    assert v.bottleneck == "interference"
    assert v.fixes[0].startswith('isolation="process"')


def test_verdict_waiting_loop_is_the_loaders_fault_not_interference():
    # A slower fed step, but the loop loses more time waiting for data: the loader.
    m = recorded(model="m", step_ms=10.0, step_ms_rounds=[10.0] * 3, model_rate=3200.0,
                 fed={"threads": fed("threads", 650, 0.6, 11.5, 1.15)})
    assert decide(m).bottleneck == "decode"


def test_measurements_round_trip_through_json(tmp_path):
    m = recorded(model="m", step_ms=10.0, model_rate=3200.0, tune_history=[(0.0, 2), (1.5, 1)],
                 fed={"threads": fed("threads", 650, 0.6, 11.5, 1.15)})
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps({"measurements": m.to_dict()}))
    back = Measurements.load(str(path))
    assert back == m and decide(back) == decide(m)


def test_plot_without_matplotlib_writes_nothing(tmp_path, monkeypatch):
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    path = tmp_path / "doctor.png"
    assert plot(recorded(), decide(recorded()), str(path)) is None
    assert not path.exists()


# -- the whole command, made-slow parts -------------------------------------------------

@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> str:
    """48 photo-like 400x300 JPEGs in two classes."""
    root = tmp_path_factory.mktemp("doctor-photos")
    for c in range(2):
        os.makedirs(root / f"c{c}")
        for i in range(24):
            img = np.ascontiguousarray(make_image(300, 400, seed=100 * c + i))
            (root / f"c{c}" / f"{i}.jpg").write_bytes(
                simplejpeg.encode_jpeg(img, quality=90, colorspace="RGB"))
    return str(root)


@pytest.fixture
def helpers(photos, monkeypatch):
    monkeypatch.syspath_prepend(HERE)
    monkeypatch.setenv("FEEDER_DOCTOR_TEST_DATA", photos)
    return photos


def doctor(tmp_path, capsys, *argv: str) -> tuple[str, dict]:
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out), "-q"]) == 0
    text = capsys.readouterr().out
    assert (out / "report.txt").read_text().strip() == text.strip()
    doc = json.loads((out / "doctor.json").read_text())
    assert (out / "doctor.png").stat().st_size > 0  # matplotlib: in the test extra
    assert doc["verdict"]["bottleneck"] == decide(Measurements.from_dict(doc["measurements"])).bottleneck
    verdict = [line for line in text.splitlines() if line.startswith("bottleneck: ")]
    assert len(verdict) == 1
    return verdict[0].split(": ", 1)[1], doc


def test_doctor_names_decode_on_a_folder_without_a_model(helpers, tmp_path, capsys):
    name, doc = doctor(tmp_path, capsys, helpers, "--transforms", "doctor_helpers:small",
                       "--batch-size", "4", "--seconds", "3")
    assert name == "decode", doc
    m = doc["measurements"]
    assert m["source_kind"] == "folder" and m["fed"] == {} and m["model"] is None
    assert m["decode_ms"] > 0 and m["loader_rate"] > 0 and m["timeline"]


def test_doctor_names_a_slow_transform(helpers, tmp_path, capsys):
    name, doc = doctor(tmp_path, capsys, helpers, "--transforms", "doctor_helpers:slow_transforms",
                       "--batch-size", "4", "--seconds", "3")
    assert name == "transforms", doc


def test_doctor_names_a_slow_source(helpers, tmp_path, capsys):
    name, doc = doctor(tmp_path, capsys, "doctor_helpers:SerializedSource", "--transforms",
                       "doctor_helpers:small", "--batch-size", "4", "--seconds", "3")
    assert name == "storage", doc
    assert doc["measurements"]["source_kind"] == "object"


def test_doctor_names_shards_behind_a_bandwidth_limited_server(helpers, tmp_path, capsys):
    from feeder.bench.httpserver import FileServer
    from feeder.pack import pack

    # Small photos (a few KiB), so that a read in flight ends soon after the feeder closes.
    pack(helpers, str(tmp_path / "shards"), shard_size=1 << 20, max_side=96)
    # 100 KB/s for every connection together: a few dozen photos a second, far
    # below what the cores decode.
    with FileServer(tmp_path / "shards", bandwidth=100_000) as server:
        name, doc = doctor(tmp_path, capsys, f"{server.url}/train.json", "--transforms",
                           "doctor_helpers:small", "--batch-size", "2", "--seconds", "3")
    assert name == "storage", doc
    assert doc["measurements"]["source_kind"] == "remote-shards"


def test_doctor_names_a_slow_model_step_and_runs_every_engine(helpers, tmp_path, capsys):
    # A 200 ms step: what the loader's threads can cost the loop's own Python (a few
    # ms of GIL waits, more on a loaded machine) stays well under the 1.10x limit.
    name, doc = doctor(tmp_path, capsys, helpers, "--transforms", "doctor_helpers:small",
                       "--batch-size", "4", "--step-ms", "200", "--seconds", "3")
    assert name == "model", doc
    fed = doc["measurements"]["fed"]
    assert set(fed) == {"threads", "process", "tune"}
    assert fed["tune"]["active_threads"] >= 1 and doc["measurements"]["tune_history"]


def test_doctor_names_interference_of_gil_holding_transforms_with_a_launch_bound_step(
        helpers, tmp_path, capsys):
    """The loader keeps up easily (one image a batch, a pipeline four batches
    ahead), but its transform holds the GIL for ~8 ms an image while the step
    launches 1000 tiny ops, each of which must take the GIL back: the fed step is
    well over the 1.10x limit slower than on synthetic input, while the loop
    hardly waits for data."""
    name, doc = doctor(tmp_path, capsys, "doctor_helpers:ManyPhotos", "--transforms",
                       "doctor_helpers:gil_transforms", "--model",
                       "doctor_helpers:launch_bound_step", "--batch-size", "1", "--seconds", "4")
    assert name == "interference", doc
    fed = doc["measurements"]["fed"]
    assert set(fed) == {"threads", "process", "tune"}
    assert any("GIL" in fix for fix in doc["verdict"]["fixes"])


def test_doctor_without_matplotlib_says_so(helpers, tmp_path, capsys, monkeypatch):
    import feeder.doctor.report as report

    monkeypatch.setattr(report, "plot", lambda *a: None)
    out = tmp_path / "out"
    assert main([helpers, "--transforms", "doctor_helpers:small", "--batch-size", "4",
                 "--seconds", "1", "--out", str(out), "-q"]) == 0
    captured = capsys.readouterr()
    assert "matplotlib not installed" in captured.err
    assert "matplotlib not installed" in (out / "report.txt").read_text()
    assert not (out / "doctor.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["/no/such/folder"], "DATA '/no/such/folder'"),
    (["doctor_helpers:nothing"], "has no 'nothing'"),
    (["{data}", "--step-ms", "-3"], "--step-ms must be a finite number > 0"),
    (["{data}", "--step-ms", "inf"], "--step-ms must be a finite number > 0, got inf"),
    (["{data}", "--seconds", "nan"], "--seconds must be a finite number > 0, got nan"),
    (["{data}", "--seconds", "inf"], "--seconds must be a finite number > 0, got inf"),
    (["{data}", "--batch-size", "0"], "--batch-size must be >= 1"),
    # A batch larger than the set: the model's needed rate would be taken at a
    # batch size no batch has, and the verdict would be wrong.
    (["{data}", "--batch-size", "49"], "has 48 samples, fewer than one batch of --batch-size 49"),
    (["{empty}"], "no image in class folder(s) a"),
])
def test_doctor_bad_input_is_a_clear_error(helpers, tmp_path, capsys, argv, message):
    os.makedirs(tmp_path / "empty" / "a")
    argv = [a.replace("{data}", helpers).replace("{empty}", str(tmp_path / "empty")) for a in argv]
    assert main([*argv, "--out", str(tmp_path / "o"), "-q"]) == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_feeder_doctor():
    r = subprocess.run([sys.executable, "-m", "feeder.doctor", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "feeder-doctor" in r.stdout and "--step-ms" in r.stdout


# -- hostile arguments: one line naming the culprit, never a traceback -----------------

@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, str]:
    from cli_helpers import hostile_files

    return hostile_files(tmp_path_factory.mktemp("doctor-hostile"))


DOCTOR_HOSTILE = [
    # (argv, status, names the last line must hold)
    (["http://127.0.0.1:{port}/train.json"], 1, ["http://127.0.0.1:{port}/train.json"]),
    (["{missing}.json"], 2, ["{missing}.json"]),
    (["{photos}", "--model", "cli_helpers:raising_step", "--batch-size", "2", "--seconds", "1"], 1,
     ["--model cli_helpers:raising_step raised ValueError: the step blew up"]),
    (["cli_helpers:raising_source"], 1, ["DATA cli_helpers:raising_source raised RuntimeError"]),
    (["cli_helpers:BrokenReads", "--batch-size", "2"], 1,
     ["DATA cli_helpers:BrokenReads: reading sample", "disk gone"]),
    (["{photos}", "--model", "no_such_module:step"], 2, ["no_such_module"]),
    (["{photos}", "--device", "bogus"], 2, ["--device 'bogus'"]),
    (["{photos}", "--batch-size", "2", "--out", "{afile}"], 2, ["--out '{afile}'"]),
    (["{photos}", "--transforms", "cli_helpers:forty_two"], 2,
     ["--transforms cli_helpers:forty_two gave 42, not a list of transforms"]),
    (["{notimg}", "--batch-size", "2", "--seconds", "1"], 1, ["{notimg}/a/", "not a decodable image"]),
    (["{empty}"], 2, ["{empty}"]),
    (["{photos}", "--seconds", "-1"], 2, ["--seconds"]),
]


@pytest.mark.parametrize("argv, status, names", DOCTOR_HOSTILE)
def test_doctor_hostile_arguments_end_in_one_line(hostile, tmp_path, argv, status, names):
    from cli_helpers import assert_one_line_error, run_cli

    out = [] if "--out" in argv else ["--out", "{out}"]
    r = run_cli("feeder.doctor", [*argv, *out, "-q"], hostile, tmp_path)
    assert_one_line_error(r, "feeder-doctor", names, hostile, status)


def test_doctor_debug_shows_the_traceback_of_user_code(hostile, tmp_path):
    from cli_helpers import run_cli

    r = run_cli("feeder.doctor", ["cli_helpers:raising_source", "--debug", "-q", "--out", "{out}"],
                hostile, tmp_path)
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "the source blew up" in r.stderr


def test_doctor_measures_a_source_of_decoded_images():
    from feeder.doctor import measure

    class Arrays:
        def __len__(self):
            return 8

        def read(self, index):
            return np.full((40, 48, 3), index, np.uint8), index

    source = Arrays()
    m = measure.new_measurements("Arrays", source, "object", 4, "cpu", "train")
    timeline = measure.Timeline([])
    kept = measure.storage(m, source, list(range(8)), 0.2, timeline, lambda: None)
    assert m.bytes_per_sample == 40 * 48 * 3
    measure.cpu_work(m, kept, [ops.RandomResizedCrop(32)], 0.2, timeline, 1 << 28)
    assert m.decode_ms is not None and m.transform_ms is not None
