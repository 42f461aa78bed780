"""A real Slurm cluster on one machine, for tests and trials: slurmctld and one slurmd per node.

Debian's ``slurm-wlm`` runs several ``slurmd`` on one host when each node has its own name
(``slurmd -N NAME``), port, spool directory and pid file; all nodes share the address 127.0.0.1.
Every node declares its accelerators as typed GPU GRES (``Gres=gpu:fast:2,gpu:slow:2``), backed
by device files that are links to ``/dev/null``: Slurm schedules and binds them (it sets
``CUDA_VISIBLE_DEVICES``), the processes run on the CPU. Authentication is a private ``munged``
(its own key and socket), so the testbed touches no system service. Everything lives in one
directory, except what holds Unix sockets (munged's, and the one slurmstepd makes per job step in
a node's spool directory): a socket's path has at most 107 bytes, which a deep test directory
exceeds (a step that cannot make its socket never starts), so those live in a short private folder
under the system's temporary directory. Every port is picked free, and ``close`` (or leaving the
``with`` block, also on an error) cancels the jobs, stops the daemons it started and removes that folder.

    with SlurmTestbed(tmp_dir, {"node1": {"fast": 2, "slow": 2}, "node2": {"fast": 2, "slow": 2}}) as slurm:
        subprocess.run(["sinfo"], env=slurm.env)   # SLURM_CONF points at the testbed's slurm.conf

``python -m megapipe.cluster.service.backends.slurm_testbed DIR`` starts one and holds it until Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

from megapipe.errors import UserError, reports_user_errors

DAEMONS = ("munged", "slurmctld", "slurmd")
START_SECONDS = 60


class SlurmUnavailable(UserError, RuntimeError):
    """Slurm cannot run here; the message says why (tests skip with it)."""


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def unavailable_reason() -> Optional[str]:
    """Why a testbed cannot start on this machine, or None."""
    missing = [name for name in DAEMONS + ("sbatch",) if shutil.which(name) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found); install Debian's slurm-wlm and munge "
                "(.ci/run does).")
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs, and this process is not root."
    return None


class SlurmTestbed:
    """slurmctld plus one slurmd per node, configured in ``directory``; ``nodes`` maps a node name
    to its accelerators by type, e.g. ``{"node1": {"fast": 2, "slow": 2}}``."""

    def __init__(self, directory: str, nodes: dict[str, dict[str, int]], cpus_per_node: int = 8,
                 partition: str = "gavel"):
        reason = unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        self.directory = os.path.abspath(directory)
        self.nodes, self.partition = nodes, partition
        self.conf = os.path.join(self.directory, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self._daemons: list[subprocess.Popen] = []
        self._cpus = cpus_per_node
        self._sockets = tempfile.mkdtemp(prefix="megapipe-slurm-")  # munged's socket, the spool directories
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "SlurmTestbed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- start ----------------------------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return os.path.join(self.directory, *parts)

    def _start(self) -> None:
        for sub in ("state", "log", "munge", "dev"):
            os.makedirs(self._path(sub), exist_ok=True)
        for node in self.nodes:
            os.makedirs(os.path.join(self._sockets, node))
        os.chmod(self._path("munge"), 0o700)
        key = self._path("munge", "munge.key")
        with open(key, "wb") as out:
            out.write(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = os.path.join(self._sockets, "munge.socket")
        self._spawn(["munged", "--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
                     f"--log-file={self._path('log', 'munged.log')}", f"--pid-file={self._path('munge', 'pid')}",
                     f"--seed-file={self._path('munge', 'seed')}"])
        self._wait_for(lambda: os.path.exists(socket_path), "munged did not create its socket",
                       self._path("log", "munged.log"))
        self._write_config(socket_path)
        self._spawn(["slurmctld", "-D", "-f", self.conf])
        for name in self.nodes:
            self._spawn(["slurmd", "-D", "-f", self.conf, "-N", name])
        self._wait_for(self._all_idle, f"the nodes of {self.conf} did not all become idle",
                       self._path("log", "slurmctld.log"))

    def _write_config(self, munge_socket: str) -> None:
        types = sorted({t for devices in self.nodes.values() for t in devices})
        lines = [
            "ClusterName=megapipe",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge_socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={self._path('state')}",
            f"SlurmdSpoolDir={os.path.join(self._sockets, '%n')}",
            f"SlurmctldPidFile={self._path('slurmctld.pid')}", f"SlurmdPidFile={self._path('slurmd-%n.pid')}",
            f"SlurmctldLogFile={self._path('log', 'slurmctld.log')}",
            f"SlurmdLogFile={self._path('log', 'slurmd-%n.log')}",
            # no cgroups: processes are tracked by their parentage and signalled as a tree
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "SwitchType=switch/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            # the declared CPUs, not the machine's, so that several nodes share its cores
            "SlurmdParameters=config_overrides",
            # heterogeneous jobs start from the backfill scheduler only: run it every second
            "SchedulerParameters=bf_interval=1",
            "ReturnToService=2", "KillWait=5", "InactiveLimit=0", "MinJobAge=600",
            "GresTypes=gpu",
        ]
        gres = []
        for name, devices in self.nodes.items():
            declared = ",".join(f"gpu:{t}:{n}" for t, n in devices.items())
            lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
                         f"CPUs={self._cpus} Gres={declared} State=UNKNOWN")
            index = 0
            for worker_type in types:
                count = devices.get(worker_type, 0)
                if not count:
                    continue
                files = [self._path("dev", f"{name}-gpu{index + i}") for i in range(count)]
                for path in files:
                    if not os.path.lexists(path):
                        os.symlink(os.devnull, path)  # Slurm wants a device file: /dev/null is one
                gres.append(f"NodeName={name} Name=gpu Type={worker_type} File={','.join(files)}")
                index += count
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
                     "State=UP")
        with open(self.conf, "w") as out:
            out.write("\n".join(lines) + "\n")
        with open(self._path("gres.conf"), "w") as out:
            out.write("\n".join(gres) + "\n")

    def _spawn(self, command: list[str]) -> None:
        log = open(self._path("log", f"{os.path.basename(command[0])}.out"), "ab")
        self._daemons.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                              start_new_session=True))
        log.close()

    def _all_idle(self) -> bool:
        states = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False).stdout.split()
        return sorted(states[0::2]) == sorted(self.nodes) and set(states[1::2]) == {"idle"}

    def _wait_for(self, ready, what: str, log: str) -> None:
        deadline = time.monotonic() + START_SECONDS
        while not ready():
            dead = [d.args[0] for d in self._daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                cause = f"{', '.join(dead)} exited" if dead else f"waited {START_SECONDS} s"
                raise SlurmUnavailable(f"{what} ({cause}); last lines of {log}: {_tail(log)}")
            time.sleep(0.2)

    # ---- use and stop ---------------------------------------------------------------------------
    def run(self, command: list[str], check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this testbed."""
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30, check=check)

    def close(self) -> None:
        """Cancel every job, wait for the nodes to clean up, stop the daemons started here."""
        if any(d.args[0] == "slurmctld" and d.poll() is None for d in self._daemons):
            try:  # the nodes kill what runs there, while the controller can tell them
                self._cancel_all()
            except subprocess.TimeoutExpired:
                pass  # a controller that does not answer: stop the daemons all the same
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=5)
        self._daemons.clear()
        shutil.rmtree(self._sockets, ignore_errors=True)

    def _cancel_all(self) -> None:
        self.run(["scancel", "--full", "--signal=KILL", f"--partition={self.partition}"], check=False)
        self.run(["scancel", f"--partition={self.partition}"], check=False)
        deadline = time.monotonic() + 30
        while self.run(["squeue", "--noheader"], check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.2)


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as log:
            return " | ".join(line.strip() for line in log.readlines()[-lines:])
    except OSError:
        return "(no log)"


@reports_user_errors
def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.exit("usage: python -m megapipe.cluster.service.backends.slurm_testbed DIR")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # sigwait takes them
    nodes = {"node1": {"fast": 2, "slow": 2}, "node2": {"fast": 2, "slow": 2}}
    with SlurmTestbed(argv[0], nodes) as testbed:
        print(f"Slurm is up: export SLURM_CONF={testbed.conf}  (Ctrl-C stops it)", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
