"""Gavel's Slurm backend: each round's placement of a job becomes one Slurm job.

``start`` submits a batch job (``sbatch``) that asks for exactly the placement's nodes and typed
GPU GRES and runs one task per node (``srun``): ``torchrun`` with that node's rank and device
count, all meeting at a rendezvous on the first node. Consecutive hosts with the same accelerator
type and count form one job component (``--nodes=K --nodelist=... --gres=gpu:TYPE:N``); a
placement with different counts per host becomes a heterogeneous job with one component per run of
equal hosts, since ``--gres`` counts per node. ``poll`` reads the job's state with
``scontrol show job``; ``stop`` sends SIGTERM to the job's tasks (``scancel --signal=TERM``), on
which the training loop saves a checkpoint at the next iteration boundary and exits with status 0,
and after the grace period kills what is left. Everything goes through Slurm's own commands, with
``SLURM_CONF`` set when a configuration path is given; any refusal is raised as one sentence
(``SlurmError``).

SIGTERM reaches every process of a task (Slurm signals the task's whole process tree), torchrun
included; the task starts torchrun as every backend does (``torchrun.py``: SIGTERM ignored and
not handled by torchrun), so the workers save and exit 0, and so does torchrun.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
from itertools import groupby
from pathlib import Path
from typing import Optional

from megapipe.cluster.service.backends.base import HostSlots, Launch
from megapipe.cluster.worker.torchrun import node_shell_command
from megapipe.errors import SlurmError

# Slurm job states after which nothing of the job runs any more (JOB_STATE_BASE of slurm.h, ended)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY"}
# pending reasons that waiting cannot cure: the partition is closed or the request cannot fit it
HOPELESS = ("PartitionDown", "PartitionInactive", "PartitionNodeLimit", "BadConstraints")
# pending reasons that name unavailable nodes: hopeless if one is down or drained, not if it only
# misses a heartbeat (a resumed node answers within a second)
NODES_UNAVAILABLE = ("ReqNodeNotAvail", "NodeDown")
# node states in which a node runs jobs now or once its current jobs end (sinfo %T, lower case)
USABLE = {"idle", "mixed", "allocated", "completing", "planned"}
ROOT = Path(__file__).resolve().parents[4]  # the checkout holding pretrain_gpt.py


def components(hosts: tuple[HostSlots, ...]) -> list[list[HostSlots]]:
    """Runs of consecutive hosts with the same accelerator type and count: one job component each."""
    return [list(run) for _, run in groupby(hosts, key=lambda h: (h.worker_type, h.devices))]


def batch_script(launch: Launch, python: str, partition: Optional[str], cpus_per_device: int) -> str:
    """The sbatch script that runs ``launch``: one ``#SBATCH`` line per component, one torchrun per node
    (what holds for the whole job, its name, log and directory, goes on sbatch's command line)."""
    if not launch.hosts:
        raise SlurmError(f"job {launch.job_id} has no hosts to run on; place it on at least one node.")
    parts = components(launch.hosts)
    lines = ["#!/bin/bash"]
    for index, part in enumerate(parts):
        if index:
            lines.append("#SBATCH hetjob")
        slots = part[0]
        lines.append(f"#SBATCH --nodes={len(part)} --nodelist={','.join(h.host for h in part)} "
                     f"--ntasks-per-node=1 --cpus-per-task={slots.devices * cpus_per_device} "
                     f"--gres=gpu:{slots.worker_type}:{slots.devices}"
                     + (f" --partition={partition}" if partition else ""))
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(launch.env.items())]
    lines += ["export PYTHONUNBUFFERED=1  # the log shows each line when it is printed",
              f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{cpus_per_device}}}  # each rank its CPUs' threads"]
    # the rendezvous: a free port on this node (the batch runs on the first node, node rank 0)
    lines += ['MEGAPIPE_RDZV_HOST=$(scontrol show node "$SLURMD_NODENAME" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")',
              f"MEGAPIPE_RDZV_PORT=$({shlex.quote(python)} -c "
              "'import socket; s = socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])')",
              'export MEGAPIPE_RDZV_ENDPOINT="$MEGAPIPE_RDZV_HOST:$MEGAPIPE_RDZV_PORT"',
              # keys of this job only in the rendezvous store, should a stray launcher reach its port
              'export MEGAPIPE_RDZV_ID="megapipe-$SLURM_JOB_ID"',
              # "[cluster]" marks the scheduler's lines in a job's log, apart from what the job prints
              f'echo "[cluster] Slurm job $SLURM_JOB_ID runs job {launch.job_id} on '
              f'{_describe(launch.hosts)}, rendezvous $MEGAPIPE_RDZV_ENDPOINT"']
    tasks = [_task(launch, part[0].devices, python) for part in parts]
    lines.append("srun --kill-on-bad-exit=1 " + " : ".join(tasks))
    return "\n".join(lines) + "\n"


def _task(launch: Launch, devices: int, python: str) -> str:
    """One node's task: torchrun with SIGTERM left to the workers (``torchrun.py``)."""
    return "bash -c " + shlex.quote(node_shell_command(python, len(launch.hosts), devices, '"$SLURM_NODEID"',
                                                       '"$MEGAPIPE_RDZV_ENDPOINT"', '"$MEGAPIPE_RDZV_ID"',
                                                       launch.command))


def _describe(hosts: tuple[HostSlots, ...]) -> str:
    return ", ".join(f"{h.host} ({h.worker_type} x{h.devices})" for h in hosts)


class SlurmBackend:
    """Runs each allocation of a job as one Slurm job; see the module docstring.

    ``partition``: the partition to submit to (Slurm's default when None). ``slurm_conf``: the
    ``slurm.conf`` of the cluster (the commands' default when None). ``workdir``: where the job's
    command runs, on a file system every node sees (this checkout when None). ``python``:
    the interpreter on the nodes. ``cpus_per_device``: CPUs asked for per device, for the data
    loader and the launcher. ``job_name_prefix``: the Slurm job of megapipe job 7 is named PREFIX-7.
    Thread-safe: the service's round loop and its HTTP handlers may call it at the same time.
    """

    def __init__(self, partition: Optional[str] = None, slurm_conf: Optional[str] = None,
                 workdir: Optional[str] = None, python: str = sys.executable, cpus_per_device: int = 1,
                 job_name_prefix: str = "megapipe", command_timeout: float = 30.0):
        self.partition, self.python, self.cpus_per_device = partition, python, cpus_per_device
        self.workdir = os.path.abspath(workdir or ROOT)
        self.job_name_prefix, self.command_timeout = job_name_prefix, command_timeout
        self.env = dict(os.environ, **({"SLURM_CONF": os.path.abspath(slurm_conf)} if slurm_conf else {}))
        self._slurm_ids: dict[int, str] = {}
        self._ended: dict[int, int] = {}
        self._launches: dict[int, Launch] = {}
        self._stopped: set[int] = set()  # jobs whose current allocation was ended by stop()
        self._lock = threading.RLock()

    # ---- the Backend contract -------------------------------------------------------------------
    def start(self, launch: Launch) -> None:
        """Submit the allocation; raises SlurmError if a node is unusable or Slurm refuses the job."""
        with self._lock:
            self._start(launch)

    def _start(self, launch: Launch) -> None:
        running = self._live_slurm_jobs().get(launch.job_id)
        if running is not None:
            raise SlurmError(f"job {launch.job_id} still runs as Slurm job {running}; stop it and wait until poll "
                             "reports its end before starting it again.")
        self._check_nodes(launch)
        script = batch_script(launch, self.python, self.partition, self.cpus_per_device)
        log_path = os.path.abspath(launch.log_path)
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        submit = ["sbatch", "--parsable", f"--job-name={self.job_name_prefix}-{launch.job_id}",
                  f"--output={log_path.replace('%', '%%')}", "--open-mode=append", f"--chdir={self.workdir}"]
        submitted = self._slurm(submit, stdin=script, check=False)
        if submitted.returncode != 0:
            raise SlurmError(f"Slurm refused job {launch.job_id} on {_describe(launch.hosts)}: "
                             f"{_last_line(submitted.stderr)}; place it on nodes, GRES types and a partition "
                             "that sinfo --Node --format='%N %P %G' lists.")
        self._slurm_ids[launch.job_id] = submitted.stdout.strip().split(";")[0]
        self._ended.pop(launch.job_id, None)
        self._stopped.discard(launch.job_id)
        self._launches[launch.job_id] = launch

    def poll(self, job_id: int) -> Optional[int]:
        """None while the job is pending or running, else its exit code (128 + N when killed by signal N)."""
        with self._lock:
            return self._poll(job_id)

    def _poll(self, job_id: int) -> Optional[int]:
        if job_id in self._ended:
            return self._ended[job_id]
        records = self._job_records(job_id)
        hopeless = self._hopeless(job_id, records)
        if hopeless:
            self._slurm(["scancel", self._slurm_id(job_id)], check=False)
            return self._end(job_id, 1, hopeless)
        if any(record["JobState"] not in ENDED for record in records):
            return None
        leader = records[0]  # the batch script runs in component 0; its status is the job's
        status, signal_number = (int(x) for x in leader["ExitCode"].split(":"))
        code = 128 + signal_number if signal_number else status
        if leader["JobState"] != "COMPLETED":
            code = code or 1
            if job_id in self._stopped:
                return self._end(job_id, code)
            return self._end(job_id, code, f"Slurm job {self._slurm_id(job_id)} ended {leader['JobState']} "
                                           f"({leader.get('Reason', 'None')}) with exit code {code}.")
        return self._end(job_id, code)

    def stop(self, job_id: int, grace_seconds: float) -> None:
        """SIGTERM to every task now, SIGKILL to what is left after ``grace_seconds`` (a timer thread).
        Returns at once; ``poll`` says when the job has ended and its nodes are free."""
        with self._lock:
            if self._poll(job_id) is not None:
                return
            slurm_id = self._slurm_id(job_id)
            self._stopped.add(job_id)
            if all(record["JobState"] == "PENDING" for record in self._job_records(job_id)):
                self._slurm(["scancel", slurm_id], check=False)  # nothing runs yet: nothing to save
                return
            self._slurm(["scancel", "--signal=TERM", slurm_id], check=False)  # the tasks, not the batch shell
        killer = threading.Timer(grace_seconds, self._kill, args=(job_id, slurm_id))
        killer.daemon = True
        killer.start()

    def _kill(self, job_id: int, slurm_id: str) -> None:
        """The end of a stop's grace period: SIGKILL to all of the job that still runs, then cancel it."""
        with self._lock:
            if self._slurm_ids.get(job_id) != slurm_id or self._poll(job_id) is not None:
                return  # it ended in time (and may run again by now under another Slurm job)
            self._slurm(["scancel", "--full", "--signal=KILL", slurm_id], check=False)
            self._slurm(["scancel", slurm_id], check=False)

    def running_job_ids(self) -> set[int]:
        """The jobs with a Slurm job pending or running under this backend's name prefix, those an
        earlier instance started included (a restarted scheduler must not start them twice)."""
        with self._lock:
            return set(self._live_slurm_jobs())

    def nodes(self) -> dict[str, dict[str, int]]:
        """The partition's nodes and their GPU GRES by type, e.g. {"node1": {"fast": 2, "slow": 2}}:
        the workers a scheduler may place jobs on."""
        command = ["sinfo", "--noheader", "--Node", "--format=%N %G"]
        listed = self._slurm(command + ([f"--partition={self.partition}"] if self.partition else []))
        nodes: dict[str, dict[str, int]] = {}
        for line in listed.stdout.splitlines():
            name, _, gres = line.strip().partition(" ")
            devices = nodes.setdefault(name, {})
            for entry in gres.split(","):  # gpu:fast:2(S:0) -> type fast, 2 devices
                parts = entry.split("(")[0].split(":")
                if parts[0] == "gpu" and len(parts) == 3:
                    devices[parts[1]] = int(parts[2])
        return nodes

    # ---- Slurm commands -------------------------------------------------------------------------
    def _slurm(self, command: list[str], stdin: Optional[str] = None, check: bool = True):
        try:
            result = subprocess.run(command, input=stdin, capture_output=True, text=True, env=self.env,
                                    timeout=self.command_timeout)
        except FileNotFoundError:
            raise SlurmError(f"{command[0]} is not installed here; the Slurm backend needs Slurm's client "
                             "commands (Debian: slurm-client).") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{command[0]} got no answer from slurmctld within {self.command_timeout:g} s; "
                             "check that slurmctld runs (scontrol ping).") from None
        if check and result.returncode != 0:
            raise SlurmError(f"{shlex.join(command)} failed: {_last_line(result.stderr)}")
        return result

    def _check_nodes(self, launch: Launch) -> None:
        names = [h.host for h in launch.hosts]
        listed = self._slurm(["sinfo", "--noheader", "--Node", f"--nodes={','.join(names)}", "--format=%N %T"])
        states = dict(line.split() for line in listed.stdout.splitlines() if line.strip())
        for name in names:
            if name not in states:
                raise SlurmError(f"Slurm has no node named {name} (job {launch.job_id}); declare the host by its "
                                 "Slurm node name (sinfo --Node lists them).")
            # a trailing flag (* not responding, ~ powered off, ...) passes: Slurm itself decides what waits
            if states[name].rstrip("*~#!%$@^-+").lower() not in USABLE:
                raise SlurmError(f"Slurm node {name} is {states[name]} and cannot run job {launch.job_id}; "
                                 f"resume it (scontrol update nodename={name} state=resume) or place the job "
                                 "elsewhere.")

    def _hopeless(self, job_id: int, records: list[dict[str, str]]) -> Optional[str]:
        """Why a pending job cannot start as placed, or None while waiting may start it."""
        for record in records:
            reason = record.get("Reason", "")
            if record["JobState"] != "PENDING":
                continue
            if reason.startswith(HOPELESS):
                return (f"Slurm cannot start job {job_id} as placed ({reason}); open the partition or place the "
                        "job elsewhere.")
            if reason.startswith(NODES_UNAVAILABLE) and job_id in self._launches:
                try:
                    self._check_nodes(self._launches[job_id])
                except SlurmError as error:
                    return str(error)
        return None

    def _live_slurm_jobs(self) -> dict[int, str]:
        """Job id -> Slurm job id of every pending or running Slurm job named PREFIX-ID."""
        command = ["squeue", "--noheader", "--format=%i %j"]
        listed = self._slurm(command + ([f"--partition={self.partition}"] if self.partition else []))
        live = {}
        for line in listed.stdout.splitlines():
            slurm_id, _, name = line.strip().partition(" ")
            prefix, _, job_id = name.rpartition("-")
            if prefix == self.job_name_prefix and job_id.isdigit():
                live[int(job_id)] = slurm_id.split("+")[0]  # a heterogeneous job's components: 7+0, 7+1
        return live

    def _slurm_id(self, job_id: int) -> str:
        if job_id not in self._slurm_ids:  # started by an earlier instance, maybe: adopt it
            self._slurm_ids.update({j: s for j, s in self._live_slurm_jobs().items() if j not in self._slurm_ids})
        if job_id not in self._slurm_ids:
            raise SlurmError(f"job {job_id} has no Slurm job named {self.job_name_prefix}-{job_id} pending or "
                             "running; start it before polling or stopping it.")
        return self._slurm_ids[job_id]

    def _job_records(self, job_id: int) -> list[dict[str, str]]:
        """``scontrol show job`` of the job: one record per component, the leader first."""
        slurm_id = self._slurm_id(job_id)
        shown = self._slurm(["scontrol", "--oneliner", "show", "job", slurm_id], check=False)
        if shown.returncode != 0:
            raise SlurmError(f"Slurm no longer knows job {slurm_id} (job {job_id}): "
                             f"{_last_line(shown.stderr)}; poll more often than the cluster's MinJobAge.")
        records = [_fields(line) for line in shown.stdout.splitlines() if line.strip()]
        return sorted(records, key=lambda r: int(r.get("HetJobOffset", 0)))

    def _end(self, job_id: int, code: int, note: Optional[str] = None) -> int:
        """Remember the job's exit code; a note on why it failed goes to the end of its log (if known)."""
        if note and job_id in self._launches:
            with open(self._launches[job_id].log_path, "a") as log:
                log.write(f"error: {note}\n")
        self._ended[job_id] = code
        return code


def _fields(line: str) -> dict[str, str]:
    """KEY=VALUE fields of one ``scontrol --oneliner`` line (the first of a repeated key wins)."""
    fields: dict[str, str] = {}
    for token in line.split():
        key, _, value = token.partition("=")
        fields.setdefault(key, value)
    return fields


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1].removeprefix("sbatch: error: ").removeprefix("error: ") if lines else "no message"
