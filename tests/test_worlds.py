"""``run_distributed`` forks its ranks from a server started at its first use: each rank still sees
the caller's environment as it is at the call, and arguments of any number of tensors arrive whole."""

import os

import pytest
import torch

from megapipe.testing.worlds import DistributedFailure, run_distributed

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


def _fails_while_its_peer_waits(rank, world_size, how):
    if rank == 0:
        if how == "raise":
            raise ValueError("the cause")
        os._exit(7)
    torch.distributed.recv(torch.empty(1), src=0)  # fails once rank 0's connection closes


@pytest.mark.parametrize("how", ["raise", "crash"])
def test_the_report_names_the_failing_rank_not_the_peer_it_cut_off(how):
    """Rank 0 fails while rank 1 waits on it: rank 1 then fails too, on the closed connection. The report
    leads with rank 0's own error (it is in the results' pipe before its connections close), or, where
    rank 0 crashed without a word, names it and its exit code."""
    with pytest.raises(DistributedFailure) as failure:
        run_distributed(2, _fails_while_its_peer_waits, how, timeout=60, collective_timeout=30)
    if how == "raise":
        assert str(failure.value).startswith("rank 0 of 2 failed:") and "ValueError: the cause" in str(failure.value)
    else:
        assert str(failure.value).startswith("rank 1 of 2 failed:")
        assert "rank 0 died with exit code 7 without reporting" in str(failure.value)
