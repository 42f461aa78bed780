"""A job stopped by a worker agent saves completely, however long its save takes, and exits 0.

The agent stops a job with SIGTERM to every process group of its tree (torchrun's, and each
worker's: torchrun starts them in sessions of their own). It starts torchrun as the Slurm
backend does (``backends/torchrun.py``: SIGTERM ignored, not in torchrun's
``--signals-to-handle``), so torchrun neither forwards the signal nor kills its workers when its
shutdown timeout is over (30 s; where torch reads ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` the test
sets it to 3 s, so as not to wait 30 s). The job here (two ranks, data parallel, through the
agent's own ``JobProcess``) takes 7 s longer than that timeout to save, on purpose
(``slow_save_gpt.py``: a wait before megapipe's save, test only): it must still write the
checkpoint of the iteration it stopped at, and every process must exit 0. A torchrun that
handled SIGTERM would have killed the saving workers at its timeout and exited with an error,
leaving no checkpoint.
"""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megapipe.checkpointing.paths import read_latest
from megapipe.cluster.worker.agent import JobProcess
from megapipe.cluster.worker.orphans import agent_identity, any_alive, orphaned_jobs
from megapipe.cluster.service.local_cluster import free_port
from megapipe.cluster.worker.process_tree import process_groups, signal_tree

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "64",
         "--train-iters", "100000", "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1"]


def _torchrun_shutdown_seconds() -> int:
    """How long torchrun lets its workers end after a SIGTERM it handles: 3 s where its launcher reads
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (the test sets it), else its fixed 30 s."""
    from torch.distributed.launcher.api import LaunchConfig

    return 3 if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else 30


SHUTDOWN_SECONDS = _torchrun_shutdown_seconds()
SAVE_SECONDS = SHUTDOWN_SECONDS + 7  # longer than torchrun allows its workers after a SIGTERM it handles


def test_a_job_stopped_by_its_agent_finishes_a_long_save_and_exits_0(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOW_SAVE_SECONDS", str(SAVE_SECONDS))
    checkpoints, log = str(tmp_path / "checkpoints"), tmp_path / "job.log"
    command = ["tests/slow_save_gpt.py", *MODEL, "--save", checkpoints, "--load", checkpoints]
    launch = {"job_id": 0, "command": command, "hosts": [{"host": "here", "worker_type": "fast", "devices": 2}],
              "host": "here", "node_rank": 0, "master_addr": "127.0.0.1", "master_port": free_port(),
              "env": {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_SECONDS)},
              "log_path": str(log)}
    job = JobProcess(launch, throttle=1.0)
    try:
        deadline = time.monotonic() + 180
        while not re.search(r"^ iteration\s+3/", log.read_text(), re.M):
            assert job.exit_code() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        stopped = time.monotonic()
        job.stop(grace_seconds=180)  # SIGTERM to the group, SIGKILL only after the grace period
        took = time.monotonic() - stopped
    finally:
        job.stop(grace_seconds=0)
    output = log.read_text()
    assert job.exit_code() == 0, output[-3000:]
    iteration = int(re.search(r"exiting on SIGTERM at iteration (\d+)", output)[1])
    assert f"[test-only slow save] waiting {SAVE_SECONDS} s before saving iteration {iteration}" in output
    assert took >= SAVE_SECONDS  # the save really outlasted torchrun's shutdown timeout
    assert read_latest(checkpoints) == iteration  # published only once every shard is written


def test_the_process_tree_holds_every_workers_group(tmp_path):
    """torchrun starts each worker in a session of its own: the groups of the whole tree are found and signalled."""
    child_code = ("import signal, sys, time\n"
                  "signal.signal(signal.SIGTERM, lambda *_: (print('child: SIGTERM', flush=True), sys.exit(0)))\n"
                  "import os; print(os.getpid(), flush=True)\ntime.sleep(600)\n")  # its pid once it is ready
    script = ("import subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}], start_new_session=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        assert process_groups(parent.pid) == [parent.pid, child]  # each leads its own group
        signal_tree(parent.pid, signal.SIGTERM)
        assert parent.wait(timeout=30) == -signal.SIGTERM
        assert parent.stdout.readline() == "child: SIGTERM\n"  # the child, in its own group, got it too
    finally:
        signal_tree(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)


def test_a_restarted_agent_finds_the_ranks_its_previous_incarnation_started():
    """Found by the agent and job their environment names, reported alive until they end (``orphans.py``)."""
    identity = agent_identity("host-a", f"http://127.0.0.1:{free_port()}")
    env = dict(os.environ, MEGAPIPE_CLUSTER_AGENT=identity, MEGAPIPE_CLUSTER_JOB="7")
    rank = subprocess.Popen([sys.executable, "-c", "import signal; print('started', flush=True); signal.pause()"],
                            env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:  # Popen returns once the exec began, before /proc shows the new environment: wait for its first line
        assert rank.stdout.readline() == "started\n"
        found = orphaned_jobs(identity)
        assert found == {7: [rank.pid]} and any_alive(found[7])
        assert orphaned_jobs(agent_identity("host-b", "http://127.0.0.1:1")) == {}
    finally:
        rank.kill()
        rank.wait(timeout=30)
    assert not any_alive(found[7])
