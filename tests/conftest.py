"""Test-wide environment: no network waits from Hugging Face, no wandb uploads, the CPU and gloo
even on a machine with GPUs (``MEGAPIPE_DEVICE=cpu``; the CUDA tests ask for the GPU themselves),
and pipeline messages held to NCCL's rules on gloo (the strict transport of
``pipeline/runtime/p2p.py``), so every multi-rank run on CPU would also finish on NCCL. ``make_test_hosts`` gives tests several
hosts (network namespaces) on this machine."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("MEGAPIPE_STRICT_TRANSPORT", "1")
os.environ.setdefault("MEGAPIPE_DEVICE", "cpu")


import pytest  # noqa: E402

from megapipe.testing_hosts import NamespacesUnavailable, TestHosts  # noqa: E402


@pytest.fixture
def make_test_hosts():
    """``make_test_hosts(count, rate_mbit=None, latency_ms=None)``: a ``TestHosts`` torn down after the
    test (also when it fails or times out); the test is skipped, with the reason, where network
    namespaces cannot be made."""
    made = []

    def make(count: int, rate_mbit=None, latency_ms=None) -> TestHosts:
        try:
            hosts = TestHosts(count, rate_mbit, latency_ms)
        except NamespacesUnavailable as reason:
            pytest.skip(f"no test hosts: {reason}")
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.close()
