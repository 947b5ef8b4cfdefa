"""Batch transforms on CUDA: run on the transfer thread's side stream before the
batch's event, with generators on the device. Under the CUDA stand-in without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support import MemorySource, drain
from tests.support.faults import feeder_factory
from feeder import ops
from feeder.sample.rng import batch_generator


AUG = [ops.RandomResizedCrop(48), ops.RandomHorizontalFlip()]
SPIN = 20_000_000  # GPU clock cycles for torch.cuda._sleep: milliseconds of delay
NUM_CLASSES = 7


@pytest.fixture
def labelled(jpeg_blobs):
    return MemorySource(list(jpeg_blobs) * 2, labels=[i % NUM_CLASSES for i in range(120)])


make = feeder_factory(16, AUG, seed=11, dtype=torch.float32)


def test_transform_runs_on_side_stream_before_the_event(labelled):
    """The transform is slowed down on its stream; a consumer that did not wait for
    it (the event recorded after it) would read the unmixed batch."""
    streams = []

    def slow_fill(images, labels, generator):
        assert generator.device.type == "cuda" and images.is_cuda
        streams.append(torch.cuda.current_stream().cuda_stream)
        torch.cuda._sleep(SPIN)
        return torch.full_like(images, 7.0), labels

    consumer = torch.cuda.Stream()
    got = []
    with make(labelled, device="cuda", batch_transforms=[slow_fill]) as f, torch.cuda.stream(consumer):
        for x, y in f:
            got.append((x.sum(), x.numel()))  # queued on `consumer` right away
        torch.cuda.synchronize()
    assert len(got) == 8 and len(streams) == 8
    assert consumer.cuda_stream not in streams
    assert torch.cuda.default_stream().cuda_stream not in streams
    assert [s.item() for s, _ in got] == [7.0 * n for _, n in got]


@pytest.mark.parametrize("op", [ops.MixUp(0.4, NUM_CLASSES), ops.CutMix(1.0, NUM_CLASSES, 0.1)])
def test_mixing_on_device_matches_the_op(labelled, op):
    with make(labelled, device="cuda") as f:
        plain = [(x.clone(), y.clone()) for x, y in f]
    with make(labelled, device="cuda", batch_transforms=[op]) as f:
        mixed, err = drain(f)
    assert err is None and len(mixed) == len(plain)
    for number, ((px, py), (mx, my)) in enumerate(zip(plain, mixed)):
        ex, ey = op(px, py, batch_generator(11, 0, number, 0, px.device))
        np.testing.assert_allclose(mx, ex.cpu().numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(my, ey.cpu().numpy(), atol=1e-6)
        np.testing.assert_allclose(my.sum(1), 1.0, atol=1e-5)


def test_random_erasing_on_cuda_erases_as_on_the_cpu(labelled):
    """The rectangles are drawn on the host from each sample's stream: the same on
    either device; the fill is written on the device."""
    def run(device):
        f = make(labelled, device=device, batch_transforms=[ops.RandomErasing(p=0.5, value=-3.0)])
        return [b[0] for b in drain(f)[0]]
    cpu, cuda = run("cpu"), run("cuda")
    assert len(cpu) == len(cuda) > 1
    for a, b in zip(cpu, cuda):
        assert np.array_equal(a == -3.0, b == -3.0)
