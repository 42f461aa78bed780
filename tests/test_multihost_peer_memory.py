"""A host lost, its memory with it: the relaunch resumes from the copy its peer host holds, not from disk.

Two test hosts of one rank each (d = 2) train with a copy in peer memory every 2 iterations
(``--local-checkpoint-interval``; each host its own directory) and a disk checkpoint only at iteration
20, which the run never reaches. After iteration 7 is logged every process of host 1 is SIGKILLed and
its directory removed (its memory is gone). The relaunch (the same command on both hosts) must restore
the newest iteration whose copies both ranks wrote, rank 1's state from host 0, and log every iteration
the first run logged after it with the same loss (all printed digits), then finish.
"""

import os
import re
import shutil

import pytest

from checkpoint_helpers import TINY_GPT, session_cache
from launch_helpers import REPO, Job, losses, on_host

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]
TIMEOUT_SECONDS = 20  # a lost peer is waited for this long
STOP_SECONDS = TIMEOUT_SECONDS + 60  # the timeout, then the launchers' shutdown of their workers
RUN_SECONDS = 240
TRAIN_ITERS, COPY_INTERVAL = 40, 2


def _memory(root: str, node: int) -> str:
    return os.path.join(root, f"host-{node}-memory")


def _launch(hosts, root: str, cache: str, run_id: str) -> Job:
    disk = os.path.join(root, "ckpt")

    def argv(node: int) -> list[str]:
        return [os.path.join(REPO, "pretrain_gpt.py"), *TINY_GPT, "--train-iters", str(TRAIN_ITERS), "--save", disk,
                "--load", disk, "--save-interval", "20", "--local-checkpoint-interval", str(COPY_INTERVAL),
                "--local-checkpoint-dir", _memory(root, node), "--data-cache-path", cache,
                "--distributed-timeout-minutes", str(TIMEOUT_SECONDS / 60)]

    return Job(*(on_host(hosts, node, 1, argv(node), run_id) for node in range(len(hosts))), forked=True)


def test_a_relaunch_after_a_host_loss_restores_from_the_surviving_hosts_memory(make_test_hosts, tmp_path,
                                                                               tmp_path_factory):
    hosts, cache, root = make_test_hosts(2), session_cache(tmp_path_factory), str(tmp_path)
    job = _launch(hosts, root, cache, "first")
    try:
        job.wait_for(r"iteration\s+7/", RUN_SECONDS)
        hosts.kill(1)
        assert job.finish(STOP_SECONDS) != 0
    finally:
        job.close()
    logged = losses(job.lines)
    shutil.rmtree(_memory(root, 1))
    job = _launch(hosts, root, cache, "resumed")
    try:
        line = job.wait_for(r"restoring iteration \d+ from peer memory", RUN_SECONDS)
        restored = int(re.search(r"restoring iteration (\d+)", line)[1])
        assert "rank 1's from rank 0" in line and restored >= 6 and restored % COPY_INTERVAL == 0, line
        loaded = job.wait_for(r"loaded the peer-memory checkpoint", RUN_SECONDS)
        job.wait_for(rf"iteration\s+{TRAIN_ITERS}/", RUN_SECONDS)
        assert job.finish(RUN_SECONDS) == 0, job.output()[-3000:]
    finally:
        job.close()
    assert "loaded checkpoint" not in job.output()  # nothing came from the disk
    resumed, again = losses(job.lines), [i for i in sorted(logged) if i > restored]
    assert again and {i: resumed[i] for i in again} == {i: logged[i] for i in again}, (restored, logged, resumed)
    print(loaded.strip())
