"""Hosts that fail in mid-training: a host that disappears, a link cut that heals, one that does not.

Two test hosts of one rank each run a 2-stage pipeline with the multi-node command of docs/parallelism.md
(``--save`` and ``--load`` the same directory, a checkpoint every 4 of 40 iterations, a distributed
timeout of 20 s), as a job script would, and the same command is started again afterwards. A fault
comes after iteration 5 is logged, so the newest whole checkpoint is iteration 4, or a later one where
the ranks got further before the fault took effect (they run on while the test reacts); the relaunch
must load that one and log every iteration the first run logged after it with the same loss (all
printed digits), then finish.

* 1F1B: host 1's link is cut after iteration 2 and healed 2 s later, well within the timeout:
  training goes on. After iteration 5 every process of host 1 is SIGKILLed (the host
  disappears): host 0 stops within the timeout, naming the rank it lost; the relaunch resumes
  (dropout on).
* PipeDream (weight stashing; the checkpoint holds the microbatches in flight): host 1's link
  is cut after iteration 5 and not healed. Within the timeout (plus the 10 s roll call) host 0
  names the rank it lost and exits, and host 1's worker says that the rendezvous host cannot be
  reached. Host 1's torchrun itself keeps waiting for its rendezvous store, which it cannot
  reach (torchrun's behaviour), so it is stopped as a cluster scheduler would stop it. The
  newest checkpoint is whole, and with the link back the relaunch resumes.
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
TRAIN_ITERS, SAVE_INTERVAL = 40, 4  # far more than a fault needs: the ranks never finish before it
LOST_RANK_1 = r"error: rank 0 lost contact with rank\(s\) 1 of 2: they did not answer"
LOST_STORE = r"error: rank 1 lost the job: its rendezvous store at \S+ \(the host of rank 0\) cannot be reached"


def _launch(hosts, directory: str, cache: str, schedule: str, run_id: str) -> Job:
    argv = [os.path.join(REPO, "pretrain_gpt.py"), *TINY_GPT, *layout_flags(1, 2, schedule), "--train-iters", str(TRAIN_ITERS),
            "--save", directory, "--load", directory, "--save-interval", str(SAVE_INTERVAL), "--data-cache-path", cache,
            "--distributed-timeout-minutes", str(TIMEOUT_SECONDS / 60)]
    return Job(*(on_host(hosts, node, 1, argv, run_id) for node in range(len(hosts))), forked=True)


def _newest_checkpoint_intact(directory: str) -> int:
    """The iteration of the newest checkpoint, which must be whole: 4, or later (see the module docstring)."""
    iteration = paths.read_latest(directory)
    assert iteration is not None and iteration >= 4 and iteration % SAVE_INTERVAL == 0, iteration
    found, common, tensors = read_checkpoint(directory)
    assert found == paths.iteration_dir(directory, iteration) and common.iteration == iteration and tensors
    return iteration


def _resume(hosts, directory: str, cache: str, schedule: str, logged: dict[int, str], saved: int) -> None:
    job = _launch(hosts, directory, cache, schedule, "resumed")
    try:
        job.wait_for(rf"loaded checkpoint .*iter_{saved:07d}", RUN_SECONDS)
        job.wait_for(rf"iteration\s+{TRAIN_ITERS}/", RUN_SECONDS)
        assert job.finish(RUN_SECONDS) == 0, job.output()[-3000:]
    finally:
        job.close()
    resumed, again = losses(job.lines), [i for i in sorted(logged) if i > saved]
    assert again and {i: resumed[i] for i in again} == {i: logged[i] for i in again}, (saved, logged, resumed)


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
    _resume(hosts, directory, cache, "1f1b", logged, _newest_checkpoint_intact(directory))


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
    _resume(hosts, directory, cache, "pipedream", logged, _newest_checkpoint_intact(directory))
