"""Commands launched as users launch them (torchrun on one host, or one torchrun per test host),
their output lines read with deadlines, and their process groups killed at the end."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from megapipe.cluster.worker.process_tree import process_groups, signal_groups
from megapipe.testing.forked import WORKER_PIDS, ForkedProcess, run_script
from megapipe.testing.hosts import inside_host

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RENDEZVOUS_PORT = 29500  # free in every fresh host: each has its own network namespace


def standalone(nproc: int, script_argv: list[str]) -> list[str]:
    """torchrun on this host alone."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *script_argv]


def on_host(hosts, node: int, nproc: int, script_argv: list[str], run_id: str = "megapipe") -> list[str]:
    """The multi-node torchrun of docs/parallelism.md for node ``node`` of ``hosts``, run inside that host.

    ``--local-addr`` gives the node its own address (all hosts share one hostname) and the first
    node is told that it hosts the rendezvous store (``is_host=1``)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node",
               str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{RENDEZVOUS_PORT}",
               "--rdzv-id", run_id, "--local-addr", hosts[node].address]
    if node == 0:
        command += ["--rdzv-conf", "is_host=1"]
    return hosts.command(node, command + script_argv)


def kill_tree(pid: int) -> None:
    """SIGKILL to ``pid`` and to every process group of its tree: torchrun's workers each have a session of their
    own, so killing torchrun's group alone would leave them running. This process's own group is never signalled
    (a forked script shares it until it has made its session)."""
    groups = [group for group in process_groups(pid) if group != os.getpgrp()]
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    signal_groups(groups, signal.SIGKILL)


def forked_run(argv: list[str], cwd: str, env: dict, timeout: float, **_) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, cwd=, env=, capture_output=True, text=True, timeout=)`` for ``argv`` = [python, ...],
    forked from the server that has imported torch (torchrun's workers too)."""
    return run_script(argv[1:], env, cwd, timeout)


class Job:
    """Launched commands (one per host, or one) whose output lines, merged, are read with deadlines;
    each is killed with its workers on ``close``. With ``forked``, each command ``[python, script, *args]``
    (or ``[python, -m, module, *args]``: torchrun; either behind ``ip netns exec HOST``, as ``on_host`` makes
    it) runs in a process forked from a server that has imported torch (``megapipe.testing.forked``; inside
    that host), which starts in a fraction of a second instead of seconds, and so do torchrun's workers
    unless ``fresh_workers`` asks for new interpreters."""

    def __init__(self, *commands: list[str], forked: bool = False, fresh_workers: bool = False):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self._worker_pids = None
        if forked:
            if not fresh_workers:
                self._worker_pids = env[WORKER_PIDS] = tempfile.mkdtemp(prefix="megapipe-workers-")
            self.procs = [ForkedProcess(command[1:], env, REPO, fork_workers=not fresh_workers, namespace=namespace)
                          for namespace, command in map(inside_host, commands)]
        else:
            self.procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                           env=env, cwd=REPO, start_new_session=True) for command in commands]
        self.proc = self.procs[0]
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._open = len(self.procs)
        for proc in self.procs:
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
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
                self._open -= 1
                if self._open == 0:
                    pytest.fail(f"the job ended without a line matching {pattern!r}:\n{''.join(self.lines[-30:])}")
                continue
            self.lines.append(line)
            if re.search(pattern, line):
                return line

    def wait_for_each(self, patterns: list[str], seconds: float) -> None:
        """Read new lines until each of ``patterns`` has matched one, in any order (fails after ``seconds``)."""
        deadline, left = time.monotonic() + seconds, list(patterns)
        while left:
            line = self.wait_for("|".join(f"(?:{p})" for p in left), max(0.0, deadline - time.monotonic()))
            left = [p for p in left if not re.search(p, line)]

    def finish(self, seconds: float) -> int:
        """The first non-zero exit code (0 if none), once every command ended and all output was read
        (fails after ``seconds``)."""
        try:
            self.wait_for(r"(?!)", seconds)  # matches nothing: reads to the end
        except pytest.fail.Exception as ended:
            if "ended without" not in str(ended):
                raise
        codes = [proc.wait(timeout=5) for proc in self.procs]
        return next((code for code in codes if code), 0)

    def worker_pid(self, rank: int) -> int:
        """The pid of torchrun's worker with RANK=rank (its children carry the rank in their environment; forked
        workers are listed by rank in a folder of their own)."""
        if self._worker_pids is not None:
            return int(open(os.path.join(self._worker_pids, str(rank))).read())
        children = open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()
        for pid in children:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return int(pid)
        raise AssertionError(f"no worker with RANK={rank} among {children}")

    def output(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait(timeout=10)
        if self._worker_pids is not None:  # forked workers are not in torchrun's tree: killed by pid
            for name in os.listdir(self._worker_pids):
                if not name.endswith(".tmp"):  # a pid being written (atomic_files' temporary names)
                    kill_tree(self.worker_pid(int(name)))
            shutil.rmtree(self._worker_pids, ignore_errors=True)
            self._worker_pids = None  # closed: a second close has nothing to do


def losses(lines: list[str]) -> dict[int, str]:
    """Iteration -> the logged ``lm loss`` (all printed digits) of every training line."""
    found = {}
    for line in lines:
        match = re.search(r"iteration\s+(\d+)/.*?lm loss: (\S+)", line)
        if match:
            found[int(match.group(1))] = match.group(2)
    return found
