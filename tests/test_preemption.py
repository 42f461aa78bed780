"""Preemption as Slurm does it: SIGTERM to every task, SIGKILL after the grace period.

The real entry point under torchrun, a 2-stage pipeline with dropout on, ``--save`` and ``--load``
the same directory (a job script that resumes itself) and ``--exit-signal-grace-seconds``. One
job is preempted four times and resumed each time: at a random iteration, during start-up
(right after the load, with SIGTERM sent twice), on one rank only at a random iteration, and
as a periodic save and evaluation begin. Each time every rank exits 0 within the grace
period (else the test's SIGKILL ends it and it fails) with the checkpoint of the iteration it
reached, and every loss logged after a resume equals the uninterrupted run's to all printed
digits. A run whose save takes longer than the grace period (``slow_save_gpt.py``) exits 0
without it and leaves the previous checkpoint, which a later run loads.

The signals go to torchrun's workers, as Slurm's go to every process of a task; the torchrun
of a Slurm job ignores SIGTERM (docs/training.md), so it is not signalled here. torchrun and its
workers are forked from a server that has imported torch (``Job(forked=True)``), so they start sooner;
``Job.worker_pid`` finds each worker by its rank.
"""

import os
import random
import re
import signal
import time

import pytest

from launch_helpers import REPO, Job, losses, standalone
from megapipe.checkpointing.paths import find_checkpoint, read_latest

pytestmark = [pytest.mark.system, pytest.mark.timeout(600),
              pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                                 reason="finds torchrun's workers through /proc/<pid>/task/<pid>/children (Linux)")]

GRACE = 20.0  # seconds from SIGTERM to SIGKILL: a busy 2-core machine needs a few for two iterations, a save, the exit
RUN_SECONDS = 180
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--mock-data", "--vocab-size", "64", "--log-interval", "1", "--eval-interval", "10", "--eval-iters", "1",
         "--fusion-backend", "eager", "--pipeline-model-parallel-size", "2", "--save-interval", "10",
         "--distributed-timeout-minutes", "1"]


def _command(directory: str, iterations: int, grace: float = GRACE, script: str = "pretrain_gpt.py") -> list[str]:
    return standalone(2, [os.path.join(REPO, script), *MODEL, "--train-iters", str(iterations),
                          "--save", directory, "--load", directory, "--exit-signal-grace-seconds", f"{grace:g}"])


def _preempt(job: Job, ranks=(0, 1), times: int = 1) -> int:
    """SIGTERM to ``ranks`` (``times`` each), then the iteration the job says it stopped at; it must
    exit 0 within the grace period."""
    pids = [job.worker_pid(rank) for rank in ranks]
    for _ in range(times):
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
    signalled = time.monotonic()
    code = job.finish(GRACE)  # fails the test (and close() kills) if the job outlives the grace period
    assert code == 0 and time.monotonic() - signalled < GRACE, job.output()[-3000:]
    return int(re.search(r"exiting on SIGTERM at iteration (\d+)", job.output())[1])


def _launch(command: list[str], preempt_when) -> tuple[int, dict[int, str]]:
    """Run ``command`` until ``preempt_when(job)`` returns, preempt it; (iteration reached, losses logged)."""
    job = Job(command, forked=True)
    try:
        ranks, times = preempt_when(job)
        reached = _preempt(job, ranks, times)
    finally:
        job.close()
    return reached, losses(job.lines)


def test_a_preempted_job_saves_in_its_grace_period_and_resumes_bit_for_bit(tmp_path):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    directory = str(tmp_path / "ckpt")
    iterations = 200

    def within_iteration(seconds: float) -> None:
        """Let a random part of the iteration just logged pass: the signal's moment is the random variable."""
        time.sleep(rng.uniform(0, seconds))

    def at_random_iteration(job):
        job.wait_for(rf"iteration\s+{rng.randint(3, 15)}/", RUN_SECONDS)
        within_iteration(0.05)
        return (0, 1), 1

    def at_start_up_twice(job):
        job.wait_for(r"loaded checkpoint", RUN_SECONDS)
        return (0, 1), 2

    def to_one_rank_only(job):
        job.wait_for(r"^ iteration", RUN_SECONDS)
        job.wait_for(r"^ iteration", RUN_SECONDS)
        within_iteration(0.1)
        return (1,), 1

    def at_a_periodic_save(job):
        job.wait_for(r"iteration\s+\d*0/", RUN_SECONDS)
        return (0, 1), 1

    # where to preempt -> when: wait for the moment, then (ranks signalled, SIGTERMs sent)
    points = {"a random iteration": at_random_iteration, "start-up, twice": at_start_up_twice,
              "one rank only": to_one_rank_only, "a periodic save": at_a_periodic_save}
    logged: dict[int, str] = {}
    for point, when in points.items():
        reached, seen = _launch(_command(directory, iterations), when)
        assert read_latest(directory) == reached, f"{point} (seed {seed}): no checkpoint at iteration {reached}"
        assert reached < iterations, f"{point} (seed {seed}): the job finished before the preemption"
        logged.update(seen)
    job = Job(_command(directory, iterations), forked=True)
    try:
        assert job.finish(RUN_SECONDS) == 0, job.output()[-3000:]
    finally:
        job.close()
    logged.update(losses(job.lines))

    reference = str(tmp_path / "reference")
    job = Job(_command(reference, iterations), forked=True)
    try:
        assert job.finish(RUN_SECONDS) == 0, job.output()[-3000:]
    finally:
        job.close()
    expected = losses(job.lines)
    assert set(logged) == set(expected)
    assert {i: logged[i] for i in logged if logged[i] != expected[i]} == {}, f"seed {seed}"


def test_a_save_longer_than_the_grace_period_is_skipped_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOW_SAVE_SECONDS", "15")  # every save waits 15 s first (tests/slow_save_gpt.py)
    directory = str(tmp_path / "ckpt")
    grace = 12.0  # shorter than a save, long enough for two iterations and the exit on a busy machine
    job = Job(_command(directory, 200, grace, script="tests/slow_save_gpt.py"), forked=True)
    try:
        job.wait_for(r"saved checkpoint .* at iteration 10 ", RUN_SECONDS)
        signalled = time.monotonic()
        for rank in (0, 1):
            os.kill(job.worker_pid(rank), signal.SIGTERM)
        code = job.finish(grace)
        assert code == 0 and time.monotonic() - signalled < grace, job.output()[-3000:]
    finally:
        job.close()
    assert re.search(r"no checkpoint at iteration \d+: .*the checkpoint of iteration 10 stays", job.output())
    assert read_latest(directory) == 10 and find_checkpoint(directory).endswith("iter_0000010")
    eleventh = losses(job.lines)[11]

    job = Job(_command(directory, 200) + ["--exit-interval", "11"], forked=True)  # loads it, at full speed
    try:
        job.wait_for(r"loaded checkpoint .*iter_0000010", RUN_SECONDS)
        assert job.finish(RUN_SECONDS) == 0, job.output()[-3000:]
    finally:
        job.close()
    assert losses(job.lines)[11] == eleventh
