"""The control pipe's messages: each kind survives the pipe's pickling as itself,
and an error that cannot be pickled still reaches the training process."""

from __future__ import annotations

import dataclasses
import threading
from multiprocessing import resource_sharer

import numpy as np
import pytest
import torch

from tests.support import JOIN_TIMEOUT_S
from feeder.errors import FeederError
from feeder.isolation import protocol as msg

MESSAGES = [
    msg.Free(3), msg.Claim(4), msg.Waiting(True), msg.Start(1, 7, 2, 0, 1, None), msg.Stop(1),
    msg.StatsRequest(99), msg.Close(), msg.End(1, [5, 6]), msg.Error(1, FeederError("boom")),
    msg.StatsReply(99, None, [("decode", 3, "a.jpg", 1.5)]), msg.Fatal(FeederError("no source")),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_crosses_the_pipe_as_itself(message):
    back = msg.loads(msg.dumps(message))
    assert type(back) is type(message)
    for field in dataclasses.fields(message):
        a, b = getattr(message, field.name), getattr(back, field.name)
        if isinstance(a, BaseException):
            assert type(b) is type(a) and str(b) == str(a)
        else:
            assert b == a
    for field in dataclasses.fields(message):  # frozen: nothing is rewritten on the way
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(message, field.name, None)


def test_a_shipped_batch_carries_its_shared_arrays_and_fields():
    images = torch.zeros((2, 4, 4, 3), dtype=torch.uint8).share_memory_()
    message = msg.Shipped(1, 5, 2, np.array([10, 11]), {"images": images}, {"boxes": [[], []]},
                          None, ({}, None, False, True), [])
    try:
        back = msg.loads(msg.dumps(message))
    finally:
        # The tensor's file descriptor went through multiprocessing's resource
        # sharer, whose thread would live on in this test process and make
        # every later isolated Feeder's start_method="auto" spawn.
        resource_sharer.stop(JOIN_TIMEOUT_S)
    images[0, 0, 0, 0] = 7  # the same memory, not a copy
    assert back.fresh["images"][0, 0, 0, 0] == 7
    assert back.indices.tolist() == [10, 11] and back.lists == {"boxes": [[], []]}


def test_an_error_that_cannot_be_pickled_arrives_as_its_text():
    class Local(Exception):  # a local class cannot be pickled
        pass

    error = Local("bad sample")
    error.__cause__ = ValueError("inner")
    sent = msg.portable(error)
    assert isinstance(sent, FeederError)
    assert "Local: bad sample" in str(sent) and "caused by ValueError: inner" in str(sent)
    assert msg.portable(FeederError("plain")).args == ("plain",)


def test_link_sends_one_whole_message_at_a_time():
    sent = []

    class Conn:
        def send_bytes(self, data):
            sent.append(msg.loads(data))

    link = msg.Link(Conn())
    threads = [threading.Thread(target=link.send, args=(msg.Free(i),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5.0)
    assert sorted(m.serial for m in sent) == list(range(8))
    link.send_error(3, FeederError("x"))
    assert sent[-1] == msg.Error(3, sent[-1].error) and str(sent[-1].error) == "x"
