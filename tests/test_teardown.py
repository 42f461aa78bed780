"""``close_distributed`` frees every process group now, so no gloo thread is left for the
interpreter's teardown (where one could abort a finished run: ``megapipe/parallel/teardown.py``)."""

import datetime
import os

import pytest
import torch

from megapipe.parallel.collectives import all_reduce
from megapipe.parallel.state import ParallelState
from megapipe.parallel.teardown import close_distributed
from megapipe.testing.worlds import run_distributed
from megapipe.training.exits import LaggedAgreement

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # a gloo group's workers and its transport's loop


def _gloo_threads() -> int:
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    return sum(name in GLOO_THREADS for name in names)


def _train_a_little() -> int:
    """What a run leaves behind once its objects are gone: the groups of a layout (kept by the
    state module for reuse), an exit agreement's and completed works on them; gloo threads now."""
    timeout = datetime.timedelta(seconds=60)
    ps = ParallelState.initialize(1, 1, timeout=timeout)
    agreement = LaggedAgreement(timeout)
    agreement.exchange([True])
    agreement.close()
    all_reduce(torch.ones(3), ps.dp_group, async_op=True).wait()
    return _gloo_threads()


def closing_every_group(rank, world_size):
    during = _train_a_little()
    close_distributed()
    return during, _gloo_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc/self/task (Linux)")
def test_closing_frees_every_group_and_joins_its_threads():
    for during, after in run_distributed(2, closing_every_group):
        assert during > 0 and after == 0
