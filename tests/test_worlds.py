"""``run_distributed`` forks its ranks from a server started at its first use: each rank still sees
the caller's environment as it is at the call, and arguments of any number of tensors arrive whole."""

import os

import pytest
import torch

from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed


def _environment_and_arguments(rank, world_size, name, tensors):
    return os.environ.get(name), len(tensors), float(sum(t.sum() for t in tensors))


def test_ranks_see_the_callers_environment_now_and_receive_every_tensor(monkeypatch):
    name = "MEGAPIPE_WORLDS_TEST"
    monkeypatch.delenv(name, raising=False)
    assert run_distributed(1, _environment_and_arguments, name, [])[0] == (None, 0, 0.0)  # the server is up
    monkeypatch.setenv(name, "set after the server started")
    tensors = [torch.full((3,), float(i)) for i in range(300)]  # more than a fork server passes as descriptors
    expected = ("set after the server started", 300, 3.0 * sum(range(300)))
    assert run_distributed(2, _environment_and_arguments, name, tensors) == [expected, expected]
