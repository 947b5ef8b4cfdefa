"""Trainers drive the feeder: ``iter()`` probes cost nothing, the epoch set between
``iter()`` and ``next()`` holds, ``Feeder.sampler`` / ``skip`` / ``dataset``; a real
Lightning ``Trainer`` (epochs, checkpoints) and real Accelerate (the example under
``torchrun``), on the CPU."""

from __future__ import annotations

import collections
import gc
import json
import os
import subprocess
import sys
import threading
import warnings
import weakref

import numpy as np
import pytest
import torch

import feeder as feeder_pkg
from tests.support import (JOIN_TIMEOUT_S, CountingSource, MemorySource, drain, feeder_threads,
                      wait_no_feeder_threads)
from tests.support.faults import distinct_jpegs, feeder_factory
from feeder import Feeder, FeederError, ops
from tests.support import REPO_DIR

REPO = REPO_DIR
B = 4


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return distinct_jpegs(24, seed=700, side=16)


make = feeder_factory(B, lambda: [ops.RandomResizedCrop(16)], seed=9, shuffle=True, decode_threads=2)


def orders(f: Feeder, epochs) -> list[list[int]]:
    """Sample indices of each batch of the given epochs (set_epoch before each)."""
    out = []
    for epoch in epochs:
        f.set_epoch(epoch)
        batches, err = drain(f)
        assert err is None, err
        out += [y.tolist() for _, y in batches]  # labels are the sample indices
    return out


def reference(blobs, epochs, **kw) -> list[list[int]]:
    with make(MemorySource(blobs), **kw) as f:
        return orders(f, epochs)


# -- iter() costs nothing --------------------------------------------------------------------------

def test_an_iterator_dropped_before_next_leaves_no_trace(blobs):
    with make(MemorySource(blobs)) as f:
        want = reference(blobs, [0])
        before = f.state_dict()
        for _ in range(3):  # Lightning probes with iter() and drops it
            it = iter(f)
            assert feeder_threads() == [], "iter() alone started threads"
            del it
        assert f.state_dict() == before and f.stats().batches == 0
        # The first real pass is still epoch 0.
        batches, err = drain(f)
        assert err is None and [y.tolist() for _, y in batches] == want
        assert f.last_batch.epoch == 0


def test_set_epoch_between_iter_and_next_decides_the_epoch(blobs):
    with make(MemorySource(blobs)) as ref:
        want = orders(ref, [3, 4])
    with make(MemorySource(blobs)) as f:
        it = iter(f)  # Lightning: iter() on the loader, then on_train_epoch_start, then next()
        f.set_epoch(3)
        got = [y.tolist() for _, y in drain(it)[0]]
        assert f.last_batch.epoch == 3
        it = iter(f)  # no set_epoch: the epoch after the last pass's
        got += [y.tolist() for _, y in drain(it)[0]]
        assert f.last_batch.epoch == 4
    assert got == want


def test_a_dropped_iterator_keeps_a_loaded_state(blobs):
    src = MemorySource(blobs)
    with make(src) as ref:
        want = orders(ref, [0])
    with make(src) as f:
        it = iter(f)
        taken = [next(it)[1].tolist() for _ in range(2)]
        state = f.state_dict()
    with make(src) as f:
        f.load_state_dict(state)
        del_probe = iter(f)
        del del_probe
        assert f.state_dict() == state
        rest = [y.tolist() for _, y in drain(f)[0]]
    assert taken + rest == want


def test_the_pass_that_starts_last_replaces_the_other(blobs):
    with make(MemorySource(blobs), queue_size=1) as f:
        early, late = iter(f), iter(f)
        next(late)  # late's pass starts first: epoch 0
        assert f.last_batch.epoch == 0
        next(early)  # early's pass starts now (epoch 1), stopping late's
        assert f.last_batch.epoch == 1
        with pytest.raises(FeederError, match="new pass of the same feeder"):
            next(late)
        assert len(drain(early)[0]) == len(f) - 1


def test_threads_sharing_a_fresh_iterator_start_one_pass(blobs):
    n = 3
    with make(MemorySource(blobs)) as f:
        want = sorted(i for batch in reference(blobs, [0]) for i in batch)
        it = iter(f)
        start = threading.Barrier(n)
        got: list[list[int]] = [[] for _ in range(n)]
        errors: list[BaseException] = []

        def consume(k: int) -> None:
            try:
                start.wait(JOIN_TIMEOUT_S)  # every thread's first next() at once
                for _, y in it:
                    got[k] += y.tolist()
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                errors.append(exc)

        threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_TIMEOUT_S)
        assert not any(t.is_alive() for t in threads) and errors == []
        assert sorted(i for g in got for i in g) == want  # one pass, each sample once
        assert f.state_dict()["next_epoch"] == 1


def test_next_on_a_feeder_closed_after_iter_raises(blobs):
    f = make(MemorySource(blobs))
    it = iter(f)
    f.close()
    with pytest.raises(FeederError, match="closed"):
        next(it)
    assert feeder_threads() == []


# -- Feeder.sampler, Feeder.dataset, Feeder.skip ---------------------------------------------------

def test_sampler_set_epoch_sets_the_feeders(blobs):
    with make(MemorySource(blobs)) as ref:
        want = orders(ref, [5])
    with make(MemorySource(blobs), rank=1, world_size=2) as f:
        assert f.batch_sampler is None and len(f.sampler) == f.num_samples == 12
    f = make(MemorySource(blobs))
    f.sampler.set_epoch(5)
    assert [y.tolist() for _, y in drain(f)[0]] == want
    # The sampler does not keep an unclosed feeder alive.
    sampler, ref = f.sampler, weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None and wait_no_feeder_threads() == []
    with pytest.raises(ReferenceError):
        sampler.set_epoch(1)


def test_dataset_answers_len_and_indexing(blobs):
    # Reference scripts read len(loader.dataset); evaluation helpers index it
    # (see test_conventions.py for the samples it returns).
    with make(MemorySource(blobs)) as f:
        assert hasattr(f, "dataset") and len(f.dataset) == len(blobs)
        image, label = f.dataset[1]
        assert image.dtype == torch.uint8 and label == 1


@pytest.mark.parametrize("ordered", [True, False])
def test_skip_reads_nothing_it_skips(blobs, ordered):
    ref_src = MemorySource(blobs)
    with make(ref_src, ordered=True) as ref:
        ref.set_epoch(2)
        whole = drain(ref)[0]
    k = 3
    skipped = {i for _, y in whole[:k] for i in y.tolist()}
    src = CountingSource(blobs)
    with make(src, ordered=ordered) as f:
        f.set_epoch(2)
        f.skip(k)
        state = f.state_dict()  # a pending skip is part of the state
        it = iter(f)
        rest = [next(it)]
        assert f.last_batch.number == k and f.last_batch.epoch == 2
        rest += drain(it)[0]
    assert not skipped & set(src.reads), "skipped samples were read"
    if ordered:
        assert len(rest) == len(whole) - k
        for (x, y), (wx, wy) in zip(rest, whole[k:]):
            np.testing.assert_array_equal(np.asarray(y), wy)
            np.testing.assert_array_equal(np.asarray(x), wx)
    else:
        got = sorted(int(i) for _, y in rest for i in y)
        assert got == sorted(set(range(len(blobs))) - skipped)
    with make(MemorySource(blobs), ordered=ordered) as f:
        f.load_state_dict(state)
        again = drain(f)[0]
    assert sorted(int(i) for _, y in again for i in y) == sorted(set(range(len(blobs))) - skipped)


def test_skip_refuses_what_it_cannot_do(blobs):
    with make(MemorySource(blobs)) as f:
        for bad in (-1, len(f), 1.0, True):
            with pytest.raises(ValueError, match=r"batches must be an int in \[0, len\(feeder\)\)"):
                f.skip(bad)
        it = iter(f)
        next(it)
        state = f.state_dict()
    with make(MemorySource(blobs)) as f:
        f.load_state_dict(state)
        with pytest.raises(ValueError, match="already positions the next pass inside epoch 0"):
            f.skip(1)
        f.skip(0)  # nothing to skip: fine
    with make(MemorySource(blobs)) as f:
        f.skip(2)
        f.set_epoch(1)  # another epoch: the skip is cancelled
        assert [y.tolist() for _, y in drain(f)[0]] == reference(blobs, [1])


# -- Lightning ------------------------------------------------------------------------------------

def lightning_module(L, feeder: Feeder, hook: bool):
    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3 * 16 * 16, 4)
            self.trained_on: list[tuple[int, int, list[int]]] = []

        def train_dataloader(self):
            return feeder

        def on_train_epoch_start(self):
            if hook:  # what users write for a loader without a sampler
                feeder.set_epoch(self.current_epoch)

        def training_step(self, batch, batch_idx):
            x, y = batch
            info = feeder.last_batch
            assert info.indices.tolist() == y.tolist()
            self.trained_on.append((self.current_epoch, info.epoch, y.tolist()))
            return torch.nn.functional.cross_entropy(self.net(x.reshape(len(x), -1)), y % 4)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


def fit(L, feeder: Feeder, hook: bool = False, epochs: int = 3, ckpt_path=None, callbacks=()):
    """Train for ``epochs`` epochs; returns (module, warnings Lightning gave about the loader)."""
    module = lightning_module(L, feeder, hook)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(callbacks), callbacks=list(callbacks))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=ckpt_path)
    about_loader = [str(w.message) for w in caught
                    if any(k in str(w.message).lower()
                           for k in ("sampler", "dataloader", "shuffl", "worker", "resumable", "iterable"))]
    return module, about_loader


@pytest.fixture(scope="module")
def L():
    return pytest.importorskip("lightning")


def train_feeder(blobs, **kw) -> Feeder:
    return make(MemorySource(blobs), dtype=torch.float32, **kw)


@pytest.mark.parametrize("hook", [False, True], ids=["lightning-alone", "set_epoch-in-hook"])
def test_lightning_gives_each_epoch_its_own_order(L, blobs, hook):
    with train_feeder(blobs) as ref:
        want = [(e, e, batch) for e in range(3) for batch in orders(ref, [e])]
    with train_feeder(blobs) as f:
        module, about_loader = fit(L, f, hook)
    assert module.trained_on == want
    assert about_loader == []


@pytest.mark.parametrize("ordered,step,when", [
    (True, 8, "steps"), (True, 6, "steps"), (True, 6, "epochs"), (False, 8, "steps")],
    ids=["mid-epoch", "after-last-batch-of-epoch-0", "end-of-epoch-0", "mid-epoch-unordered"])
def test_lightning_checkpoint_resumes_the_feeder(L, blobs, tmp_path, ordered, step, when):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # 24 samples, batch 4: 6 steps per epoch; 3 epochs in all.
    if when == "steps":
        every = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=step, save_top_k=-1)
    else:  # saved at the end of each training epoch
        every = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_epochs=1, save_top_k=-1)
    with train_feeder(blobs, ordered=ordered) as f:
        whole, _ = fit(L, f, callbacks=[every])
    path = tmp_path / f"step={step}.ckpt"
    saved = torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(saved) == 1 and saved[0]["epoch"] == (1 if step == 8 else None)
    with train_feeder(blobs, ordered=ordered) as f:  # a new job: new feeder, new Trainer
        resumed, about_loader = fit(L, f, ckpt_path=str(path))
    assert about_loader == []  # no "not resumable" warning
    if ordered:
        assert resumed.trained_on == whole.trained_on[step:]
    else:
        # Each epoch's remaining samples exactly once (batches may differ).
        def per_epoch(rows):
            out = collections.defaultdict(list)
            for epoch, _, batch in rows:
                out[epoch] += batch
            return {e: sorted(v) for e, v in out.items()}
        assert per_epoch(resumed.trained_on) == per_epoch(whole.trained_on[step:])


DDP_SCRIPT = """
import json, os, sys
sys.path.insert(0, {repo!r})
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tests.support import MemorySource
from tests.support.faults import distinct_jpegs
from feeder import Feeder, ops

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3 * 16 * 16, 4)
        # Built before the process group exists (Lightning creates it in fit()).
        self.feeder = Feeder(MemorySource(distinct_jpegs(48, seed=900, side=16)), 4, [ops.CenterCrop(16)],
                             seed=3, shuffle=True, drop_last=True, dtype=torch.float32, decode_threads=1)
        self.trained_on = []

    def train_dataloader(self):
        return self.feeder

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.trained_on.append((self.current_epoch, y.tolist()))
        return torch.nn.functional.cross_entropy(self.net(x.reshape(len(x), -1)), y % 4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    kw = dict(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
              enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    if mode == "whole":
        every = ModelCheckpoint(dirpath=out, filename="{{step}}", every_n_train_steps=4, save_top_k=-1)
        L.Trainer(callbacks=[every], **kw).fit(module)
    else:
        L.Trainer(enable_checkpointing=False, **kw).fit(module, ckpt_path=os.path.join(out, "step=4.ckpt"))
    with open(os.path.join(out, mode + str(module.global_rank) + ".json"), "w") as f:
        json.dump({{"world": module.trainer.world_size, "trained_on": module.trained_on}}, f)
    module.feeder.close()
"""


def test_lightning_ddp_resumes_every_rank_from_rank_0s_checkpoint(L, tmp_path):
    """Lightning writes checkpoints from rank 0 only: every rank resumes from rank 0's
    feeder state (2 CPU processes, strategy="ddp")."""
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT.format(repo=REPO_DIR))
    for mode in ("whole", "resume"):
        run_example([sys.executable, str(script), str(tmp_path), mode], timeout=240)
    runs = {(mode, r): json.loads((tmp_path / f"{mode}{r}.json").read_text())
            for mode in ("whole", "resume") for r in range(2)}
    assert {run["world"] for run in runs.values()} == {2}
    # 48 samples, 2 ranks, batch 4: 6 steps per epoch; step 4 is inside epoch 0.
    whole = [runs["whole", r]["trained_on"] for r in range(2)]
    assert [len(w) for w in whole] == [12, 12]
    for epoch in range(2):
        a, b = ([i for e, batch in w if e == epoch for i in batch] for w in whole)
        assert sorted(a + b) == list(range(48))  # disjoint shards covering the epoch
    for r in range(2):
        assert [list(x) for x in runs["resume", r]["trained_on"]] == [list(x) for x in whole[r][4:]]


def run_example(args: list[str], timeout: float) -> str:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(feeder_pkg.__file__)),
               OMP_NUM_THREADS="1")
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_lightning_example_runs(L):
    out = run_example([sys.executable, "examples/train_lightning.py"], timeout=240)
    for epoch in range(3):
        assert f"epoch {epoch}: 64 samples, every sample once: True, new order: True" in out, out
    assert "validation: 3 runs after the sanity check, every sample once in each: True" in out, out
    assert "checkpoint at step 11 holds the feeder's state (epoch 1, 3 batches delivered)" in out, out
    assert "resumed from step 11: 13 steps, the uninterrupted run's batches: True" in out, out


# -- Accelerate -----------------------------------------------------------------------------------

def test_accelerate_example_under_torchrun():
    pytest.importorskip("accelerate")
    pytest.importorskip("torch.distributed.run")
    out = run_example([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       "examples/train_accelerate.py"], timeout=300)
    assert ("prepare(feeder) returns it unchanged: True; 2 process(es), 4 batches per epoch per rank"
            in out), out
    for epoch in range(2):
        assert f"epoch {epoch}: 64 samples, every sample once: True" in out, out
    assert ("resume from the feeder's state: epoch 1 from batch 3: the uninterrupted run's batches: True"
            in out), out
    assert "resume with skip(3): epoch 1 from batch 3: the uninterrupted run's batches: True" in out, out
    assert ("eval: 49 samples (shards [25, 24], batches [4, 3]), every sample once: True" in out), out


def test_accelerate_checkpointing_a_registered_feeder(blobs, tmp_path):
    """One process: register_for_checkpointing saves and loads the feeder's state."""
    accelerate = pytest.importorskip("accelerate")
    src = MemorySource(blobs)
    with make(src) as ref:
        want = orders(ref, [0, 1])
    accelerator = accelerate.Accelerator(cpu=True)
    with make(src) as f:
        accelerator.register_for_checkpointing(f)
        it = iter(f)
        taken = [next(it)[1].tolist() for _ in range(2)]
        accelerator.save_state(str(tmp_path))
    with make(src) as f:  # a new job: a new Accelerator, a new feeder registered alike
        accelerator = accelerate.Accelerator(cpu=True)
        accelerator.register_for_checkpointing(f)
        accelerator.load_state(str(tmp_path))
        rest = [y.tolist() for _, y in drain(f)[0]] + [y.tolist() for _, y in drain(f)[0]]
    assert taken + rest == want


def test_accelerate_skip_first_batches_says_what_to_use(blobs):
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    with make(MemorySource(blobs)) as f:
        assert accelerator.prepare(f) is f  # passed through untouched
        with pytest.raises(AttributeError, match=r"feeder\.skip\(num_batches\) after feeder\.set_epoch"):
            accelerator.skip_first_batches(f, 2)
        assert feeder_threads() == []
