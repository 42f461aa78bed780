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
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from checkpoint_helpers import TINY_GPT, layout_flags, session_cache

# two torchrun launches: minutes on a busy 2-core machine, beyond the suite's 300 s default
pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_SECONDS = 60
RUN_SECONDS = 300


def _command(root: str, cache: str, schedule: str) -> list[str]:
    directory = os.path.join(root, "ckpt")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            os.path.join(REPO, "pretrain_gpt.py"), *TINY_GPT, *layout_flags(1, 2, schedule),
            "--train-iters", "8", "--save", directory, "--load", directory, "--save-interval", "2",
            "--data-cache-path", cache, "--distributed-timeout-minutes", "0.5"]


class Job:
    """A launched command whose output lines are read with deadlines; killed as a group on exit."""

    def __init__(self, command: list[str]):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=REPO, start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, seconds: float) -> str:
        """The first new output line matching ``pattern``; fails after ``seconds`` or at the end of output."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line matching {pattern!r} within {seconds} s:\n{''.join(self.lines[-30:])}")
            if line is None:
                pytest.fail(f"the job ended without a line matching {pattern!r}:\n{''.join(self.lines[-30:])}")
            self.lines.append(line)
            if re.search(pattern, line):
                return line

    def finish(self, seconds: float) -> int:
        """The exit code, once the job ended and all its output was read (fails after ``seconds``)."""
        try:
            self.wait_for(r"(?!)", seconds)  # matches nothing: reads to the end
        except pytest.fail.Exception as ended:
            if "ended without" not in str(ended):
                raise
        return self.proc.wait(timeout=5)

    def worker_pid(self, rank: int) -> int:
        """The pid of torchrun's worker with RANK=rank (its children carry the rank in their environment)."""
        children = open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()
        for pid in children:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return int(pid)
        raise AssertionError(f"no worker with RANK={rank} among {children}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def _loss(line: str) -> str:
    return re.search(r"lm loss: (\S+)", line).group(1)


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="finds torchrun's workers through /proc/<pid>/task/<pid>/children (Linux)")
@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])  # PipeDream resumes with microbatches in flight
def test_a_killed_rank_stops_the_job_and_the_same_command_resumes(tmp_path, tmp_path_factory, schedule):
    command = _command(str(tmp_path), session_cache(tmp_path_factory), schedule)
    job = Job(command)
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

    job = Job(command)
    try:
        job.wait_for(r"loaded checkpoint .*iter_0000004", RUN_SECONDS)
        again = job.wait_for(r"iteration\s+5/", RUN_SECONDS)
        assert _loss(again) == _loss(fifth)
        job.wait_for(r"iteration\s+8/", RUN_SECONDS)
        assert job.finish(RUN_SECONDS) == 0
    finally:
        job.close()
