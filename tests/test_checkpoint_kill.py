"""A rank killed with SIGKILL in mid-training: the job stops, names the lost rank, and the same
command started again resumes from the last complete checkpoint.

The real entry point under torchrun (2 pipeline stages under 1F1B and under PipeDream, a
checkpoint every 2 iterations, ``--save`` and ``--load`` the same directory, as a job script
would have it). Rank 0 is killed
once iteration 5 is logged; torchrun tears the others down and reports rank 0 as the root
cause. The relaunch loads iteration 4 and logs iteration 5 again with the same loss, to all
7 printed digits (dropout on: the random states come back too).
"""

import os
import re
import signal
import time

import pytest

from checkpoint_helpers import TINY_GPT, layout_flags, session_cache
from launch_helpers import REPO, Job, standalone

# two torchrun launches: minutes on a busy 2-core machine, beyond the suite's 300 s default
pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]

STOP_SECONDS = 60
RUN_SECONDS = 300


def _command(root: str, cache: str, schedule: str) -> list[str]:
    directory = os.path.join(root, "ckpt")
    return standalone(2, [os.path.join(REPO, "pretrain_gpt.py"), *TINY_GPT, *layout_flags(1, 2, schedule),
                          "--train-iters", "8", "--save", directory, "--load", directory, "--save-interval", "2",
                          "--data-cache-path", cache, "--distributed-timeout-minutes", "0.5"])


def _loss(line: str) -> str:
    return re.search(r"lm loss: (\S+)", line).group(1)


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="finds torchrun's workers through /proc/<pid>/task/<pid>/children (Linux)")
@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])  # PipeDream resumes with microbatches in flight
def test_a_killed_rank_stops_the_job_and_the_same_command_resumes(tmp_path, tmp_path_factory, schedule):
    command = _command(str(tmp_path), session_cache(tmp_path_factory), schedule)
    job = Job(command, forked=True)  # torchrun and its workers start sooner
    try:
        fifth = job.wait_for(r"iteration\s+5/", RUN_SECONDS)
        os.kill(job.worker_pid(0), signal.SIGKILL)
        killed_at = time.monotonic()
        code = job.finish(STOP_SECONDS)
        assert code != 0 and time.monotonic() - killed_at < STOP_SECONDS
        report = "".join(job.lines)
        assert re.search(r"Root Cause.*?rank\s*: 0 .*?SIGKILL", report, re.S), report[-3000:]
    finally:
        job.close()
    assert open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read().strip() == "4"

    job = Job(command, forked=True)
    try:
        job.wait_for(r"loaded checkpoint .*iter_0000004", RUN_SECONDS)
        again = job.wait_for(r"iteration\s+5/", RUN_SECONDS)
        assert _loss(again) == _loss(fifth)
        job.wait_for(r"iteration\s+8/", RUN_SECONDS)
        assert job.finish(RUN_SECONDS) == 0
    finally:
        job.close()
