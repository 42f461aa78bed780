"""A worker agent: one per host, it declares the host's accelerators and runs the ranks placed there.

It registers with the scheduler, then sends a heartbeat every ``HEARTBEAT_SECONDS`` with the
exit codes of the ranks it started, and gets back the launches and stops for its host (the
scheduler side is ``backends/agents.py``). A launch runs ``torchrun`` with one node rank for
this host, as many processes as devices given, the job's output appended to its log; it is
started as every backend starts it (``backends/torchrun.py``), so a stop's SIGTERM lets the
workers save for as long as the save takes (up to the stop's grace period) and exit 0.

A restarted agent reports the ranks its killed predecessor left running as running until they
end (``orphans.py``), so the scheduler does not launch a second run of their job meanwhile.

CPU devices: every rank gets one thread. A type declared with a throttle (``--throttle
slow:0.5``) gets that fraction of a CPU per device: ``throttle.py`` suspends and resumes the
job's process tree with that duty cycle, a CPU quota that needs no cgroup privileges, so slow
devices are really slower and their speed is measured, not assumed.

Hosts: on one machine several agents with different ``--host`` names stand for several hosts
(they share the loopback address); with network namespaces each agent runs in its own
namespace and passes that namespace's ``--address``.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from megapipe.cluster.core.cluster_spec import devices_text
from megapipe.cluster.worker.torchrun import node_shell_command
from megapipe.lease.client import post_json, scheduler_url
from megapipe.cluster.worker.orphans import AGENT, agent_identity, any_alive, orphaned_jobs
from megapipe.cluster.worker.process_tree import signal_tree
from megapipe.errors import ConfigError

HEARTBEAT_SECONDS = 0.3
ORPHAN_ENDED = -1000  # the exit code reported for an adopted job's ranks (``orphans.py``): unknown, not 0
ROOT = Path(__file__).resolve().parents[3]  # the checkout holding pretrain_gpt.py


def parse_devices(text: str) -> dict:
    """``fast:2,slow:2`` -> {"fast": 2, "slow": 2}."""
    devices = {}
    for part in text.split(","):
        name, _, count = part.strip().partition(":")
        if not name or not count.isdigit() or int(count) < 1 or name in devices:
            raise ConfigError(f"--devices entry {part!r} is not TYPE:N with N at least 1 (each type once); write e.g. "
                              "fast:2,slow:2.")
        devices[name] = int(count)
    return devices


def parse_throttle(text: str, devices: dict) -> dict:
    """``slow:0.5`` -> {"slow": 0.5}: the CPU fraction each device of the type gets."""
    throttle = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, _, value = part.partition(":")
        try:
            fraction = float(value)
        except ValueError:
            fraction = -1.0
        if name not in devices or not 0 < fraction <= 1:
            raise ConfigError(f"--throttle entry {part!r} must be TYPE:FRACTION with a type of --devices and 0 < "
                              "FRACTION <= 1; write e.g. slow:0.5.")
        throttle[name] = fraction
    return throttle


class JobProcess:
    """The torchrun of one job on this host, in a session of its own (its workers each in theirs)."""

    def __init__(self, launch: dict, throttle: float):
        slot = next(s for s in launch["hosts"] if s["host"] == launch["host"])
        endpoint = f"{launch['master_addr']}:{launch['master_port']}"
        command = ["bash", "-c", node_shell_command(
            sys.executable, len(launch["hosts"]), slot["devices"], str(launch["node_rank"]), shlex.quote(endpoint),
            shlex.quote(f"megapipe-{launch['job_id']}-{launch['master_port']}"), launch["command"])]
        env = {**os.environ, **launch["env"], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        Path(launch["log_path"]).parent.mkdir(parents=True, exist_ok=True)
        with open(launch["log_path"], "a") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                            start_new_session=True)
        self.throttler = None
        if throttle < 1:
            self.throttler = subprocess.Popen([sys.executable, "-m", "megapipe.cluster.worker.throttle", str(self.process.pid),
                                               str(throttle)], env=env, cwd=str(ROOT), start_new_session=True)

    def _signal(self, sig: int) -> None:
        signal_tree(self.process.pid, sig)  # torchrun's group and each worker's (``process_tree.py``)

    def stop(self, grace_seconds: float) -> None:
        """SIGTERM to every process of the job (the training loop saves and exits 0; torchrun ignores it and
        exits 0 after its workers, ``backends/torchrun.py``), SIGKILL after ``grace_seconds``."""
        if self.throttler is not None:
            self.throttler.terminate()  # it resumes the job for good
            self.throttler.wait()
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        self._signal(signal.SIGKILL)

    def exit_code(self):
        return self.process.poll()


class WorkerAgent:
    def __init__(self, scheduler: str, host: str, address: str, devices: dict, throttle: dict, announce=None,
                 key: Optional[bytes] = None):
        """``announce``: where the agent says what happens, one line per event (registered, the scheduler
        lost and back, each job's ranks started, stopped and ended); silent when None. ``key``: the
        cluster's secret, which signs every request (``megapipe/lease/auth.py``)."""
        self.url, self.host, self.address, self.key = scheduler_url(scheduler), host, address, key
        self.devices, self.throttle = devices, throttle
        self.announce = announce or (lambda line: None)
        self.jobs: dict[int, JobProcess] = {}
        self.orphans: dict[int, list[int]] = {}  # job id -> pids a previous agent of this host started
        self.stopping = False
        self.unreachable = False  # the last call found no scheduler (said once, until it answers again)

    def register(self) -> None:
        answer = post_json(f"{self.url}/workers", {"host": self.host, "address": self.address,
                                                   "devices": self.devices, "throttle": self.throttle}, timeout=10,
                           key=self.key)
        if "error" in answer:
            raise ConfigError(answer["error"])
        self.announce(f"worker {self.host} registered with the scheduler at {self.url}: {devices_text(self.devices)}")

    def run(self) -> None:
        """Heartbeat until stopped; a scheduler that is down is waited for, one that forgot us is re-joined."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        self.orphans = orphaned_jobs(agent_identity(self.host, self.url))
        if self.orphans:
            self.announce(f"ranks of jobs {', '.join(map(str, sorted(self.orphans)))} that a previous agent of "
                          f"{self.host} started still run; reported as running until they end")
        self._call(self.register)
        while not self.stopping:
            running = {str(j): p.exit_code() for j, p in self.jobs.items()}
            for job_id, pids in self.orphans.items():  # their exit codes are unknown: ended, not 0
                running.setdefault(str(job_id), None if any_alive(pids) else ORPHAN_ENDED)
            try:
                answer = post_json(f"{self.url}/workers/{self.host}/heartbeat", {"running": running}, timeout=10,
                                   key=self.key)
            except OSError:
                self._lost_scheduler()
                continue
            self._found_scheduler()
            if "error" in answer:
                self._call(self.register)
                continue
            for job_id, code in running.items():
                if code is not None and int(job_id) in self.orphans:
                    del self.orphans[int(job_id)]
                    self.announce(f"job {job_id}: the ranks a previous agent started here have ended")
                elif code is not None:
                    del self.jobs[int(job_id)]  # its exit code went out with this heartbeat
                    self.announce(f"job {job_id}: its ranks here ended with exit code {code}")
            for message in answer["messages"]:
                self._handle(message)
            time.sleep(HEARTBEAT_SECONDS)
        if self.jobs:
            self.announce(f"worker {self.host} stopping; its jobs first: {', '.join(map(str, sorted(self.jobs)))}")
        for process in self.jobs.values():
            process.stop(10.0)

    def _call(self, function) -> None:
        while not self.stopping:
            try:
                function()
            except OSError:
                self._lost_scheduler()
                continue
            self._found_scheduler()
            return

    def _lost_scheduler(self) -> None:
        if not self.unreachable:
            self.announce(f"no scheduler answers at {self.url}; trying again every second")
        self.unreachable = True
        time.sleep(1.0)

    def _found_scheduler(self) -> None:
        if self.unreachable:
            self.announce(f"the scheduler at {self.url} answers again")
        self.unreachable = False

    def _handle(self, message: dict) -> None:
        if "launch" in message:
            launch = dict(message["launch"], host=self.host)
            launch["env"] = {**launch["env"], AGENT: agent_identity(self.host, self.url)}  # found again by a restart
            slot = next(s for s in launch["hosts"] if s["host"] == self.host)
            self.jobs[launch["job_id"]] = JobProcess(launch, self.throttle.get(slot["worker_type"], 1.0))
            self.announce(f"job {launch['job_id']}: started {slot['devices']} rank{'s' if slot['devices'] > 1 else ''} "
                          f"on {slot['worker_type']} (node {launch['node_rank']} of {len(launch['hosts'])}), "
                          f"output in {launch['log_path']}")
        elif "stop" in message:
            job_id, grace = message["stop"]["job_id"], message["stop"]["grace_seconds"]
            process = self.jobs.get(job_id)
            if process is not None:
                self.announce(f"job {job_id}: stopping (SIGTERM; the job saves and exits, SIGKILL after {grace:g} s)")
                threading.Thread(target=process.stop, args=(grace,), daemon=True).start()
