"""Test-wide environment: no network waits from Hugging Face, no wandb uploads, the CPU and gloo
even on a machine with GPUs (``MEGAPIPE_DEVICE=cpu``; the CUDA tests ask for the GPU themselves),
and pipeline messages held to NCCL's rules on gloo (the strict transport of
``pipeline/p2p.py``), so every multi-rank run on CPU would also finish on NCCL. ``make_test_hosts`` gives tests several
hosts (network namespaces) on this machine."""

import gc
import importlib
import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("MEGAPIPE_STRICT_TRANSPORT", "1")
os.environ.setdefault("MEGAPIPE_DEVICE", "cpu")


import pytest  # noqa: E402
import torch  # noqa: E402

from megapipe.testing.hosts import NamespacesUnavailable, TestHosts  # noqa: E402
import parallel_lanes  # noqa: E402
from parallel_lanes import group_of, in_worker, order_for_workers  # noqa: E402

# the lanes of ``pytest -n 3`` (parallel_lanes.py) act through these hooks of this conftest
pytest_configure, pytest_unconfigure = parallel_lanes.pytest_configure, parallel_lanes.pytest_unconfigure
pytest_runtest_setup = parallel_lanes.pytest_runtest_setup


def _import_triton_interpreted() -> None:
    """On a machine without CUDA, import Triton with its CPU interpreter on, before anything else does.

    Triton decides when it is imported whether its own library functions (``tl.sum``, ``tl.max``,
    ``tl.rand``) are interpreted, and torch imports it early (``torch.utils.flop_counter`` does in
    torch 2.11): a kernel interpreted later would call compiled library functions and fail ("Cannot
    call @triton.jit'd outside of the scope of a kernel"). ``TRITON_INTERPRET`` is put back afterwards:
    it is also the switch megapipe reads, which only the Triton kernel tests turn on
    (``tests/fusion_helpers.py``).
    """
    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


_import_triton_interpreted()


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


@pytest.fixture(scope="module")
def bench():
    """``benchmarks/bench_single_device.py`` as a module: its systems, rows and helpers."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module("bench_single_device")
    finally:
        sys.path.remove(folder)


TIERS = ("unit", "distributed", "system")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Refuse to run a collection in which a test has no tier or more than one (``pyproject.toml``
    describes them): ``-m unit`` is only the fast, single-process inner loop while every test is
    marked with what it really starts. Then give each test its file's ``xdist_group``: under
    ``pytest -n N --dist loadgroup`` a file stays on one worker, so its module-scoped worlds, clusters
    and checkpoints start once, and the paced files all share one worker (``parallel_lanes.py``), which
    puts them first."""
    wrong, tier_of = [], {}
    for item in items:
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        tier_of[item] = tiers[0] if tiers else None
        if len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(tiers) if tiers else 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} tests need exactly one of the markers {', '.join(TIERS)} (set pytestmark = "
            "pytest.mark.<tier> in the file, or mark the test):\n" + "\n".join(wrong[:50]))
    for item in items:
        if not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(group_of(item)))
    if in_worker():
        order_for_workers(items, tier_of.__getitem__)


def pytest_collection_finish(session):
    """Keep what importing and collecting made (modules, the test items) out of every later collection's
    walk: the suite's own and the tests' ``gc.collect()`` each took about a fifth of a second more for it."""
    gc.freeze()
