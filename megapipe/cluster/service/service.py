"""The Gavel scheduler service: submitted megapipe jobs, leases, and the part-1 mechanism in real time.

State lives in three places, each with one owner: the journal (``journal.py``: every job's
state, checkpointed iterations, measured throughputs; what a restarted service recovers), the
part-1 ``Scheduler`` (policy, allocation, round mechanism; rebuilt from the journal), and the
job records (``job_record.py``: one per job, everything else the service knows of it, its live
run and lease included; memory only). One lock guards them; the HTTP handlers (``http_api.py``)
and the round loop (``rounds.py``) take it briefly.

``ClusterService`` holds that state and its life (start, shutdown) and answers both callers; the
work is its parts': ``Submission`` (jobs in, recovery, cancellation), ``Workers`` (the cluster's
hosts), ``Leases`` (reports, renewal, revocation, fencing), ``Runs`` (launches, their progress
and ends), ``RoundStart`` (the cluster and placements as a round starts) and ``status``.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

from megapipe.cluster.core.cluster_spec import ClusterSpec
from megapipe.cluster.core.policies import make_policy
from megapipe.cluster.core.scheduler import Scheduler, run_rounds
from megapipe.cluster.core.throughputs import ThroughputTable
from megapipe.cluster.service.backends.agents import AgentsBackend
from megapipe.cluster.service.job_paths import resolved_roots
from megapipe.cluster.service.job_record import JobRecord
from megapipe.cluster.service.journal import Journal
from megapipe.cluster.service.leases import Leases
from megapipe.cluster.service.round_start import RoundStart
from megapipe.cluster.service.rounds import LiveRounds, ServiceStopped, SubmittedJobs, WallClock
from megapipe.cluster.service.runs import Runs
from megapipe.cluster.service.status import service_status
from megapipe.cluster.service.submission import Submission
from megapipe.cluster.service.workers import Workers
from megapipe.errors import ConfigError


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
        self.renew_leases, self.address, self.secret = renew_leases, address, secret
        self.jobs: dict[int, JobRecord] = {}  # every job of the journal, by id
        self.lock = threading.RLock()
        self.lease_changed = threading.Condition(self.lock)
        self.wake = threading.Event()
        self.clock = WallClock(self.wake)
        self.announce = announce or (lambda line: None)
        self.backend = backend or AgentsBackend(lost_seconds)
        self.table = ThroughputTable()
        self.scheduler = Scheduler(self.policy, self.table, ClusterSpec({}), round_seconds,
                                   reallocation_seconds=0.0, seed=seed)
        self.source, self.progress = SubmittedJobs(self), LiveRounds(self)
        self.submission, self.workers = Submission(self), Workers(self.backend, worker_types, self.announce)
        self.leases, self.runs = Leases(self, fence_seconds=lost_seconds + 2.0), Runs(self)
        self.round_start = RoundStart(self)
        self.stopping = False
        self.thread: Optional[threading.Thread] = None
        os.makedirs(os.path.join(work_dir, "logs"), exist_ok=True)
        if not allowed_paths:
            allowed_paths = (os.path.join(work_dir, "files"),)
            os.makedirs(allowed_paths[0], exist_ok=True)
        self.roots = resolved_roots(allowed_paths)
        self.submission.recover()

    # ---- life -----------------------------------------------------------------------------------
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

    # ---- the records ------------------------------------------------------------------------------
    def running(self) -> list[JobRecord]:
        """The records of the jobs this service runs now (a list: a run may end while it is walked)."""
        return [record for record in self.jobs.values() if record.run is not None]

    def placements(self) -> dict:
        """The current round's placements: job id -> host slots."""
        return {job_id: record.placement for job_id, record in self.jobs.items() if record.placement is not None}

    # ---- requests (http_api.py) -------------------------------------------------------------------
    def submit(self, name: str, priority: float, command: list, strict: bool = False) -> int:
        return self.submission.submit(name, priority, command, strict)

    def job_unplaceable(self, job_id: int) -> Optional[str]:
        return self.submission.unplaceable(job_id)

    def cancel(self, job_id: int) -> None:
        self.submission.cancel(job_id)

    def register_worker(self, host: str, address: str, devices: dict, throttle: dict) -> None:
        self.workers.register(host, address, devices, throttle)
        self.wake.set()

    def heartbeat(self, host: str, running: dict) -> Optional[list]:
        return self.workers.heartbeat(host, running)

    def lease_report(self, job_id: int, lease: int, report: dict) -> dict:
        return self.leases.report(job_id, lease, report)

    def status(self) -> dict:
        return service_status(self)

    # ---- rounds (rounds.py) -----------------------------------------------------------------------
    def before_round(self) -> None:
        self.round_start.before()

    def begin_round(self, placements: dict, end: float, renew: bool) -> None:
        self.round_start.begin(placements, end, renew)

    def tick(self) -> None:
        self.runs.tick()

    def host_slots(self, worker_type: str, workers: tuple) -> tuple:
        return self.workers.host_slots(self.scheduler.mechanism.servers, worker_type, workers)

    def can_launch(self, job_id: int, hosts: tuple) -> bool:
        return self.leases.can_launch(job_id, hosts)

    def launch(self, job_id: int, hosts: tuple, lease_end: float) -> None:
        self.runs.launch(job_id, hosts, lease_end)

    def is_running(self, job_id: int) -> bool:
        with self.lock:
            return self.jobs[job_id].run is not None

    def known_iterations(self, job_id: int) -> int:
        return self.runs.known_iterations(job_id)
