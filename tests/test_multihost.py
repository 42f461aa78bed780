"""Two hosts of two ranks each train exactly like one host of four.

Each host is a network namespace (``make_test_hosts``) running the multi-node
command of docs/parallelism.md: one torchrun per host with c10d rendezvous on host 0's address, ``--local-addr`` and
``is_host=1`` on the first. The reference is the same ``pretrain_gpt.py`` command under
``torchrun --standalone`` with 4 processes on one host. The same layout performs the same
floating-point operations in the same order wherever its ranks live, so every logged number
(losses, gradient norms, validation and test loss) and every tensor of the final checkpoint
(weights and Adam moments) must be identical, not merely close; dropout is on, so the random
streams must match too. The hosts' interface counters show the pipeline's boundary tensors
crossing between them.
"""

import os
import re

import pytest
import torch

from checkpoint_helpers import TINY_GPT, layout_flags, session_cache
from launch_helpers import REPO, Job, on_host, standalone
from megapipe.checkpointing.offline import read_checkpoint

pytestmark = [pytest.mark.system, pytest.mark.timeout(420)]  # three torchrun launches per layout on a busy 2-core machine
SECONDS = 240
LOGGED = re.compile(r"(iteration\s+\d+/|validation loss|test loss)")


def _argv(t: int, p: int, save: str, cache: str) -> list[str]:
    return [os.path.join(REPO, "pretrain_gpt.py"), *TINY_GPT, *layout_flags(t, p), "--train-iters", "3",
            "--save", save, "--data-cache-path", cache, "--distributed-timeout-minutes", "1"]


def _numbers(lines: list[str]) -> list[str]:
    """The logged numbers that must agree: every field of the training lines except timings, and the
    evaluation lines."""
    kept = []
    for line in lines:
        if LOGGED.search(line):
            kept.append(re.sub(r"\| (elapsed time per iteration \(ms\)|tokens/s|TFLOP/s/device|peak memory \(GiB\)):"
                               r" [^|]*", "", line).strip())
    return kept


@pytest.mark.parametrize("t,p,d", [(2, 2, 1), (1, 2, 2)])
def test_two_hosts_of_two_ranks_train_exactly_like_one_host_of_four(make_test_hosts, tmp_path, tmp_path_factory,
                                                                    t, p, d):
    cache = session_cache(tmp_path_factory)
    single = Job(standalone(4, _argv(t, p, str(tmp_path / "single"), cache)), forked=True)
    try:
        assert single.finish(SECONDS) == 0, single.output()[-3000:]
    finally:
        single.close()

    hosts = make_test_hosts(2)
    before = [hosts.counters(host) for host in range(2)]
    hosts_job = Job(*(on_host(hosts, node, 2, _argv(t, p, str(tmp_path / "hosts"), cache)) for node in range(2)),
                    forked=True)
    try:
        assert hosts_job.finish(SECONDS) == 0, hosts_job.output()[-3000:]
    finally:
        hosts_job.close()

    expected = _numbers(single.lines)
    assert len(expected) == 5  # 3 iterations, validation, test
    assert _numbers(hosts_job.lines) == expected

    # the stages sit on different hosts: each host sent at least the boundary tensors of its direction
    # (3 iterations of B / b microbatches of b s h fp32 values, split over the tensor ranks by scatter/gather)
    boundary_bytes = 3 * (8 // 2) * (2 * 16 * 32 * 4)
    for host in range(2):
        assert (hosts.counters(host) - before[host]).sent_bytes > boundary_bytes

    reference = read_checkpoint(str(tmp_path / "single"))[2]
    trained = read_checkpoint(str(tmp_path / "hosts"))[2]
    assert reference.keys() == trained.keys() and len(reference) > 10
    for name, tensor in reference.items():
        assert torch.equal(tensor, trained[name]), name
