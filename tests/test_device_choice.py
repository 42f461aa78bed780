"""Which device a process computes on: MEGAPIPE_DEVICE, then the local GPU by LOCAL_RANK, refusing a
rank that would share a GPU with another (NCCL then fails or hangs), each mistake in one sentence."""

import pytest
import torch

from megapipe.parallel import launch as distributed
from megapipe.errors import ConfigError


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine shows ``n`` CUDA devices."""
    def show(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return show


@pytest.mark.unit
def test_each_local_rank_takes_its_own_gpu(gpus, monkeypatch):
    gpus(2)
    monkeypatch.delenv("MEGAPIPE_DEVICE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.default_device() == torch.device("cuda", 1)


@pytest.mark.system
def test_a_local_rank_beyond_the_gpus_is_refused(gpus, monkeypatch):
    gpus(2)
    monkeypatch.delenv("MEGAPIPE_DEVICE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match=r"^LOCAL_RANK 2 has no GPU of its own: this node shows 2 CUDA device\(s\); "
                                          r"start at most 2 processes per node \(torchrun --nproc-per-node 2\)"):
        distributed.default_device()


@pytest.mark.unit
def test_megapipe_device_cpu_keeps_a_gpu_host_on_the_cpu(gpus, monkeypatch):
    gpus(8)
    monkeypatch.setenv("MEGAPIPE_DEVICE", "cpu")
    assert distributed.default_device() == torch.device("cpu")
    assert distributed.default_backend(distributed.default_device()) == "gloo"


@pytest.mark.unit
@pytest.mark.parametrize("value,count,message", [
    ("gpu", 1, "MEGAPIPE_DEVICE=gpu is not a device megapipe runs on; set it to cpu or cuda"),
    ("cuda", 0, "MEGAPIPE_DEVICE=cuda, but torch sees no CUDA device here"),
])
def test_a_device_that_cannot_be_had_is_one_sentence(gpus, monkeypatch, value, count, message):
    gpus(count)
    monkeypatch.setenv("MEGAPIPE_DEVICE", value)
    with pytest.raises(ConfigError, match=message):
        distributed.default_device()


@pytest.mark.unit
def test_the_timeout_is_read_when_asked_not_when_imported(monkeypatch):
    # processes forked from a server that imported megapipe long ago must see their own MEGAPIPE_TIMEOUT
    monkeypatch.setenv("MEGAPIPE_TIMEOUT", "7")
    assert distributed.default_timeout().total_seconds() == 7
    monkeypatch.delenv("MEGAPIPE_TIMEOUT")
    assert distributed.default_timeout().total_seconds() == 300
