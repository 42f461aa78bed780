"""A scheduler service and its worker agents as local processes, for tests and benchmarks.

``LocalCluster`` starts ``tools/cluster.py serve`` and one ``tools/cluster.py worker`` per
host name, each in its own process group, and stops every one of them on ``close`` (agents
stop their jobs first). Hosts are agents with different ``--host`` names on the loopback
address, or, given ``test_hosts`` (``megapipe/testing/hosts.py``), real hosts: each agent runs
inside its own network namespace with that host's ``--address``, so its jobs' ranks live there
and reach ranks on the other host over the bridge; the scheduler listens on the bridge's address
(the gateway every host reaches), where agents, jobs' leases and this class's requests find it.
Every party signs its requests with the secret in ``WORK_DIR/secret`` (``megapipe/lease/auth.py``);
jobs may name paths under ``files`` (the service's default root).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from megapipe.lease.auth import create_secret_file, page_token
from megapipe.lease.client import get_json, post_json

ROOT = Path(__file__).resolve().parents[3]
TOOL = str(ROOT / "tools" / "cluster.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self, work_dir: str, policy: str, round_seconds: float, hosts: dict, throttle: str = "slow:0.5",
                 extra_serve_flags: tuple = (), test_hosts=None):
        """``hosts``: host name -> devices (``fast:2,slow:2``), one agent each; none for a backend without
        agents (``extra_serve_flags`` such as ``--backend slurm``). ``test_hosts``: a ``TestHosts`` with
        at least as many hosts; the i-th agent runs inside its i-th host."""
        if test_hosts is not None and len(test_hosts) < len(hosts):
            raise ValueError(f"{len(hosts)} agents need as many test hosts; make TestHosts({len(hosts)}).")
        self.work_dir, self.policy, self.round_seconds = work_dir, policy, round_seconds
        self.hosts, self.throttle, self.extra = hosts, throttle, list(extra_serve_flags)
        self.test_hosts = test_hosts
        self.port = free_port()
        self.listen = "127.0.0.1" if test_hosts is None else test_hosts.gateway
        self.address = f"{self.listen}:{self.port}"
        self.journal = os.path.join(work_dir, "journal.db")
        self.files = os.path.join(work_dir, "journal-work", "files")  # serve's default root for jobs' paths
        self.secret_file = os.path.join(work_dir, "secret")
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.scheduler = None
        self.agents: dict[str, subprocess.Popen] = {}
        os.makedirs(work_dir, exist_ok=True)
        self.key = create_secret_file(self.secret_file)

    def _spawn(self, args: list[str], log_name: str, inside: Optional[int] = None) -> subprocess.Popen:
        """``tools/cluster.py ARGS`` in a session of its own, inside test host ``inside`` if given."""
        log = open(os.path.join(self.work_dir, log_name), "a")
        command = [sys.executable, TOOL, *args]
        if inside is not None:
            command = self.test_hosts.command(inside, command)  # ip netns exec: the same process, moved
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def start_scheduler(self) -> None:
        self.scheduler = self._spawn(["serve", "--port", str(self.port), "--host", self.listen, "--journal",
                                      self.journal, "--secret-file", self.secret_file, "--policy", self.policy,
                                      "--round-seconds", str(self.round_seconds), *self.extra], "scheduler.log")
        self.wait_for(lambda: self._answers(), 60, "the scheduler to answer")

    def start_agent(self, host: str) -> None:
        types = {entry.split(":")[0] for entry in self.hosts[host].split(",")}
        throttle = ",".join(entry for entry in self.throttle.split(",") if entry.split(":")[0] in types)
        args = ["worker", "--scheduler", self.address, "--secret-file", self.secret_file, "--devices",
                self.hosts[host], "--host", host, "--throttle", throttle]
        inside = None
        if self.test_hosts is not None:
            inside = list(self.hosts).index(host)
            args += ["--address", self.test_hosts[inside].address]
        self.agents[host] = self._spawn(args, f"agent-{host}.log", inside)

    def start(self) -> "LocalCluster":
        self.start_scheduler()
        for host in self.hosts:
            self.start_agent(host)
        if self.hosts:  # agents (with another backend, e.g. Slurm, the scheduler finds its nodes itself)
            self.wait_for(lambda: len(self.status()["workers"]) == len(self.hosts), 60, "every agent to register")
        return self

    def kill(self, process: subprocess.Popen, sig=signal.SIGKILL) -> None:
        """Signal one process we started (its group: the agent's jobs run in groups of their own)."""
        if process.poll() is None:
            os.killpg(process.pid, sig)
        process.wait(timeout=60)

    def close(self) -> None:
        for process in self.agents.values():  # agents first: they stop their jobs (SIGTERM, then SIGKILL)
            if process.poll() is None:
                self.kill(process, signal.SIGTERM)
        if self.scheduler is not None and self.scheduler.poll() is None:
            self.kill(self.scheduler, signal.SIGTERM)

    def _answers(self) -> bool:
        try:
            self.status()
            return True
        except OSError:
            return False

    def status(self) -> dict:
        status = get_json(f"http://{self.address}/status", 30, self.key)
        if "error" in status:
            raise RuntimeError(f"the scheduler refused GET /status: {status['error']}")
        return status

    def submit(self, name: str, command: list[str], priority: float = 1.0) -> dict:
        return post_json(f"http://{self.address}/jobs", {"name": name, "priority": priority, "command": command},
                         timeout=60, key=self.key)

    def page_url(self) -> str:
        """The status page's address, with its read-only token (what a browser opens)."""
        return f"http://{self.address}/?token={page_token(self.key)}"

    def job(self, job_id: int) -> dict:
        return next(j for j in self.status()["jobs"] if j["id"] == job_id)

    def wait_for(self, condition, timeout: float, what: str) -> None:
        """Poll ``condition`` (an observable state of the cluster) until it holds; TimeoutError names ``what``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if condition():
                    return
            except OSError:
                pass  # the scheduler is restarting
            time.sleep(0.5)
        raise TimeoutError(f"waited {timeout:.0f} s for {what}; the jobs then: {self._jobs_summary()}")

    def _jobs_summary(self) -> str:
        """Each job's name, state and iterations, or why the status could not be read."""
        try:
            return ", ".join(f"{j['name']} {j['state']} at {j['iterations']}" for j in self.status()["jobs"])
        except (OSError, RuntimeError) as error:
            return f"unknown ({error})"

    def __enter__(self):
        try:
            return self.start()
        except BaseException:  # what started must not outlive a failed start
            self.close()
            raise

    def __exit__(self, *exc):
        self.close()
