"""The wiring seen from outside: which samples each batch holds, the topology,
and the options table."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from tests.support import MemorySource, drain
from feeder import BatchInfo, Feeder, ops
from feeder.engine.config import DEFAULTS, Config
from feeder.engine.pipeline import stage_threads
from feeder.engine.sampler import epoch_indices


def batches_with_info(f):
    """(labels, BatchInfo) for every batch of one pass, read right after each next()."""
    out = []
    for _, y in f:
        info = f.last_batch
        out.append(([int(v) for v in y], info))
    return out


@pytest.mark.parametrize("threads", [(2, 0), (2, 2)])
def test_each_batch_knows_its_epoch_number_and_source_indices(source, threads):
    with Feeder(source, 8, [ops.CenterCrop(40)], shuffle=True, seed=3, decode_threads=threads[0],
                augment_threads=threads[1]) as f:
        assert f.last_batch is None
        f.set_epoch(4)
        got = batches_with_info(f)
    order = epoch_indices(len(source), True, 3, 4).tolist()
    assert [info.number for _, info in got] == list(range(len(got)))
    assert all(isinstance(info, BatchInfo) and info.epoch == 4 for _, info in got)
    # MemorySource labels each sample with its index: indices and labels must agree.
    assert all(info.indices.tolist() == labels for labels, info in got)
    assert [i for labels, _ in got for i in labels] == order
    assert got[0][1].indices.dtype.is_floating_point is False


def test_indices_follow_samples_through_skips_and_completion_order(mixed_blobs):
    blobs = list(mixed_blobs)
    bad = {5, 17, 33}
    for i in bad:
        blobs[i] = b"\xff\xd8\xff not a jpeg"
    src = MemorySource(blobs)
    with Feeder(src, 7, [ops.CenterCrop(40)], seed=1, on_error="skip", ordered=False,
                decode_threads=3) as f:
        got = batches_with_info(f)
    flat = [i for _, info in got for i in info.indices.tolist()]
    assert all(info.indices.tolist() == labels for labels, info in got)
    assert sorted(flat) == sorted(set(range(len(blobs))) - bad)


def test_options_are_declared_once():
    fields = [f.name for f in dataclasses.fields(Config)]
    params = inspect.signature(Feeder).parameters
    assert list(params)[:3] == ["source", "batch_size", "transforms"]
    assert list(params)[3:] == [n for n in fields if n != "batch_size"]
    assert all(params[n].default == DEFAULTS[n] and params[n].kind is inspect.Parameter.KEYWORD_ONLY
               for n in DEFAULTS)


def test_an_unknown_option_names_itself_and_the_options(source):
    with pytest.raises(TypeError, match="num_workers") as info:
        Feeder(source, 4, [ops.CenterCrop(8)], num_workers=4)
    assert "decode_threads" in str(info.value)


@pytest.mark.parametrize("read, augment, expect", [
    ("auto", 0, {"sampler": 1, "read": 32, "decode": 2, "augment": 0, "transfer": 1}),
    (5, 3, {"sampler": 1, "read": 5, "decode": 2, "augment": 3, "transfer": 1}),
    (0, 0, {"sampler": 1, "decode": 2, "augment": 0, "transfer": 1}),
    (0, 3, {"sampler": 1, "decode": 2, "augment": 3, "transfer": 1})])
def test_stage_names_and_threads_come_from_the_topology(source, read, augment, expect):
    cfg = Config.build(batch_size=4, decode_threads=2, augment_threads=augment,
                       read_threads=read).resolved()
    assert list(stage_threads(cfg).items()) == list(expect.items())
    with Feeder(source, 4, [ops.CenterCrop(8)], decode_threads=2, augment_threads=augment,
                read_threads=read) as f:
        drain(f)
        stages = f.stats().stages
        assert {s.name: s.threads for s in stages} == expect
        assert all(s.items == len(source) for s in stages if s.name in ("read", "decode"))
