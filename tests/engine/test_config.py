"""feeder.engine.config: every option checked once, the options that depend on each
other, "auto" resolved, and the figures derived from a Config."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pickle
from pathlib import Path

import pytest
import torch

from feeder import ConfigError, Feeder, ops
from feeder.engine.config import (DATALOADER_KEYWORDS, DEFAULT_GROUP_FACTOR, DEFAULTS, RECORDS,
                                  Config, parse_device, resolve_device)
from feeder.sample.sizes import Padding
from feeder.engine.threads import (MeasuredReadThreads, auto_read_threads, auto_threads,
                                   cores_for_this_rank, reads_may_block)
from tests.support import REPO_DIR


def test_the_options_are_feeders_keyword_parameters_with_their_defaults():
    """Feeder.__init__ lists every option of the table, keyword-only, with the
    table's default, in the table's order: in its source, where editors and type
    checkers read it, and at run time."""
    params = inspect.signature(Feeder.__init__).parameters
    options = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in options] == list(DEFAULTS)
    assert all(p.default == DEFAULTS[p.name] for p in options)
    assert "__signature__" not in vars(Feeder.__init__)  # nothing set at import
    import feeder._feeder as module

    tree = ast.parse(Path(module.__file__).read_text())
    init = next(node for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == "Feeder"
                for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    assert [a.arg for a in init.args.kwonlyargs] == list(DEFAULTS) and init.args.kwarg is None


def test_an_unknown_option_is_a_type_error_listing_the_options():
    with pytest.raises(TypeError) as info:
        Config.build(batch_size=4, decode_thread=2, shufle=True)
    text = str(info.value)
    assert "unexpected keyword argument(s): decode_thread, shufle" in text
    assert "decode_threads" in text and "start_method" in text


def test_dataloader_keywords_name_feeders_equivalent(source):
    # A port passes DataLoader's keywords first: each is answered, not buried
    # in the list of options.
    expected = {"num_workers": "decode_threads=N", "pin_memory": "device='cuda'",
                "pin_memory_device": "device='cuda:N'", "collate_fn": "batch_transforms",
                "sampler": "group_by_aspect_ratio", "batch_sampler": "rank/world_size",
                "generator": "seed=N", "worker_init_fn": "nothing runs per worker",
                "prefetch_factor": "queue_size=N", "persistent_workers": "until close()",
                "multiprocessing_context": "start_method=", "in_order": "ordered=False"}
    assert set(expected) == set(DATALOADER_KEYWORDS)
    for name, equivalent in expected.items():
        with pytest.raises(TypeError) as info:
            Feeder(source, 2, **{name: None})
        text = str(info.value)
        assert f"{name} is DataLoader's; " in text and equivalent in text, text
        assert "the options are" not in text


def test_several_unknown_keywords_are_each_answered():
    with pytest.raises(TypeError) as info:
        Config.build(batch_size=4, num_workers=8, pin_memory=True, decode_thread=2, zzz=1)
    lines = str(info.value).splitlines()
    assert lines[0].endswith("unexpected keyword argument(s): decode_thread, num_workers, "
                             "pin_memory, zzz")
    assert "decode_thread: did you mean decode_threads?" in lines
    assert any(line.startswith("num_workers is DataLoader's; ") for line in lines)
    assert any(line.startswith("pin_memory is DataLoader's; ") for line in lines)
    assert not any(line.startswith("zzz") for line in lines)  # nothing close to it
    assert lines[-1].startswith("the options are: batch_size, ")


def test_the_dataloader_keywords_are_in_the_porting_guide():
    guide = (Path(REPO_DIR) / "docs" / "from-dataloader.md").read_text()
    for name in DATALOADER_KEYWORDS:
        assert f"`{name}`" in guide, name


def test_every_default_passes_its_own_check():
    # As Feeder's documented defaults, passed explicitly, they are no mistake.
    cfg = Config.build(batch_size=4, **DEFAULTS)
    assert cfg == Config.build(batch_size=4)


def test_auto_threads_follow_the_cores_and_where_reads_wait():
    decode, augment = auto_threads(cores_for_this_rank())
    blocking = Config.build(batch_size=4).resolved()
    local = Config.build(batch_size=4).resolved(reads_block=False)
    assert (blocking.decode_threads, blocking.augment_threads) == (decode, augment)
    assert blocking.read_threads == auto_read_threads(decode)
    assert local.read_threads == 0  # fast local reads run in the decode threads
    assert Config.build(batch_size=4, read_threads=3).resolved(reads_block=False).read_threads == 3


def test_the_table_keeps_thread_counts_as_given_until_the_pipeline_resolves_them(source):
    """Config.build checks "auto" and "tune" but leaves them: what they become
    depends on the machine and the source, known where the pipeline is built."""
    given = Config.build(batch_size=4, decode_threads="tune")
    assert (given.decode_threads, given.augment_threads, given.read_threads) == ("tune", "auto", "auto")
    assert not given.threads.is_resolved
    with pytest.raises(ValueError, match="thread counts not resolved"):
        given.num_buffers
    once = given.resolved(reads_block=False)
    assert once.threads.is_resolved and once.resolved(reads_block=True) is once
    assert once.read_threads == 0 and once.tuned() == ("decode",)
    # Given as numbers, nothing to resolve: the same table.
    numbers = Config.build(batch_size=4, decode_threads=2, augment_threads=0, read_threads=0)
    assert numbers.resolved(source) is numbers
    # The feeder's table is the one its engine resolved, for its source (which
    # does not say whether its reads wait: a read stage, measured).
    with Feeder(source, 4, [ops.CenterCrop(8)]) as f:
        assert f.config.threads.is_resolved
        assert isinstance(f.config.read_threads, MeasuredReadThreads)
        assert f.config.decode_threads == auto_threads(cores_for_this_rank())[0]
        assert f.num_buffers == f.config.num_buffers


def test_queues_and_buffers_derive_from_the_thread_counts():
    cfg = Config.build(batch_size=8, decode_threads=3, augment_threads=2, read_threads=5, queue_size=4).resolved()
    assert (cfg.read_queue, cfg.decode_queue, cfg.augment_queue) == (5, 12, 8)
    in_flight = 5 + 5 + 12 + 8 + 3 + 2  # queued and in hand, every stage
    assert cfg.num_buffers == 4 + (1 + -(-in_flight // 8)) + 2


def test_dtype_and_normalize_resolve_together():
    assert Config.build(batch_size=1).dtype is None
    assert Config.build(batch_size=1, dtype=torch.uint8).dtype is None  # uint8 is the default
    assert Config.build(batch_size=1, normalize=((0.5,) * 3, (0.2,) * 3)).dtype == torch.float32
    assert Config.build(batch_size=1, dtype=torch.float16, normalize=([0, 0, 0], [1, 1, 1])).normalize == \
        ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="normalize needs a floating dtype, got torch.uint8"):
        Config.build(batch_size=1, dtype=torch.uint8, normalize=((0.5,) * 3, (0.2,) * 3))
    with pytest.raises(ValueError, match=r"normalize must be \(mean, std\) with 3 values each"):
        Config.build(batch_size=1, normalize=((0.5,) * 2, (0.2,) * 2))


def test_a_batch_transform_needing_floats_needs_a_floating_dtype():
    class Blend:
        needs_float = True

        def __call__(self, images, labels, generator):
            return images, labels

    with pytest.raises(ValueError, match="needs floating images, but the feeder outputs uint8"):
        Config.build(batch_size=2, batch_transforms=[Blend()])
    assert Config.build(batch_size=2, batch_transforms=[Blend()], dtype=torch.float32).batch_transforms
    with pytest.raises(ValueError, match=r"batch_transforms\[1\] must be callable"):
        Config.build(batch_size=2, batch_transforms=[Blend(), 3])
    with pytest.raises(ValueError, match="batch_transforms must be a list of callables"):
        Config.build(batch_size=2, batch_transforms="mixup")


@pytest.mark.parametrize("options, error, words", [
    ({"rank": 0}, ValueError, "give both rank and world_size, or neither"),
    ({"rank": 2, "world_size": 2}, ValueError, "need 0 <= rank < world_size, got rank=2, world_size=2"),
    ({"rank": -1, "world_size": 2}, ValueError, "need 0 <= rank < world_size, got rank=-1"),
    ({"world_size": 0, "rank": 0}, ValueError, "got world_size=0"),
    ({"shuffle_shards": 4}, ValueError, "shuffle_shards=4 is the window of the block shuffle"),
    ({"shuffle_window": 100, "shuffle": True}, ValueError, "shuffle_window=100 is the sample window"),
    ({"shuffle_window": 100, "shuffle": "shards", "shuffle_shards": 2}, ValueError,
     "leave shuffle_window out"),
    ({"start_method": "spawn"}, ConfigError, "start_method='spawn' applies to the worker process"),
    ({"size_divisibility": 32}, ConfigError, "size_divisibility=32 applies to variable-size batches"),
    ({"mask_fill": 0}, ConfigError, "mask_fill=0 applies to variable-size batches"),
    ({"image_size": (8, 8), "max_image_size": (16, 16)}, ConfigError,
     "give image_size (every image that size) or max_image_size"),
    ({"batch_size": 0}, ValueError, "batch_size must be a positive int, got 0"),
    ({"batch_size": True}, ValueError, "batch_size must be a positive int, got True"),
    ({"timeout": 0}, ValueError, "timeout=0 is DataLoader's 'no limit'; feeder's is timeout=None"),
    ({"timeout": -1}, ValueError, "timeout must be None or a positive number of seconds"),
    ({"timeout": float("inf")}, ValueError, "timeout must be None or a positive number"),
    ({"on_error": "ignore"}, ValueError, "on_error must be one of ('raise', 'skip')"),
    ({"isolation": "processes"}, ValueError, "isolation must be one of ('thread', 'process')"),
    ({"max_skipped": -1}, ValueError, "max_skipped must be None or an int >= 0"),
    ({"read_threads": 10**6}, ValueError, "read_threads=1000000 is more than the 1024 threads"),
    ({"decode_threads": 1025}, ValueError, "decode_threads=1025 is more than the 1024 threads"),
    ({"mask_fill": 65536, "max_image_size": (8, 8)}, ValueError, "mask_fill must be an int in [0, 65535]"),
    ({"group_by_aspect_ratio": 65}, ValueError, "group_by_aspect_ratio must be True, False or a group"),
    ({"image_size": (8, 0)}, ValueError, "image_size must be (height, width), two positive ints"),
])
def test_a_mistake_in_the_options_names_them(options, error, words):
    options = {"batch_size": 4, **options}
    with pytest.raises(error) as info:
        Config.build(**options)
    assert words in str(info.value)


def test_options_that_go_together_are_accepted():
    cfg = Config.build(batch_size=4, rank=1, world_size=2, shuffle="shards", shuffle_window=100,
                       max_image_size=(64, 48), size_divisibility=32, mask_fill=0,
                       isolation="process", start_method="spawn", timeout=5)
    assert (cfg.rank, cfg.world_size, cfg.shuffle_window, cfg.timeout) == (1, 2, 100, 5.0)
    assert (cfg.max_image_size, cfg.size_divisibility, cfg.mask_fill) == ((64, 48), 32, 0)


@pytest.mark.parametrize("value, factor", [(False, None), (None, None), (True, DEFAULT_GROUP_FACTOR),
                                           (0, 0), (5, 5)])
def test_group_by_aspect_ratio_values(value, factor):
    assert Config.build(batch_size=2, group_by_aspect_ratio=value).group_by_aspect_ratio == factor


def test_devices():
    assert parse_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    for bad in ("tpu", "meta", "cuda:x", 3.5):
        with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
            parse_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            parse_device("cuda")


def test_reads_may_block_is_the_sources_hint():
    class Hint:
        def __init__(self, value):
            self.reads_may_block = value

    class Failing:
        @property
        def reads_may_block(self):
            raise OSError("cannot tell")

    assert reads_may_block(Hint(False)) is False and reads_may_block(Hint(True)) is True
    assert reads_may_block(object()) is None  # says nothing: its reads are measured
    assert reads_may_block(Hint(None)) is None
    assert reads_may_block(Hint("no")) is True  # not a bool: not trusted
    assert reads_may_block(Failing()) is True
    # Under the block shuffle a source may say its windows are read locally.
    window = Hint(True)
    window.window_reads_may_block = False
    assert reads_may_block(window) is True and reads_may_block(window, windowed=True) is False
    assert reads_may_block(Hint(True), windowed=True) is True  # no window hint: the plain one
    assert reads_may_block(Hint(False), windowed=True) is False


def _owned(record: type) -> list[str]:
    """A record's fields that are options (not decided from other options)."""
    return [f.name for f in dataclasses.fields(record) if "derived" not in f.metadata]


def test_the_records_partition_the_option_table():
    options = [f.name for f in dataclasses.fields(Config)]
    owners = {name: [attr for attr, record in RECORDS.items() if name in _owned(record)]
              for name in options}
    assert {name: attrs for name, attrs in owners.items() if len(attrs) != 1} == {}
    # ... and a record holds nothing else but options and values decided from them.
    assert sorted(n for record in RECORDS.values() for n in _owned(record)) == sorted(options)
    for record in RECORDS.values():
        for f in dataclasses.fields(record):
            assert f.metadata.get("derived", f.name) in options, (record.__name__, f.name)


def test_each_record_holds_the_options_values():
    cfg = Config.build(batch_size=8, decode_threads=3, augment_threads=2, read_threads=5,
                       on_error="skip", max_skipped=4, timeout=9, shuffle=True, seed=7,
                       exif_orientation=True, max_pixels=1 << 20, jpeg_verify=False,
                       max_image_size=(64, 48), size_divisibility=32, mask_fill=0,
                       normalize=((0.5,) * 3, (0.2,) * 3), isolation="process")
    for attr, record in RECORDS.items():
        got = getattr(cfg, attr)
        assert type(got) is record
        for f in dataclasses.fields(record):
            if "derived" not in f.metadata:
                assert getattr(got, f.name) == getattr(cfg, f.name), (attr, f.name)
    assert cfg.order.skip and cfg.order.exif_orientation and cfg.errors.skip
    assert cfg.output.dtype == torch.float32  # resolved, as the table's
    assert (cfg.read_queue, cfg.decode_queue, cfg.augment_queue) == (
        cfg.threads.read_queue, cfg.threads.decode_queue, cfg.threads.augment_queue)


def test_variable_size_is_decided_once_with_the_configuration():
    assert Config.build(batch_size=2).sizes.padding is None
    assert Config.build(batch_size=2, image_size=(32, 32)).sizes.padding is None
    cfg = Config.build(batch_size=2, max_image_size=(64, 48), size_divisibility=32, mask_fill=0)
    assert cfg.sizes.padding == Padding(32, 0)
    assert Config.build(batch_size=2, max_image_size="auto").sizes.padding == Padding(1, 255)


def test_a_replaced_configuration_has_records_of_its_own_values():
    cfg = Config.build(batch_size=2, max_image_size="auto")
    moved = dataclasses.replace(cfg, device=torch.device("meta"), max_image_size=(8, 8),
                                read_threads=0)
    assert moved.output.device == torch.device("meta") and cfg.output.device == torch.device("cpu")
    assert moved.sizes.max_image_size == (8, 8) and moved.sizes.padding == Padding(1, 255)
    assert moved.threads.read_threads == 0
    assert pickle.loads(pickle.dumps(moved)).threads == moved.threads
