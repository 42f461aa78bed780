"""Commands launched as users launch them (torchrun on one host, or one torchrun per test host),
their output lines read with deadlines, and their process groups killed at the end."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RENDEZVOUS_PORT = 29500  # free in every fresh host: each has its own network namespace


def standalone(nproc: int, script_argv: list[str]) -> list[str]:
    """torchrun on this host alone."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *script_argv]


def on_host(hosts, node: int, nproc: int, script_argv: list[str], run_id: str = "megapipe") -> list[str]:
    """The README's multi-node torchrun for node ``node`` of ``hosts``, run inside that host.

    ``--local-addr`` gives the node its own address (all hosts share one hostname) and the first
    node is told that it hosts the rendezvous store (``is_host=1``)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node",
               str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{RENDEZVOUS_PORT}",
               "--rdzv-id", run_id, "--local-addr", hosts[node].address]
    if node == 0:
        command += ["--rdzv-conf", "is_host=1"]
    return hosts.command(node, command + script_argv)


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

    def output(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def losses(lines: list[str]) -> dict[int, str]:
    """Iteration -> the logged ``lm loss`` (all printed digits) of every training line."""
    found = {}
    for line in lines:
        match = re.search(r"iteration\s+(\d+)/.*?lm loss: (\S+)", line)
        if match:
            found[int(match.group(1))] = match.group(2)
    return found
