"""The Gavel scheduler service: submitted megapipe jobs, leases, and the part-1 mechanism in real time.

State lives in three places, each with one owner: the journal (``journal.py``: every job's
state, checkpointed iterations, measured throughputs; what a restarted service recovers), the
part-1 ``Scheduler`` (policy, allocation, round mechanism; rebuilt from the journal), and the
runs (the live launch of each running job: its lease, hosts and last report; memory only).
One lock guards them; the HTTP handlers (``http_api.py``) and the round loop (``rounds.py``)
take it briefly.

No job runs twice at once: a job is launched only when no agent reports ranks of it alive and
no run of it (this service's or a previous incarnation's) has reported within
``fence_seconds``; a run whose lease was revoked is told to stop at its next report.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Optional

from megapipe.checkpointing.paths import read_latest
from megapipe.lease.auth import LEASE_KEY_ENV, lease_key
from megapipe.lease.client import scheduler_url
from megapipe.cluster.service.backends.agents import LOST, AgentsBackend
from megapipe.cluster.service.backends.base import HostSlots, Launch
from megapipe.cluster.core.cluster_spec import ClusterSpec, devices_text
from megapipe.cluster.service.job_paths import resolved_roots
from megapipe.cluster.service.job_spec import parse_job
from megapipe.cluster.service.job_log import MeasuredThroughput
from megapipe.cluster.core.jobs import Job
from megapipe.cluster.service.journal import Journal
from megapipe.cluster.service.names import check_name
from megapipe.cluster.service.placeable import Unplaceable, unplaceable_reason
from megapipe.cluster.core.mechanism import RoundMechanism
from megapipe.cluster.core.policies import make_policy
from megapipe.cluster.service.relayout import layout_command, predicted_iterations_per_second
from megapipe.cluster.service.rounds import LiveRounds, ServiceStopped, SubmittedJobs, WallClock
from megapipe.cluster.core.scheduler import Scheduler, run_rounds
from megapipe.cluster.core.throughputs import ThroughputTable
from megapipe.errors import ConfigError, SlurmError

STOP_GRACE_SECONDS = 60.0  # a stopped job saves before SIGKILL
# the units of the status's figures whose names do not say them (readers of the JSON keep their keys)
STATUS_UNITS = {"jct": "seconds", "elapsed": "seconds", "average_jct": "seconds", "throughput": "iterations/s",
                "round.seconds": "seconds", "round.ends_in": "seconds"}


@dataclass
class Run:
    """One launch of a job: its lease and what its rank 0 reported."""

    lease: int
    hosts: tuple
    launched_at: float
    start_iteration: int
    lease_end: float
    iteration: int = 0
    last_report: float = 0.0  # when the iteration last advanced
    first_progress: Optional[tuple] = None  # (time, iteration) of the first iteration done
    stop_requested: Optional[float] = None
    seconds_per_iteration: float = 0.0


class ClusterService:
    def __init__(self, journal: Journal, policy: str, round_seconds: float, work_dir: str,
                 worker_types: tuple = ("fast", "slow"), renew_leases: bool = True, address: str = "127.0.0.1:0",
                 lost_seconds: float = 5.0, seed: int = 0, backend=None, announce=None,
                 secret: Optional[bytes] = None, allowed_paths: Optional[tuple] = None, pop_partitions: int = 1):
        """``backend``: what runs the ranks (the ``Backend`` protocol plus ``nodes()`` and
        ``running_job_ids()``, as ``SlurmBackend`` has them); worker agents by default. ``announce``:
        where the service says what happens, one line per event (workers joining or lost, jobs
        submitted and ended, a round's placements when they change); silent when None. ``secret``:
        the cluster's secret, from which each launch gets its lease's key (``auth.lease_key``).
        ``allowed_paths``: the roots every path of a submitted job must lie in (default
        ``WORK_DIR/files``). ``pop_partitions``: solve the policy by POP over that many parts."""
        if round_seconds <= 0:
            raise ConfigError(f"--round-seconds {round_seconds:g} must be positive.")
        self.policy, self.policy_name = make_policy(policy, seed, pop_partitions), policy
        if self.policy.space_sharing:
            raise ConfigError(f"--policy {policy} shares accelerators between jobs, which the service does not run; "
                              "choose a policy without _packed.")
        self.journal, self.round_seconds, self.work_dir = journal, round_seconds, work_dir
        self.worker_types, self.renew_leases, self.address = tuple(worker_types), renew_leases, address
        self.fence_seconds = lost_seconds + 2.0
        self.lock = threading.RLock()
        self.lease_changed = threading.Condition(self.lock)
        self.wake = threading.Event()
        self.clock = WallClock(self.wake)
        self.backend = backend or AgentsBackend(lost_seconds)
        self.agents = self.backend if isinstance(self.backend, AgentsBackend) else None
        self.hosts: dict = {}  # host -> {worker type: devices}, as of the last tick
        self.alive: set = set()  # jobs whose ranks run somewhere, as of the last tick
        self.table = ThroughputTable()
        self.scheduler = Scheduler(self.policy, self.table, ClusterSpec({}), round_seconds, reallocation_seconds=0.0,
                                   seed=seed)
        self.source, self.progress = SubmittedJobs(self), LiveRounds(self)
        self.runs: dict[int, Run] = {}
        self.specs: dict = {}
        self.rates: dict = {}  # (job id, worker type) -> measured iterations/s
        self.logs: dict[int, MeasuredThroughput] = {}  # job id -> the reader of its log's iteration times
        self.costs: dict = {}  # job id -> seconds of its starts and stops (``_costs``; this incarnation's only)
        self.fenced: dict[int, float] = {}  # job id -> last time a run this service did not launch reported
        self.cancelled: set = set()
        self.finished: set = set()  # done, until the round's booking retires them
        self.last_command: dict = {}  # job id -> the command (layout) of its previous launch by this service
        self.placements: dict = {}
        self.unplaceable: dict = {}  # job id -> why it cannot be placed, as last announced
        self.announce = announce or (lambda line: None)
        self.round_end = 0.0
        self.rounds = 0
        self.started = time.monotonic()
        self.stopping = False
        self.thread: Optional[threading.Thread] = None
        self.secret = secret
        os.makedirs(os.path.join(work_dir, "logs"), exist_ok=True)
        if not allowed_paths:
            allowed_paths = (os.path.join(work_dir, "files"),)
            os.makedirs(allowed_paths[0], exist_ok=True)
        self.roots = resolved_roots(allowed_paths)
        self._recover()

    # ---- life -----------------------------------------------------------------------------------
    def _recover(self) -> None:
        """Every unfinished job of the journal back into the scheduler; runs of a previous incarnation are fenced."""
        for row in self.journal.jobs():
            spec = parse_job(row.command)
            self.specs[row.id] = spec  # every job is known: a finished one's last report gets a plain stop
            if row.state not in ("queued", "running"):
                continue
            iterations = read_latest(row.save_dir) or 0
            if iterations >= row.target_iters:  # it finished while no scheduler watched
                self.journal.update(row.id, state="done", iterations=iterations, allocation=None, finished=time.time())
                continue
            job = self._job(row.id, spec, row.priority)
            self.source.pending.append(job)
            for worker_type, rate in row.throughputs.items():
                self.rates[(row.id, worker_type)] = rate
                self.table.add_job_type(job.job_type, job.scale_factor, {worker_type: rate})
            if row.state == "running":
                self.fenced[row.id] = time.monotonic()
            self.journal.update(row.id, state="queued", allocation=None, iterations=iterations)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="rounds", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            run_rounds(self.scheduler, self.clock, self.progress, self.source)
        except ServiceStopped:
            pass

    def shutdown(self) -> None:
        self.stopping = True
        self.wake.set()
        with self.lock:
            self.lease_changed.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def _job(self, job_id: int, spec, priority: float) -> Job:
        return Job(job_id, f"job{job_id}", spec.target_iters, spec.devices, priority_weight=priority)

    # ---- requests -------------------------------------------------------------------------------
    def submit(self, name: str, priority: float, command: list, strict: bool = False) -> int:
        """Check and journal a job; ConfigError (megapipe's own sentence) refuses it. ``strict``: refuse
        (``Unplaceable``) a job no registered worker type can hold now, rather than queue it to wait for one."""
        check_name("--name", name)
        if not (math.isfinite(priority) and priority > 0):
            raise ConfigError(f"--priority {priority:g} must be positive (a weight; 1 is the default).")
        spec = parse_job(command, self.roots)
        reason = unplaceable_reason(spec.devices, self.devices_by_type(), queued=False) if strict else None
        if reason is not None:
            raise Unplaceable(f"--strict refused the job, which no registered worker type can hold now: {reason}")
        job_id = self.journal.add_job(name, spec.kind, spec.command, spec.target_iters, spec.devices, priority,
                                      os.path.join(self.work_dir, "logs"), os.path.join(self.work_dir, "checkpoints"))
        with self.lock:
            self.specs[job_id] = spec
            self.source.pending.append(self._job(job_id, spec, priority))
        self.announce(f"job {job_id} ({name}) submitted: {spec.target_iters} iterations on {spec.devices} "
                      f"device{'s' if spec.devices > 1 else ''}, priority {priority:g}")
        self.wake.set()
        return job_id

    def job_unplaceable(self, job_id: int) -> Optional[str]:
        """Why a queued job cannot be placed on the workers there are now (what ``status`` shows as its
        ``waiting``), or None when some worker type can hold it; submission answers it at once."""
        return unplaceable_reason(self.specs[job_id].devices, self.devices_by_type())

    def devices_by_type(self) -> dict:
        """The registered workers' devices summed per type, as of the last ``tick``: the cluster the rounds
        place jobs on, and what ``status`` and submission judge a job's placeability against."""
        with self.lock:
            counts: dict = {}
            for devices in self.hosts.values():
                for worker_type, n in devices.items():
                    counts[worker_type] = counts.get(worker_type, 0) + n
            return counts

    def cancel(self, job_id: int) -> None:
        row = self.journal.job(job_id)
        if row is None:
            raise ConfigError(f"job {job_id} does not exist; `tools/cluster.py status` lists the jobs.")
        if row.state in ("done", "failed", "cancelled"):
            raise ConfigError(f"job {job_id} is already {row.state}; only queued or running jobs can be cancelled.")
        with self.lock:
            self.source.pending = [j for j in self.source.pending if j.job_id != job_id]
            self.journal.update(job_id, state="cancelled", finished=time.time())
            self.cancelled.add(job_id)  # the round loop takes it out of the scheduler (tick)

    def register_worker(self, host: str, address: str, devices: dict, throttle: dict) -> None:
        check_name("the worker's --host", host)
        check_name("the worker's --address", address)
        if self.agents is None:
            raise ConfigError(f"worker {host} registered with a scheduler that runs its jobs through Slurm; it takes "
                              "no worker agents (start serve without --backend slurm for them).")
        unknown = [t for t in devices if t not in self.worker_types]
        if unknown:
            raise ConfigError(f"worker {host} declares accelerator type {unknown[0]!r}, which this scheduler does not "
                              f"know; declare one of {', '.join(self.worker_types)} (or start serve with "
                              "--worker-types listing it).")
        if not devices or any(int(n) < 1 for n in devices.values()):
            raise ConfigError(f"worker {host} declares no devices; pass --devices TYPE:N with N at least 1.")
        if any(t not in devices or not 0 < float(f) <= 1 for t, f in throttle.items()):
            raise ConfigError(f"worker {host} declares a --throttle outside its devices or (0, 1]; write e.g. "
                              "slow:0.5 for a type of --devices.")
        self.agents.register(host, address, {t: int(n) for t, n in devices.items()},
                              {t: float(f) for t, f in throttle.items()})
        quotas = "".join(f", {t} at {float(f):g} CPU each" for t, f in sorted(throttle.items()) if float(f) < 1)
        self.announce(f"worker {host} registered: {devices_text(devices)}{quotas}")
        self.wake.set()

    def lease_report(self, job_id: int, lease: int, report: dict) -> dict:
        """A running job's report and, with ``renew``, its request to renew (blocks until the round is decided)."""
        with self.lock:
            if job_id not in self.specs:
                self.announce(f"refused a lease report from job {job_id}, which this scheduler does not know")
                return {"error": f"job {job_id} is not known to this scheduler; run jobs through tools/cluster.py "
                                 "submit."}
            run = self.runs.get(job_id)
            if run is None or run.lease != lease:  # a run this service revoked, or a previous incarnation's
                if report.get("exiting"):
                    self.fenced.pop(job_id, None)
                else:
                    self.fenced[job_id] = time.monotonic()
                return {"stop": "the lease is no longer current"}
            self._note_progress(job_id, run, report, self.clock.now())
            if report.get("exiting"):
                return {"ok": True}
            deadline = time.monotonic() + 2 * self.round_seconds + 30
            # two iterations' worth of lease, but never more than the next round grants: a job slower than
            # that waits for the next round's decision, not for the deadline at every iteration
            margin = min(max(2 * run.seconds_per_iteration, 1.0), self.round_seconds / 2)
            while (report.get("renew") and run.stop_requested is None and not self.stopping
                   and run.lease_end - self.clock.now() < margin and time.monotonic() < deadline):
                self.lease_changed.wait(0.5)  # until the next round extends or revokes the lease
            if run.stop_requested is not None or self.stopping:
                return {"stop": "the job was placed elsewhere, preempted or cancelled"}
            return {"expires_in": max(0.0, run.lease_end - self.clock.now())}

    def _note_progress(self, job_id: int, run: Run, report: dict, now: float) -> None:
        """Iteration of a run, its speed (for the lease's renewal margin), and its start-up time: from
        the launch to its first iteration, overhead of a preemption on a relaunch."""
        iteration = int(report.get("iteration", run.iteration))
        run.seconds_per_iteration = float(report.get("seconds_per_iteration") or 0.0)
        if run.first_progress is None:
            if iteration > run.start_iteration:
                run.first_progress = (now, iteration)
                started = max(0.0, now - run.launched_at - run.seconds_per_iteration)
                if run.lease > 1:  # a relaunch: launching and loading the checkpoint is preemption overhead
                    self._add_overhead(job_id, started)
                    self._costs(job_id)["restarts"].append(started)
                else:  # the first start, which any job pays
                    self.journal.update(job_id, fixed=started)
                    self._costs(job_id)["first_start"] = started
        if iteration > run.iteration:  # last_report: when the job last advanced
            run.iteration, run.last_report = iteration, now

    def _measure(self, job_id: int) -> None:
        """The job's iterations/s on each type it ran on, from the iteration times in its log
        (``MeasuredThroughput``); a type's measured rate replaces the planner's prediction for it."""
        reader = self.logs.get(job_id)
        if reader is None:
            reader = self.logs[job_id] = MeasuredThroughput(self.journal.job(job_id).log_path)
        for worker_type, rate in reader.update().items():
            first = (job_id, worker_type) not in self.rates
            self.rates[(job_id, worker_type)] = rate
            self.table.add_job_type(f"job{job_id}", self.specs[job_id].devices, {worker_type: rate})
            self.scheduler.needs_allocation |= first  # the allocation was computed without it

    def _costs(self, job_id: int) -> dict:
        """Seconds the job spent not training, per kind (what a simulator of this cluster needs): its first
        start, each relaunch (to the first iteration), each stop (to its ranks' exit) and its last exit."""
        return self.costs.setdefault(job_id, {"first_start": None, "restarts": [], "stops": [], "exit": None})

    def _add_overhead(self, job_id: int, seconds: float) -> None:
        row = self.journal.job(job_id)
        self.journal.update(job_id, overhead=row.overhead + max(0.0, seconds))

    def heartbeat(self, host: str, running: dict) -> Optional[list]:
        return None if self.agents is None else self.agents.heartbeat(host, running)

    def status(self) -> dict:
        """Jobs, workers by type, the current round's placements and JCTs (what ``status`` and the page show)."""
        with self.lock:
            live = {job_id: run.iteration for job_id, run in self.runs.items()}
            rates = dict(self.rates)
            costs = {job_id: dict(c, restarts=list(c["restarts"]), stops=list(c["stops"]))
                     for job_id, c in self.costs.items()}
            placements = {str(j): [[s.host, s.worker_type, s.devices] for s in hosts]
                          for j, hosts in self.placements.items()}
            round_info = {"number": self.rounds, "seconds": self.round_seconds,
                          "ends_in": max(0.0, self.round_end - self.clock.now()), "placements": placements,
                          "renew_leases": self.renew_leases, "policy": self.policy_name}
        with self.lock:
            hosts, throttles = dict(self.hosts), self.agents.throttles() if self.agents else {}
            by_type = self.devices_by_type()
        jobs = []
        now = time.time()
        for row in self.journal.jobs():
            waiting = unplaceable_reason(row.scale_factor, by_type) if row.state == "queued" else None
            jobs.append({
                "id": row.id, "name": row.name, "state": row.state, "priority": row.priority,
                "iterations": live.get(row.id, row.iterations), "target_iters": row.target_iters,
                "devices": row.scale_factor, "allocation": row.allocation, "log": row.log_path,
                "jct": row.jct, "elapsed": (row.finished or now) - row.submitted, "error": row.error,
                "throughput": {t: r for (j, t), r in rates.items() if j == row.id} or row.throughputs,
                "overhead_seconds": row.overhead, "fixed_seconds": row.fixed, "leases": row.lease,
                "relayouts": row.relayouts, "costs": costs.get(row.id), "waiting": waiting})
        done = [j["jct"] for j in jobs if j["state"] == "done"]
        return {"units": STATUS_UNITS, "jobs": jobs, "round": round_info,
                "average_jct": sum(done) / len(done) if done else None,
                "workers": [{"host": host, "devices": devices,
                             "throttle": {t: f for t, f in throttles.items() if t in devices and f < 1}}
                            for host, devices in sorted(hosts.items())],
                "workers_by_type": by_type}

    # ---- rounds (called by rounds.py) -------------------------------------------------------------
    def before_round(self) -> None:
        """Bring the cluster up to date (agents joined or lost) and wait until it has a worker."""
        while not self.stopping:
            with self.lock:
                self.tick()
                counts = self.devices_by_type()
                if counts != self.scheduler.cluster.counts:
                    per_server = max((n for devices in self.hosts.values() for n in devices.values()), default=1)
                    self.scheduler.cluster = ClusterSpec(counts, per_server)
                    self.scheduler.mechanism = RoundMechanism(self.scheduler.cluster, self.round_seconds,
                                                              self.scheduler.seed + 5)
                    self.scheduler.needs_allocation = True
                self._predict_missing()
                self._announce_unplaceable(counts)
                if counts:
                    return
            self.wake.wait(0.5)

    def _announce_unplaceable(self, counts: dict) -> None:
        """Say once why each queued job cannot be placed on the workers there are (and nothing again until
        that changes); a job the workers can hold is forgotten."""
        for job in self.source.pending + list(self.scheduler.active.values()):
            reason = unplaceable_reason(job.scale_factor, counts)
            if reason is not None and self.unplaceable.get(job.job_id) != reason:
                self.announce(f"job {job.job_id} cannot be placed: {reason}")
            if reason is None:
                self.unplaceable.pop(job.job_id, None)
            else:
                self.unplaceable[job.job_id] = reason

    def _predict_missing(self) -> None:
        """Planner predictions for every (job, type) not measured yet."""
        speeds = self.type_speeds()
        for job_id, spec in self.specs.items():
            key = (f"job{job_id}", spec.devices)
            for worker_type, speed in speeds.items():
                if self.table.isolated.get(worker_type, {}).get(key) is None:
                    self.table.add_job_type(key[0], key[1], {worker_type: predicted_iterations_per_second(
                        spec, worker_type, speed)})

    def type_speeds(self) -> dict:
        """Relative speed of each worker type: its CPU quota where agents throttle it, else 1."""
        throttles = self.agents.throttles() if self.agents else {}
        return {t: throttles.get(t, 1.0) for devices in self.hosts.values() for t in devices}

    def host_slots(self, worker_type: str, workers: tuple) -> tuple:
        """The mechanism's worker ids of a type as per-host slots (ids count the type's devices over hosts by name)."""
        ids = [w for server in self.scheduler.mechanism.servers[worker_type] for w in server]
        owners = [host for host in sorted(self.hosts) for _ in range(self.hosts[host].get(worker_type, 0))]
        counts: dict = {}
        for worker in workers:
            host = owners[ids.index(worker)]
            counts[host] = counts.get(host, 0) + 1
        return tuple(HostSlots(host, worker_type, n) for host, n in counts.items())

    def begin_round(self, placements: dict, end: float, renew: bool) -> None:
        """Extend the leases of runs that keep their workers; revoke every other, except a run that reported
        its last iteration: it is finishing on its own (final save, evaluation, exit), and a SIGTERM then
        could only cut that short; one that lands while a rank's interpreter exits (which restores the
        default action) kills the rank, and torchrun ends the finished job's log with FAILED."""
        with self.lock:
            self.rounds += 1
            if placements != self.placements:
                self.announce(f"round {self.rounds} ({self.round_seconds:g} s): " + (
                    "; ".join(f"job {j} on {_slots(hosts)}" for j, hosts in sorted(placements.items()))
                    or "no job placed"))
            self.placements, self.round_end = placements, end
            for job_id, run in list(self.runs.items()):
                if run.stop_requested is not None or run.iteration >= self.specs[job_id].target_iters:
                    continue
                if renew and placements.get(job_id) == run.hosts:
                    run.lease_end = end
                else:
                    self._revoke(job_id)
            for job_id in self.scheduler.active:
                self.scheduler.records[job_id].steps_done = self.known_iterations(job_id)
            self.lease_changed.notify_all()

    def tick(self) -> None:
        """Look at the backend: cancellations, lost hosts, runs that ended."""
        with self.lock:
            for job_id in self.cancelled:
                self._retire(job_id, "cancelled")
            self.cancelled.clear()
            if self.agents is not None:
                for host in self.agents.forget_lost():
                    self.announce(f"worker {host} lost: no heartbeat for {self.agents.lost_seconds:g} s; its "
                                  "jobs go back to the queue")
            self.hosts, self.alive = self.backend.nodes(), self.backend.running_job_ids()
            for job_id, run in list(self.runs.items()):
                self._measure(job_id)
                if run.stop_requested is None and any(slot.host not in self.hosts for slot in run.hosts):
                    self._revoke(job_id)  # its ranks on the other hosts cannot go on without the lost ones
                code = self.backend.poll(job_id)
                if code is not None:
                    self._ended(job_id, code)

    def can_launch(self, job_id: int, hosts: tuple) -> bool:
        """The job runs nowhere (no fence) and its devices on ``hosts`` are free."""
        with self.lock:
            if job_id in self.runs or job_id in self.finished or job_id in self.alive:
                return False
            since_restart = time.monotonic() - self.started
            last_alien = self.fenced.get(job_id)
            if last_alien is not None and (time.monotonic() - last_alien < self.fence_seconds
                                           or since_restart < self.fence_seconds):
                return False
            for slot in hosts:
                if slot.host not in self.hosts:
                    return False
                used = sum(s.devices for run in self.runs.values() for s in run.hosts
                           if s.host == slot.host and s.worker_type == slot.worker_type)
                if used + slot.devices > self.hosts[slot.host].get(slot.worker_type, 0):
                    return False
            return True

    def launch(self, job_id: int, hosts: tuple, lease_end: float) -> None:
        with self.lock:
            row = self.journal.job(job_id)
            spec = self.specs[job_id]
            lease = row.lease + 1
            command = layout_command(spec, hosts, self.type_speeds().get(hosts[0].worker_type, 1.0))
            if self.last_command.get(job_id, command) != command:  # another layout than its previous run's
                self.journal.update(job_id, relayouts=row.relayouts + 1)
            self.last_command[job_id] = list(command)
            address = f"{scheduler_url(self.address)}/leases/{job_id}/{lease}"
            command = command + ["--save", row.save_dir, "--load", row.save_dir, "--cluster-lease", address]
            start_iteration = self.known_iterations(job_id)
            self.runs[job_id] = Run(lease, hosts, self.clock.now(), start_iteration, lease_end,
                                    iteration=start_iteration)
            self.journal.update(job_id, state="running", lease=lease,
                                allocation=[[s.host, s.worker_type, s.devices] for s in hosts])
            with open(row.log_path, "a") as log:
                placed = ", ".join(f"{s.host}:{s.worker_type}x{s.devices}" for s in hosts)
                log.write(f"[cluster] lease {lease} on {placed}: {' '.join(command)}\n")
            env = {"MEGAPIPE_CLUSTER_JOB": str(job_id)}
            if self.secret is not None:  # the job may sign its lease's reports, and nothing else
                env[LEASE_KEY_ENV] = lease_key(self.secret, job_id, lease).decode()
            try:
                self.backend.start(Launch(job_id, command, hosts, env, row.log_path))
            except SlurmError as error:  # the backend refused the placement: the job fails with its sentence
                del self.runs[job_id]
                self._retire(job_id, "failed", error=str(error))

    def is_running(self, job_id: int) -> bool:
        with self.lock:
            return job_id in self.runs

    def known_iterations(self, job_id: int) -> int:
        """Iterations of a running job's last report, else of its last checkpoint."""
        run = self.runs.get(job_id)
        if run is not None:
            return run.iteration
        return read_latest(self.journal.job(job_id).save_dir) or 0

    # ---- ends -------------------------------------------------------------------------------------
    def _revoke(self, job_id: int) -> None:
        """Stop a run: its next lease report is answered ``stop``; SIGTERM too (the loop saves either way)."""
        run = self.runs[job_id]
        run.stop_requested = self.clock.now()
        self.backend.stop(job_id, STOP_GRACE_SECONDS)
        self.lease_changed.notify_all()

    def _ended(self, job_id: int, code: int) -> None:
        """A run's ranks all ended: done, failed (its error kept, devices freed), or back in the queue."""
        run = self.runs.pop(job_id)
        self._measure(job_id)  # its last lines
        row = self.journal.job(job_id)
        iterations = read_latest(row.save_dir) or 0
        throughputs = {t: r for (j, t), r in self.rates.items() if j == job_id}
        ended = dict(iterations=iterations, allocation=None, throughputs=throughputs)  # with the state: one write
        if row.state == "cancelled":
            self.journal.update(job_id, **ended)
            return
        if iterations >= row.target_iters:  # the last iteration's report to the exit: final save and evaluation
            exit_seconds = max(0.0, self.clock.now() - run.last_report)
            self._costs(job_id)["exit"] = exit_seconds
            finished = time.time()
            self.journal.update(job_id, **ended, state="done", finished=finished, fixed=row.fixed + exit_seconds)
            self.finished.add(job_id)  # the round's booking takes it out of the scheduler
            with open(row.log_path, "a") as log:  # the log ends with the scheduler's word, not the ranks' last line
                log.write(f"[cluster] done: {iterations} of {row.target_iters} iterations, the ranks exited with "
                          f"code {code}\n")
            self.announce(f"job {job_id} ({row.name}) done: {iterations} iterations, JCT "
                          f"{finished - row.submitted:.1f} s")
            return
        if run.stop_requested is not None:
            self._add_overhead(job_id, self.clock.now() - run.stop_requested)
            self._costs(job_id)["stops"].append(self.clock.now() - run.stop_requested)
        if code == LOST:
            self.fenced[job_id] = time.monotonic()  # ranks elsewhere may still be saving
        elif code != 0 and run.stop_requested is None:
            self._retire(job_id, "failed", error=_last_error(row.log_path, code), **ended)
            return
        self.journal.update(job_id, **ended, state="queued")
        self.wake.set()

    def _retire(self, job_id: int, state: str, error: Optional[str] = None, **columns) -> None:
        """Out of the scheduler for good (``columns``: more of its row, written in the same transaction); its
        devices are freed (a running cancelled job is stopped)."""
        self.journal.update(job_id, state=state, error=error, finished=time.time(), **columns)
        self.scheduler.active.pop(job_id, None)
        self.scheduler.needs_allocation = True
        if job_id in self.runs and self.runs[job_id].stop_requested is None:
            self._revoke(job_id)
        self.announce(f"job {job_id} {state}" + (f": {error}" if error else ""))


def _slots(hosts: tuple) -> str:
    """A placement's hosts as "host-a: 1 fast, host-b: 1 fast"."""
    return ", ".join(f"{slot.host}: {slot.devices} {slot.worker_type}" for slot in hosts)


def _last_error(log_path: str, code: int) -> str:
    """The job's own ``error:`` sentence from its last run's log, else the last exception line, else the code."""
    try:
        lines = [line.strip() for line in open(log_path, errors="replace") if line.strip()]
    except OSError:
        lines = []
    starts = [i for i, line in enumerate(lines) if line.startswith("[cluster] lease ")]
    lines = lines[starts[-1] + 1:] if starts else lines
    errors = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    exceptions = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    found = errors or exceptions
    return found[-1] if found else f"its ranks exited with code {code}; see the log."
