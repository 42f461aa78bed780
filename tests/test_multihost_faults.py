"""Hosts that fail in mid-training: a host that disappears, a link cut that heals, one that does not.

Two test hosts of one rank each run a 2-stage pipeline with the multi-node command of docs/parallelism.md
(``--save`` and ``--load`` the same directory, a checkpoint every 2 iterations, a distributed
timeout of 20 s), as a job script would, and the same command is started again afterwards.

* 1F1B: host 1's link is cut after iteration 2 and healed 2 s later, well within the timeout:
  training goes on. After iteration 5 every process of host 1 is SIGKILLed (the host
  disappears): host 0 stops within the timeout, naming the rank it lost. The relaunch loads
  iteration 4 and logs iteration 5 with the loss the first run logged (all printed digits;
  dropout on), then finishes.
* PipeDream (weight stashing; the checkpoint holds the microbatches in flight): host 1's link
  is cut after iteration 5 and not healed. Within the timeout (plus the 10 s roll call) host 0
  names the rank it lost and exits, and host 1's worker says that the rendezvous host cannot be
  reached. Host 1's torchrun itself keeps waiting for its rendezvous store, which it cannot
  reach (torchrun's behaviour), so it is stopped as a cluster scheduler would stop it. The
  checkpoint of iteration 4 is whole, and with the link back the relaunch resumes with the same
  loss at iteration 5.
"""

import os
import re
import time

import pytest

from checkpoint_helpers import TINY_GPT, layout_flags, session_cache
from launch_helpers import REPO, Job, losses, on_host
from megapipe.checkpointing import paths
from megapipe.checkpointing.offline import read_checkpoint

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]
TIMEOUT_SECONDS = 20  # a peer is waited for this long: far above the skew of two busy hosts, short for the cut
STOP_SECONDS = TIMEOUT_SECONDS + 60  # the timeout, then the launchers' shutdown of their workers
RUN_SECONDS = 240
LOST_RANK_1 = r"error: rank 0 lost contact with rank\(s\) 1 of 2: they did not answer"
LOST_STORE = r"error: rank 1 lost the job: its rendezvous store at \S+ \(the host of rank 0\) cannot be reached"


def _launch(hosts, directory: str, cache: str, schedule: str, run_id: str) -> Job:
    argv = [os.path.join(REPO, "pretrain_gpt.py"), *TINY_GPT, *layout_flags(1, 2, schedule), "--train-iters", "6",
            "--save", directory, "--load", directory, "--save-interval", "2", "--data-cache-path", cache,
            "--distributed-timeout-minutes", str(TIMEOUT_SECONDS / 60)]
    return Job(*(on_host(hosts, node, 1, argv, run_id) for node in range(len(hosts))), forked=True)


def _checkpoint_intact(directory: str, iteration: int) -> None:
    assert paths.read_latest(directory) == iteration
    found, common, tensors = read_checkpoint(directory)
    assert found == paths.iteration_dir(directory, iteration) and common.iteration == iteration and tensors


def _resume(hosts, directory: str, cache: str, schedule: str, logged: dict[int, str]) -> None:
    job = _launch(hosts, directory, cache, schedule, "resumed")
    try:
        job.wait_for(r"loaded checkpoint .*iter_0000004", RUN_SECONDS)
        job.wait_for(r"iteration\s+6/", RUN_SECONDS)
        assert job.finish(RUN_SECONDS) == 0, job.output()[-3000:]
    finally:
        job.close()
    assert losses(job.lines)[5] == logged[5]


def test_a_host_that_disappears_stops_the_job_and_a_healed_cut_does_not(make_test_hosts, tmp_path, tmp_path_factory):
    hosts, cache, directory = make_test_hosts(2), session_cache(tmp_path_factory), str(tmp_path / "ckpt")
    job = _launch(hosts, directory, cache, "1f1b", "first")
    try:
        job.wait_for(r"iteration\s+2/", RUN_SECONDS)
        hosts.cut(1)
        time.sleep(2)  # the outage itself: with TCP's retransmission back-off (~3 s) far shorter than the timeout
        hosts.heal(1)
        job.wait_for(r"iteration\s+5/", RUN_SECONDS)
        hosts.kill(1)
        lost_at = time.monotonic()
        assert job.finish(STOP_SECONDS) != 0
        assert time.monotonic() - lost_at < STOP_SECONDS
    finally:
        job.close()
    assert re.search(LOST_RANK_1, job.output()), job.output()[-3000:]
    logged = losses(job.lines)
    assert sorted(logged)[:5] == [1, 2, 3, 4, 5]
    _checkpoint_intact(directory, 4)
    _resume(hosts, directory, cache, "1f1b", logged)


def test_a_cut_that_does_not_heal_stops_both_hosts_and_the_relaunch_resumes(make_test_hosts, tmp_path,
                                                                          tmp_path_factory):
    hosts, cache, directory = make_test_hosts(2), session_cache(tmp_path_factory), str(tmp_path / "ckpt")
    job = _launch(hosts, directory, cache, "pipedream", "first")
    try:
        job.wait_for(r"iteration\s+5/", RUN_SECONDS)
        hosts.cut(1)
        cut_at = time.monotonic()
        job.wait_for_each([LOST_RANK_1, LOST_STORE], STOP_SECONDS)
        assert job.procs[0].wait(timeout=max(1.0, STOP_SECONDS - (time.monotonic() - cut_at))) != 0
        hosts.kill(1)  # its torchrun, waiting for a store it cannot reach
    finally:
        job.close()
    logged = losses(job.lines)
    hosts.heal(1)
    _checkpoint_intact(directory, 4)
    _resume(hosts, directory, cache, "pipedream", logged)
