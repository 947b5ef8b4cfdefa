"""Real multi-process runs: ``torchrun --nproc_per_node=2`` with gloo on the CPU.

Each rank builds its feeders *before* ``init_process_group`` (as plain torchrun
scripts and LightningModules do), trains a DDP model for two epochs, evaluates
exactly once per sample, and resumes from a mid-epoch state; the ranks write
what they saw, and the test checks it against the promises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import feeder as feeder_pkg
from tests.support import REPO_DIR

pytest.importorskip("torch.distributed.run")

SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r})
    import torch
    import torch.distributed as dist
    from tests.support import MemorySource
    from tests.support.faults import distinct_jpegs
    from feeder import Feeder, ops

    out_dir = sys.argv[1]
    blobs = distinct_jpegs(40, seed=31, side=16)
    train_src = MemorySource(blobs)                      # labels are the sample indices
    eval_src = MemorySource([blobs[i % 40] for i in range(109)])
    crop = [ops.CenterCrop(16)]
    torch.manual_seed(1000 + int(os.environ["RANK"]))     # ranks seed torch differently on purpose
    # Built before the process group exists:
    train = Feeder(train_src, 4, crop, shuffle=True, drop_last=True, dtype=torch.float32, decode_threads=2)
    evaluate = Feeder(eval_src, 8, crop, shuffle=False, drop_last=False, decode_threads=2)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {{"rank": rank, "world": world, "len_train": len(train), "len_eval": len(evaluate)}}

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3 * 16 * 16, 40))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    report["train"] = []
    for epoch in range(2):
        train.set_epoch(epoch)
        seen = []
        for x, y in train:
            loss = torch.nn.functional.cross_entropy(model(x.reshape(len(x), -1)), y)
            opt.zero_grad()
            loss.backward()                                 # all-reduce across the ranks
            opt.step()
            assert train.last_batch.indices.tolist() == y.tolist()
            seen += y.tolist()
        report["train"].append(seen)

    report["eval"] = [int(v) for x, y in evaluate for v in evaluate.last_batch.indices]

    # Resume mid-epoch: two batches, state, a new feeder continues the epoch.
    first = Feeder(train_src, 4, crop, shuffle=True, drop_last=True, seed=5)
    first.set_epoch(3)
    it = iter(first)
    got = [v for _ in range(2) for v in next(it)[1].tolist()]
    state = first.state_dict()
    first.close()
    second = Feeder(train_src, 4, crop, shuffle=True, drop_last=True, seed=5, decode_threads=3)
    second.load_state_dict(state)
    got += [v for x, y in second for v in y.tolist()]
    whole = Feeder(train_src, 4, crop, shuffle=True, drop_last=True, seed=5)
    whole.set_epoch(3)
    report["resume"] = got
    report["resume_reference"] = [v for x, y in whole for v in y.tolist()]

    try:  # seed given: no collective call on one rank only
        with Feeder(train_src, 4, crop, rank=0, world_size=2, seed=0) as probe:
            next(iter(probe))  # ranks are resolved when the pass starts
        report["contradiction"] = None
    except ValueError as exc:
        report["contradiction"] = str(exc)

    with open(os.path.join(out_dir, f"rank{{rank}}.json"), "w") as f:
        json.dump(report, f)
    for fd in (train, evaluate, second, whole):
        fd.close()
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun")
    script = tmp / "ranks.py"
    script.write_text(SCRIPT.format(repo=REPO_DIR))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(feeder_pkg.__file__)),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(tmp)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, f"torchrun failed:\\n{out.stdout[-3000:]}\\n{out.stderr[-3000:]}"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_feeder_built_before_the_process_group_shards_by_it(reports):
    assert [r["world"] for r in reports] == [2, 2]
    assert [r["len_train"] for r in reports] == [5, 5]  # 40 samples, 2 ranks, batch 4
    for epoch in range(2):
        a, b = (r["train"][epoch] for r in reports)
        assert len(a) == len(b) == 20 and not set(a) & set(b)  # disjoint shards
        assert sorted(a + b) == list(range(40))
    # Reshuffled per epoch, with the same order on both ranks (rank 0's seed, although
    # the ranks seeded torch differently).
    assert reports[0]["train"][0] != reports[0]["train"][1]


def test_exact_evaluation_covers_every_sample_once(reports):
    a, b = reports[0]["eval"], reports[1]["eval"]
    assert sorted(a + b) == list(range(109))
    assert (len(a), len(b)) == (55, 54)
    assert [r["len_eval"] for r in reports] == [7, 7]


def test_resume_continues_each_ranks_epoch_exactly(reports):
    for r in reports:
        assert r["resume"] == r["resume_reference"]


def test_ranks_given_by_hand_must_agree_with_the_process_group(reports):
    assert reports[0]["contradiction"] is None  # rank 0 of 2: agrees
    assert "contradicts torch.distributed (rank 1 of 2)" in reports[1]["contradiction"]
