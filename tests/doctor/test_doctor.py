"""feeder-doctor: the verdict on recorded measurements of each kind, and the whole
command on CPU with a made-slow part that it must name.

The made-slow parts (tests/support/doctor.py) are extreme on purpose, so that the
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
from feeder.doctor.verdict import LOADED_CORES, SHARED, slower
from feeder.synthetic import make_image
from tests.support import REPO_DIR



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


JITTER = (0.97, 0.99, 1.0, 1.01, 1.03)  # five quiet rounds around each recorded figure


def fed(setting, rate, wait, step_ms, interference, active=2, jitter=JITTER) -> Fed:
    """A fed setting measured in five rounds around the figures given."""
    return Fed(setting, 40, rate, wait, step_ms, interference, active,
               rate_rounds=[rate * j for j in jitter], wait_share_rounds=[wait * j for j in jitter],
               step_ms_rounds=[step_ms * j for j in jitter],
               interference_rounds=[interference * j for j in jitter])


def with_model(step_ms, **changes) -> Measurements:
    """``recorded`` with a model whose synthetic step took ``step_ms`` in each of
    five rounds (the fed settings' ratios are against these)."""
    batch = changes.get("batch_size", 32)
    return recorded(step_ms=step_ms, step_ms_rounds=[step_ms] * 5, model_rate=1e3 * batch / step_ms,
                    **changes)


def test_the_verdict_gives_a_figure_measured_in_rounds_as_their_median():
    """The report prints the rounds' median with their range; the verdict's number
    must be that median too, not the whole run's rate beside the same range."""
    rounds = [11606, 10130, 10236, 10894, 9767]
    v = decide(recorded(loader_rate=10526, loader_rate_rounds=rounds))
    assert v.numbers["loader alone img/s"] == 10236
    assert v.spreads["loader alone img/s"] == [9767, 11606]


def test_verdict_decode():
    v = decide(recorded())
    assert v.bottleneck == "decode"
    assert v.numbers["decode ms/img"] == 0.8 and v.numbers["CPU ceiling img/s"] == 2191
    # 699 of 2191 with a thread per core already: more threads would only hand the
    # GIL over more (not measured, so a try), never a fix
    assert not any("decode_threads" in f for f in v.fixes)
    assert any("a decode thread per core already" in t for t in v.tries)
    assert any("feeder-pack --max-side" in f for f in v.fixes)
    assert v.lines()[0] == "bottleneck: decode"


def test_verdict_decode_with_fewer_threads_than_cores_says_try_more():
    v = decide(recorded(cores=4, decode_threads=2))
    assert v.bottleneck == "decode" and not any("decode_threads" in f for f in v.fixes)
    assert any(t.startswith("more decode_threads (now 2, on 4 cores)") for t in v.tries)


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
    m = recorded(model="simulated 100 ms step", step_ms=100.0, step_ms_rounds=[100.0] * 5, model_rate=320.0,
                 fed={"threads": fed("threads", 318, 0.002, 100.2, 1.0),
                      "tune": fed("tune", 319, 0.003, 100.1, 1.0, active=1)})
    v = decide(m)
    assert v.bottleneck == "model"
    assert v.numbers["loop wait share (threads)"] == 0.002
    assert 'decode_threads="tune" ended at 1 of 2' in v.fixes[0]


def test_verdict_interference_prefers_the_process_engine_when_it_measured_better():
    m = recorded(model="launch-bound", step_ms=56.4, step_ms_rounds=[56.4] * 5, model_rate=17.7, batch_size=1,
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
    m = recorded(model="tests.support.doctor:launch_bound_step", step_ms=8.74, step_ms_rounds=[8.74] * 5, model_rate=114.4,
                 batch_size=1, decode_ms=0.59, transform_ms=7.94, ceiling_rate=234,
                 loader_rate=105,
                 fed={"threads": fed("threads", 44.2, 0.004, 20.8, 2.38),
                      "process": fed("process", 79.9, 0.134, 11.1, 1.28)})
    v = decide(m)
    assert v.bottleneck == "interference"
    assert v.fixes[0].startswith('isolation="process"')


def test_verdict_waiting_loop_is_the_loaders_fault_not_interference():
    # A slower fed step, but the loop loses more time waiting for data: the loader.
    m = recorded(model="m", step_ms=10.0, step_ms_rounds=[10.0] * 5, model_rate=3200.0,
                 fed={"threads": fed("threads", 650, 0.6, 11.5, 1.15)})
    assert decide(m).bottleneck == "decode"


# -- noise, load and CPU training, on recorded rounds ------------------------------------
# The issue these guard: on a loaded 2-core machine a CPU model's runs gave
# "interference" with a different fix each time, one of them a setting measured at
# 0.81x of the synthetic step.

def cpu_training(**changes) -> Measurements:
    """A CPU model (torch on both cores) fed by the threads, recorded on the quiet
    2-core machine: the step takes 1.9 cores alone and runs 1.4x slower fed."""
    m = with_model(300.0, model="mymodel:train_step", step_cpu_cores=1.9,
                   step_cpu_cores_rounds=[1.87, 1.88, 1.9, 1.92, 1.93], torch_threads=2, other_cores_run=0.05,
                   other_cores={"fed (threads)": 0.05},
                   fed={"threads": fed("threads", 76, 0.01, 420.0, 1.4),
                        "process": fed("process", 80, 0.02, 400.0, 1.33),
                        "tune": fed("tune", 77, 0.02, 415.0, 1.38, active=2)})
    for k, v in changes.items():
        setattr(m, k, v)
    return m


def test_verdict_cpu_training_is_its_own_verdict_with_the_thread_split():
    v = decide(cpu_training())
    assert v.bottleneck == "cores", v
    assert v.numbers["step CPU cores (synthetic input)"] == 1.9
    assert v.spreads["step fed / synthetic"] == [1.358, 1.442]
    # The loader needs about 0.1 of a core: no whole core is taken from the step.
    assert v.tries[0].startswith("decode_threads=1 and torch's threads left on every core"), v.tries
    assert not any("set_num_threads" in t or "os.sched_setaffinity" in t for t in v.tries)
    assert any("GPU" in t for t in v.tries)
    # Neither the worker process nor "tune" was faster beyond the noise: not advised.
    assert v.fixes == [] and len(v.unhelpful) == 2 and not v.warnings


def test_verdict_cpu_training_splits_whole_cores_only_for_a_loader_that_needs_them():
    # 12 ms of decoding an image at the step's 107 img/s: 1.3 cores to feed it.
    v = decide(cpu_training(decode_ms=12.0, decode_ms_rounds=[12.0] * 5))
    assert v.bottleneck == "cores", v
    assert any(t.startswith("split the cores: torch.set_num_threads(1) in the training process "
                            "and decode_threads=2") for t in v.tries), v.tries
    assert any("os.sched_setaffinity" in t for t in v.tries)


def test_verdict_cpu_training_advises_the_process_engine_only_when_it_measured_faster():
    m = cpu_training()
    m.fed["process"] = fed("process", 120, 0.01, 310.0, 1.03)
    v = decide(m)
    assert v.bottleneck == "cores" and v.fixes[0].startswith('isolation="process": the loop ran at 120')


def test_verdict_cpu_training_gives_the_split_as_its_fix_when_tune_measured_fewer_threads():
    # "tune" parked one of the two decode threads and the loop ran faster beyond the
    # noise: that measures the first advice (one decode thread; the loader needs a
    # fraction of a core, so torch keeps every core), now a fix with the run as evidence.
    m = cpu_training()
    m.fed["tune"] = fed("tune", 90, 0.01, 350.0, 1.17, active=1)
    v = decide(m)
    assert v.bottleneck == "cores"
    assert v.fixes[0].startswith("decode_threads=1 and torch's threads left on every core"), v.fixes
    assert '(measured: decode_threads="tune": the loop ran at 90' in v.fixes[0]
    assert "ending at 1 of 2 decode threads" in v.fixes[0]
    assert not any(t.startswith("decode_threads=1") for t in v.tries)
    # Faster with both threads still active: not the split, a fix of its own.
    m.fed["tune"] = fed("tune", 90, 0.01, 350.0, 1.17, active=2)
    v = decide(m)
    assert v.fixes[0].startswith('decode_threads="tune"') and v.tries[0].startswith("decode_threads=1")


def test_verdict_cpu_training_on_a_loaded_machine_warns_first_and_advises_no_noise():
    # The set-up: another CPU-heavy process; the step got about one core,
    # the worker process measured "better" in one round only (0.81x).
    m = cpu_training(step_cpu_cores=1.0, step_cpu_cores_rounds=[0.9, 0.95, 1.0, 1.05, 1.1], other_cores_run=1.05,
                     other_cores={"fed (threads)": 1.0, "fed (process)": 1.1}, load_average=5.0,
                     load_average_end=5.2)
    m.fed["process"] = fed("process", 76, 0.02, 340.0, 1.13, jitter=(0.7, 0.9, 1.0, 1.1, 1.3))
    m.fed["process"].interference_rounds = [0.81, 1.0, 1.13, 1.25, 1.4]
    v = decide(m)
    assert v.lines()[0].startswith("warning: other work competes for the CPU: other processes (or "
                                   "the host, taking this machine's CPU time: steal) used 1.05 of "
                                   "the 2 cores"), v.lines()
    assert "load average 5.0 then 5.2 on 2 cores" in v.warnings[0]
    assert v.bottleneck == "cores" and v.fixes == []
    assert any(u.startswith('isolation="process"') and "not faster beyond the noise" in u
               for u in v.unhelpful)
    assert v.tries[0].startswith("free cores: other processes used 1.05 of the 2")


def test_the_rank_test_is_the_exact_one_sided_mann_whitney():
    # Every fed step above every synthetic one: 1 ordering of C(10, 5) = 252.
    assert slower([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(1 / 252)
    assert slower([6, 7, 8, 9, 10], [1, 2, 3, 4, 5]) == 1.0
    # One pair the other way round: U = 1, P(U <= 1) = 2 / 252.
    assert slower([1, 2, 3, 4, 6], [5, 7, 8, 9, 10]) == pytest.approx(2 / 252)
    # Ties count a half: all equal is the middle of the distribution.
    assert 0.5 <= slower([3.0] * 5, [3.0] * 5) < 0.7
    # Unequal counts: 5 against 6, complete separation: 1 of C(11, 5) = 462.
    assert slower([1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]) == pytest.approx(1 / 462)
    assert slower([1, 2, 3, 4], [6, 7, 8, 9, 10]) is None  # fewer than five a side
    assert slower([1, 2, 3, 4, float("nan"), 5], [6, 7, 8, 9, 10]) == pytest.approx(1 / 252)


def test_verdict_cpu_training_decides_on_all_rounds_when_the_pairs_disagree():
    # Recorded on the quiet 2-core machine: the CPU step's own time swung from 232
    # to 369 ms between rounds, so only 3 of 5 pairs show the fed step 10% slower,
    # yet every fed round but one is above the synthetic median: 1.22x over all.
    m = cpu_training(step_ms=316.0, step_ms_rounds=[354.0, 232.0, 316.0, 308.0, 369.0])
    m.fed["threads"].step_ms = 387.0
    m.fed["threads"].step_ms_rounds = [355.0, 387.0, 489.0, 402.0, 347.0]
    m.fed["threads"].wait_share_rounds = [0.0002] * 5
    v = decide(m)
    assert v.bottleneck == "cores", v
    assert "lost time in 3 of 5 rounds; over all rounds the fed steps lie above the synthetic " \
           "ones with a 2.8% chance of noise (rank test)" in v.why
    assert v.numbers["chance the fed step is as fast"] == 0.028
    # Fed steps no slower over all (medians 1.04x apart), 2 of 5 pairs above 1.10x:
    # inconclusive still, the rank test does not overrule the pairs on noise.
    m.fed["threads"].step_ms_rounds = [355.0, 300.0, 489.0, 330.0, 300.0]
    m.fed["threads"].step_ms = 330.0
    assert decide(m).bottleneck == "inconclusive"


def test_verdict_cpu_training_on_a_crowded_machine_is_cores_not_interference():
    # Recorded beside other work that used 1.8 of the 2 cores: the CPU step got 0.14
    # of a core (it took most of what was left) and ran 1.2x slower fed; a rule
    # asking for half a core of a CPU-heavy step called it GIL interference.
    m = cpu_training(step_cpu_cores=0.14, step_cpu_cores_rounds=[0.14, 0.14, 0.15, 0.3, 0.64],
                     other_cores_run=1.79, other_cores={"model (synthetic input)": 1.83,
                                                        "fed (threads)": 1.81}, load_average=0.9,
                     load_average_end=15.1)
    v = decide(m)
    assert v.bottleneck == "cores", v
    assert v.tries[0].startswith("free cores: other processes used 1.79 of the 2"), v.tries
    assert v.warnings and v.fixes == []
    # The same step on a quiet machine with 0.14 of a core is no CPU step: not cores.
    quiet = cpu_training(step_cpu_cores=0.14, step_cpu_cores_rounds=[0.14] * 5)
    assert decide(quiet).bottleneck == "interference"


def test_verdict_cpu_training_beside_a_cpu_hog_is_cores_even_when_the_rounds_show_no_loss():
    # Recorded beside one CPU-bound process: the step's synthetic rounds already ran
    # short of cores (1.14-1.20 of them while the other process took 0.79), so fed
    # rounds no slower than those (0.90-1.09x) said "model" in some runs and
    # "cores" in others. The step's lowest round, the loader's need and the other
    # process exceed the cores: the cores are the limit, and freeing them comes first.
    m = cpu_training(step_ms=496.0, step_ms_rounds=[443.0, 557.0, 488.0, 516.0, 496.0],
                     model_rate=129.0, decode_ms=0.74, transform_ms=0.14, step_cpu_cores=1.16,
                     step_cpu_cores_rounds=[1.19, 1.161, 1.161, 1.139, 1.198], other_cores_run=0.70,
                     other_cores={"model (synthetic input)": 0.79, "fed (threads)": 0.62})
    m.fed["threads"].step_ms = 462.0
    m.fed["threads"].step_ms_rounds = [457.0, 525.0, 457.0, 462.0, 542.0]
    m.fed["threads"].wait_share_rounds = [0.0, 0.0, 0.0, 0.001, 0.0]
    v = decide(m)
    assert v.bottleneck == "cores", v
    assert v.tries[0].startswith("free cores: other processes used 0.70 of the 2"), v.tries
    assert "lost time in 0 of 5 rounds" in v.why
    # The same rounds on a quiet machine: the step alone fits, no loss: the model.
    quiet = cpu_training(**{k: getattr(m, k) for k in ("step_ms", "step_ms_rounds", "model_rate",
                                                       "decode_ms", "transform_ms")},
                         step_cpu_cores=1.16, step_cpu_cores_rounds=[1.19, 1.161, 1.161, 1.139, 1.198])
    quiet.fed["threads"] = m.fed["threads"]
    assert decide(quiet).bottleneck == "model"


def test_verdict_ten_rounds_allow_two_outliers():
    m = with_model(200.0, fed={"threads": fed("threads", 19, 0.001, 203.0, 1.01, jitter=(1.0,) * 10)})
    m.step_ms_rounds = [200.0] * 10
    m.fed["threads"].step_ms_rounds = [200.5, 201.0, 203.0, 226.0, 202.0, 230.0, 201.0, 199.0, 202.0,
                                       203.0]  # two rounds above 1.10x of ten
    assert decide(m).bottleneck == "model"
    m.fed["threads"].step_ms_rounds[2] = 240.0  # three of ten: both sides
    assert decide(m).bottleneck == "inconclusive"


def scripted_rounds(monkeypatch, step_ms: float, step_cores: float, fed_ms, timeline=None):
    """The doctor's model rounds on scripted measurements: the synthetic step takes
    ``step_ms`` on ``step_cores`` every round, fed round k (from 1) ``fed_ms(k)``.
    Returns the measurements the rounds filled in."""
    import feeder.doctor as doctor
    from feeder.doctor import measure

    m = with_model(step_ms, model="m:step", step_cpu_cores=step_cores, fed={})
    m.step_ms_rounds, m.step_cpu_cores_rounds = [], []
    n = {"fed": 0}

    def synthetic_step(m, step, transforms, budget, timeline, max_pixels):
        m.step_ms_rounds.append(step_ms)
        m.step_cpu_cores_rounds.append(step_cores)
        m.step_ms, m.model_rate = step_ms, 32e3 / step_ms

    def fed_round(m, setting, fsrc, kind, step, transforms, budget, timeline, synthetic_ms, **kw):
        n["fed"] += 1
        ms = fed_ms(n["fed"])
        return Fed(setting, 10, 32e3 / ms, 0.001, ms, ms / synthetic_ms, 2)

    monkeypatch.setattr(measure, "synthetic_step", synthetic_step)
    monkeypatch.setattr(measure, "fed", fed_round)
    monkeypatch.setattr(measure, "fed_source", lambda *a: (None, 100))

    class Bar:
        total = 0

        def update(self):
            pass

    args = type("Args", (), {"seconds": 1.0})()
    doctor._model_rounds(m, args, None, "folder", None, [], ["threads"], timeline, Bar(),
                         lambda text: None, 1 << 20)
    return m


def test_the_doctor_adds_rounds_while_the_first_disagree(monkeypatch):
    # Scripted rounds: the synthetic step 100 ms; fed by the threads 100 ms in the
    # first rounds and on alternate rounds, 130 ms on the others (pairs on both
    # sides of 1.10x: inconclusive) until round 7, from which every fed round is slow.
    m = scripted_rounds(monkeypatch, 100.0, 0.02, lambda k: 130.0 if k >= 7 or k % 2 == 0 else 100.0)
    # The first 5 rounds disagree (2 of 5 slow); more follow until they settle.
    fed_threads = m.fed.get("threads")
    assert fed_threads is not None
    n = len(fed_threads.step_ms_rounds)
    assert 5 < n <= 10 and len(m.step_ms_rounds) == n
    assert any(f"{n - 5} more were run ({n} in all)" in note for note in m.notes), m.notes
    assert decide(m).bottleneck == "interference"


def test_the_doctor_adds_no_rounds_beside_other_work_once_the_cores_overflow(monkeypatch):
    # A CPU step beside other work (0.79 of a core): fed rounds alternate between
    # the synthetic time and 1.16x (the pairs disagree), but the cores overflow, so
    # the verdict is settled after 5 rounds if the other work's CPU is known then.
    def run(timeline):
        return scripted_rounds(monkeypatch, 500.0, 1.16, lambda k: 580.0 if k % 2 == 0 else 500.0, timeline)

    class Timeline:
        """The phases ended so far had other processes on 0.79 of a core."""

        def record(self, m):
            m.other_cores = {"model (synthetic input)": 0.79, "fed (threads)": 0.7}
            m.other_cores_run = 0.7

    m = run(Timeline())
    assert len(m.fed["threads"].step_ms_rounds) == 5
    assert not any("more were run" in note for note in m.notes), m.notes
    Timeline().record(m)  # what the run's end records
    assert decide(m).bottleneck == "cores"
    # Not knowing the other work until the end, the rounds run on to ten.
    assert len(run(None).fed["threads"].step_ms_rounds) == 10


def test_verdict_simulated_step_leaves_the_cores_free():
    # The same figures with a step that uses no CPU (--step-ms): GIL interference.
    v = decide(cpu_training(step_cpu_cores=0.02, step_cpu_cores_rounds=[0.02] * 5))
    assert v.bottleneck == "interference"


def test_verdict_noisy_rounds_are_inconclusive_and_say_what_to_run():
    m = with_model(60.0, seconds=30.0,
                   fed={"threads": fed("threads", 500, 0.002, 66.0, 1.1)})
    m.fed["threads"].step_ms_rounds = [48.6, 78.0, 75.0, 62.0, 64.0]  # 0.81x, 1.30x, 1.25x, ...
    v = decide(m)
    assert v.bottleneck == "inconclusive" and v.fixes == []
    assert "slower than 1.10x, at more cost than the wait, in 2 of 5 rounds" in v.why
    assert v.spreads["step fed / synthetic"] == [0.81, 1.3]
    assert "--seconds 60" in v.tries[0]


def test_verdict_one_outlier_round_does_not_make_it_inconclusive():
    m = with_model(200.0, fed={"threads": fed("threads", 19, 0.001, 203.0, 1.01)})
    m.fed["threads"].step_ms_rounds = [200.5, 201.0, 203.0, 226.0, 202.0]  # one round at 1.13x
    assert decide(m).bottleneck == "model"


def test_verdict_wait_on_both_sides_of_the_limit_is_inconclusive():
    m = with_model(60.0, fed={"threads": fed("threads", 500, 0.05, 60.0, 1.0, jitter=(0.2, 1.5, 1.0, 0.8, 3.0))})
    v = decide(m)
    assert v.bottleneck == "inconclusive" and "above 5% in 2 of 5 rounds" in v.why


def test_verdict_needs_five_rounds():
    m = with_model(60.0, fed={"threads": fed("threads", 500, 0.002, 60.0, 1.0, jitter=(1.0, 1.0))})
    v = decide(m)
    assert v.bottleneck == "inconclusive" and "2 round(s), fewer than the 5" in v.why


def test_verdict_quiet_machine_gives_no_warning_and_a_loaded_one_warns_first():
    assert decide(recorded(other_cores_run=0.2, other_cores={"cpu": 0.3})).warnings == []
    v = decide(recorded(other_cores_run=0.9, other_cores={"cpu": 0.9}, load_average=4.8))
    assert v.bottleneck == "decode" and v.lines()[0].startswith("warning: other work competes")
    # Not measured (no /proc): the load average at the start decides.
    assert decide(recorded(load_average=4.8)).warnings
    assert not decide(recorded(load_average=0.3)).warnings


def test_verdict_ten_recorded_loaded_runs_give_one_verdict_or_inconclusive():
    # Rounds drawn around the loaded CPU-training figures with a spread as wide as
    # a 2-core machine beside a CPU hog gives: never "interference", never a fix.
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(10):
        m = cpu_training(step_cpu_cores=1.0, other_cores_run=1.0, other_cores={"fed (threads)": 1.0})
        for f in m.fed.values():
            f.step_ms_rounds = list(f.step_ms * rng.uniform(0.8, 1.2, 5))
            f.rate_rounds = list(f.rate * rng.uniform(0.8, 1.2, 5))
        m.step_ms_rounds = list(300.0 * rng.uniform(0.9, 1.1, 5))
        v = decide(m)
        seen.add((v.bottleneck, tuple(v.fixes)))
    assert {b for b, _ in seen} <= {"cores", "inconclusive"} and all(f == () for _, f in seen), seen


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
    monkeypatch.syspath_prepend(REPO_DIR)  # tests.support.doctor
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
    name, doc = doctor(tmp_path, capsys, helpers, "--transforms", "tests.support.doctor:small",
                       "--batch-size", "4", "--seconds", "3")
    assert name == "decode", doc
    m = doc["measurements"]
    assert m["source_kind"] == "folder" and m["fed"] == {} and m["model"] is None
    assert m["decode_ms"] > 0 and m["loader_rate"] > 0 and m["timeline"]


def test_doctor_names_a_slow_transform(helpers, tmp_path, capsys):
    name, doc = doctor(tmp_path, capsys, helpers, "--transforms", "tests.support.doctor:slow_transforms",
                       "--batch-size", "4", "--seconds", "3")
    assert name == "transforms", doc


def test_doctor_names_a_slow_source(helpers, tmp_path, capsys):
    name, doc = doctor(tmp_path, capsys, "tests.support.doctor:SerializedSource", "--transforms",
                       "tests.support.doctor:small", "--batch-size", "4", "--seconds", "3")
    assert name == "storage", doc
    assert doc["measurements"]["source_kind"] == "object"


def test_doctor_names_shards_behind_a_bandwidth_limited_server(helpers, tmp_path, capsys, file_server):
    from feeder.pack import pack

    # Small photos (a few KiB), so that a read in flight ends soon after the feeder closes.
    pack(helpers, str(tmp_path / "shards"), shard_size=1 << 20, max_side=96)
    # 100 KB/s for every connection together: a few dozen photos a second, far
    # below what the cores decode.
    with file_server(tmp_path / "shards", bandwidth=100_000) as server:
        name, doc = doctor(tmp_path, capsys, f"{server.url}/train.json", "--transforms",
                           "tests.support.doctor:small", "--batch-size", "2", "--seconds", "3")
    assert name == "storage", doc
    assert doc["measurements"]["source_kind"] == "remote-shards"


def test_doctor_names_a_slow_model_step_and_runs_every_engine(helpers, tmp_path, capsys):
    # A 200 ms step: what the loader's threads can cost the loop's own Python (a few
    # ms of GIL waits, more on a loaded machine) stays well under the 1.10x limit.
    name, doc = doctor(tmp_path, capsys, helpers, "--transforms", "tests.support.doctor:small",
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
    name, doc = doctor(tmp_path, capsys, "tests.support.doctor:ManyPhotos", "--transforms",
                       "tests.support.doctor:gil_transforms", "--model",
                       "tests.support.doctor:launch_bound_step", "--batch-size", "1", "--seconds", "4")
    m = doc["measurements"]
    other = m["other_cores_run"] or 0.0
    need = m["model_rate"] * (m["decode_ms"] + m["transform_ms"]) / 1e3
    if m["step_cpu_cores"] + need + other > SHARED * m["cores"] and other > LOADED_CORES:
        # Other processes (a parallel test run) took a share of the cores the step
        # and the loader use: in most rounds that may be what slowed the step, and
        # the doctor then says so, naming them, rather than blame the GIL.
        assert name in ("interference", "cores"), doc
        if name == "cores":
            assert "other processes used" in doc["verdict"]["why"], doc
            return
    assert name == "interference", doc
    fed = doc["measurements"]["fed"]
    assert set(fed) == {"threads", "process", "tune"}
    # A fix that takes threads off the GIL, advised when measured helping beyond the
    # noise (isolation or tune), else listed to try.
    verdict = doc["verdict"]
    assert (any(fix.startswith(('isolation="process"', 'decode_threads="tune"')) for fix in verdict["fixes"])
            or any("GIL" in t for t in verdict["tries"])), verdict


def test_doctor_without_matplotlib_says_so(helpers, tmp_path, capsys, monkeypatch):
    import feeder.doctor.report as report

    monkeypatch.setattr(report, "plot", lambda *a: None)
    out = tmp_path / "out"
    assert main([helpers, "--transforms", "tests.support.doctor:small", "--batch-size", "4",
                 "--seconds", "1", "--out", str(out), "-q"]) == 0
    captured = capsys.readouterr()
    assert "matplotlib not installed" in captured.err
    assert "matplotlib not installed" in (out / "report.txt").read_text()
    assert not (out / "doctor.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["/no/such/folder"], "DATA '/no/such/folder'"),
    (["tests.support.doctor:nothing"], "has no 'nothing'"),
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


def test_doctor_imports_model_from_the_current_folder(helpers, tmp_path, capsys, monkeypatch):
    # As `python -m` does: a mymodel.py beside the user is found without PYTHONPATH=.
    (tmp_path / "doctor_model_here.py").write_text("def train_step(images, labels):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main([helpers, "--model", "doctor_model_here:no_such_step", "--out", str(tmp_path / "o"),
                 "-q"]) == 2
    assert "module 'doctor_model_here' has no 'no_such_step'" in capsys.readouterr().err


def test_fed_runs_read_passes_long_enough_for_tune_to_shrink():
    # "tune" restarts its windows each pass: a 10-sample source at batch 4 gives
    # passes of 2 batches, in which it could never shrink a thread.
    from feeder.doctor import measure

    class Ten:
        reads_may_block = False

        def __len__(self):
            return 10

        def read(self, index):
            return b"x", index

    need = measure.tune_batches()
    source, per_pass = measure.fed_source(Ten(), "object", 4, need)
    assert per_pass >= need and len(source) // 4 == per_pass
    assert source.read(13) == (b"x", 3) and source.reads_may_block is False
    assert "Ten[3]" in source.describe(13)
    # Shards keep their order (shard by shard): as they are, and the note says so.
    same, per_pass = measure.fed_source(Ten(), "shards", 4, need)
    assert isinstance(same, Ten) and per_pass == 2


def test_the_process_tree_cpu_counts_a_live_worker():
    from feeder.doctor import measure

    before = measure.tree_cpu_s()
    # A child that burns CPU, says so, and stays alive until told to end.
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\n"
                              "print('done', flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        assert measure.tree_cpu_s() - before >= 0.4
    finally:
        child.communicate("", timeout=60)


def test_python_dash_m_feeder_doctor():
    r = subprocess.run([sys.executable, "-m", "feeder.doctor", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "feeder-doctor" in r.stdout and "--step-ms" in r.stdout


# -- hostile arguments: one line naming the culprit, never a traceback -----------------

@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, str]:
    from tests.support.cli import hostile_files

    return hostile_files(tmp_path_factory.mktemp("doctor-hostile"))


DOCTOR_HOSTILE = [
    # (argv, status, names the last line must hold)
    (["http://127.0.0.1:{port}/train.json"], 1, ["http://127.0.0.1:{port}/train.json"]),
    (["{missing}.json"], 2, ["{missing}.json"]),
    (["{photos}", "--model", "tests.support.cli:raising_step", "--batch-size", "2", "--seconds", "1"], 1,
     ["--model tests.support.cli:raising_step raised ValueError: the step blew up"]),
    (["tests.support.cli:raising_source"], 1, ["DATA tests.support.cli:raising_source raised RuntimeError"]),
    (["tests.support.cli:BrokenReads", "--batch-size", "2"], 1,
     ["DATA tests.support.cli:BrokenReads: reading sample", "disk gone"]),
    (["tests.support.cli:NoneAtTwo", "--batch-size", "2", "--seconds", "1", "--step-ms", "5"], 1,
     ["DATA tests.support.cli:NoneAtTwo: reading sample 2 (NoneAtTwo[2])", "returned None"]),
    (["{photos}", "--model", "no_such_module:step"], 2, ["no_such_module"]),
    (["{photos}", "--device", "bogus"], 2, ["--device 'bogus'"]),
    (["{photos}", "--batch-size", "2", "--out", "{afile}"], 2, ["--out '{afile}'"]),
    (["{photos}", "--transforms", "tests.support.cli:forty_two"], 2,
     ["--transforms tests.support.cli:forty_two gave 42, not a list of transforms"]),
    (["{notimg}", "--batch-size", "2", "--seconds", "1"], 1, ["{notimg}/a/", "not a decodable image"]),
    (["{empty}"], 2, ["{empty}"]),
    (["{photos}", "--seconds", "-1"], 2, ["--seconds"]),
    (["{photos}", "--transforms", "bogus"], 2, ["--transforms bogus: expected train, eval or MODULE:NAME"]),
    (["{photos}", "--model", "foo"], 2, ["--model foo: expected builtin or MODULE:NAME"]),
]


@pytest.mark.parametrize("argv, status, names", DOCTOR_HOSTILE)
def test_doctor_hostile_arguments_end_in_one_line(hostile, tmp_path, argv, status, names):
    from tests.support.cli import assert_one_line_error, run_cli

    out = [] if "--out" in argv else ["--out", "{out}"]
    r = run_cli("feeder.doctor", [*argv, *out, "-q"], hostile, tmp_path)
    assert_one_line_error(r, "feeder-doctor", names, hostile, status)


def test_doctor_debug_shows_the_traceback_of_user_code(hostile, tmp_path):
    from tests.support.cli import run_cli

    r = run_cli("feeder.doctor", ["tests.support.cli:raising_source", "--debug", "-q", "--out", "{out}"],
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
