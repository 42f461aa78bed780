"""Runs of jobs: launched on a placement, watched through the backend, and ended (done, failed or requeued).

Each launch is re-planned for its hosts (``relayout.py``) and gets the next lease and, with a
cluster secret, that lease's key; its rank 0's reports give its progress and start-up time, its
log gives measured rates per worker type, and its end writes the job's row in one transaction.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Optional

from megapipe.checkpointing.paths import read_latest
from megapipe.lease.auth import LEASE_KEY_ENV, lease_key
from megapipe.lease.client import scheduler_url
from megapipe.cluster.service.backends.agents import LOST
from megapipe.cluster.service.backends.base import Launch
from megapipe.cluster.service.job_log import MeasuredThroughput
from megapipe.cluster.service.job_record import JobRecord, Run
from megapipe.cluster.service.relayout import layout_command
from megapipe.errors import SlurmError

if TYPE_CHECKING:
    from megapipe.cluster.service.service import ClusterService


class Runs:
    def __init__(self, service: "ClusterService"):
        self.service = service

    def launch(self, job_id: int, hosts: tuple, lease_end: float) -> None:
        service = self.service
        with service.lock:
            record, row = service.jobs[job_id], service.journal.job(job_id)
            lease = row.lease + 1
            command = layout_command(record.spec, hosts, service.workers.type_speeds().get(hosts[0].worker_type, 1.0))
            if record.last_command not in (None, command):  # another layout than its previous run's
                service.journal.update(job_id, relayouts=row.relayouts + 1)
            record.last_command = list(command)
            address = f"{scheduler_url(service.address)}/leases/{job_id}/{lease}"
            command = command + ["--save", row.save_dir, "--load", row.save_dir, "--cluster-lease", address]
            start_iteration = self.known_iterations(job_id)
            record.run = Run(lease, hosts, service.clock.now(), start_iteration, lease_end, iteration=start_iteration)
            service.journal.update(job_id, state="running", lease=lease,
                                   allocation=[[s.host, s.worker_type, s.devices] for s in hosts])
            with open(row.log_path, "a") as log:
                placed = ", ".join(f"{s.host}:{s.worker_type}x{s.devices}" for s in hosts)
                log.write(f"[cluster] lease {lease} on {placed}: {' '.join(command)}\n")
            env = {"MEGAPIPE_CLUSTER_JOB": str(job_id)}
            if service.secret is not None:  # the job may sign its lease's reports, and nothing else
                env[LEASE_KEY_ENV] = lease_key(service.secret, job_id, lease).decode()
            try:
                service.backend.start(Launch(job_id, command, hosts, env, row.log_path))
            except SlurmError as error:  # the backend refused the placement: the job fails with its sentence
                record.run = None
                self.retire(record, "failed", error=str(error))

    def tick(self) -> None:
        """Look at the backend: cancellations, lost hosts, runs that ended."""
        service = self.service
        with service.lock:
            for record in service.jobs.values():
                if record.cancel_requested:
                    record.cancel_requested = False
                    self.retire(record, "cancelled")
            alive = service.workers.refresh()
            for record in service.jobs.values():
                record.ranks_alive = record.id in alive
            for record in service.running():
                self.measure(record)
                if record.run.stop_requested is None and any(s.host not in service.workers.hosts
                                                             for s in record.run.hosts):
                    service.leases.revoke(record)  # its ranks on the other hosts cannot go on without the lost ones
                code = service.backend.poll(record.id)
                if code is not None:
                    self.ended(record, code)

    def known_iterations(self, job_id: int) -> int:
        """Iterations of a running job's last report, else of its last checkpoint."""
        run = self.service.jobs[job_id].run
        if run is not None:
            return run.iteration
        return read_latest(self.service.journal.job(job_id).save_dir) or 0

    def note_progress(self, record: JobRecord, report: dict, now: float) -> None:
        """Iteration of a run, its speed (for the lease's renewal margin), and its start-up time: from
        the launch to its first iteration, overhead of a preemption on a relaunch."""
        run = record.run
        iteration = int(report.get("iteration", run.iteration))
        run.seconds_per_iteration = float(report.get("seconds_per_iteration") or 0.0)
        run.stragglers = list(report.get("stragglers", run.stragglers))
        if run.first_progress is None:
            if iteration > run.start_iteration:
                run.first_progress = (now, iteration)
                started = max(0.0, now - run.launched_at - run.seconds_per_iteration)
                if run.lease > 1:  # a relaunch: launching and loading the checkpoint is preemption overhead
                    self._add_overhead(record.id, started)
                    record.cost_sheet()["restarts"].append(started)
                else:  # the first start, which any job pays
                    self.service.journal.update(record.id, fixed=started)
                    record.cost_sheet()["first_start"] = started
        if iteration > run.iteration:  # last_report: when the job last advanced
            run.iteration, run.last_report = iteration, now

    def measure(self, record: JobRecord) -> None:
        """The job's iterations/s on each type it ran on, from the iteration times in its log
        (``MeasuredThroughput``); a type's measured rate replaces the planner's prediction for it."""
        service = self.service
        if record.log_reader is None:
            record.log_reader = MeasuredThroughput(service.journal.job(record.id).log_path)
        for worker_type, rate in record.log_reader.update().items():
            first = worker_type not in record.rates
            record.rates[worker_type] = rate
            service.table.add_job_type(f"job{record.id}", record.spec.devices, {worker_type: rate})
            service.scheduler.needs_allocation |= first  # the allocation was computed without it

    def ended(self, record: JobRecord, code: int) -> None:
        """A run's ranks all ended: done, failed (its error kept, devices freed), or back in the queue."""
        service, job_id = self.service, record.id
        run, record.run = record.run, None
        self.measure(record)  # its last lines
        row = service.journal.job(job_id)
        iterations = read_latest(row.save_dir) or 0
        ended = dict(iterations=iterations, allocation=None, throughputs=dict(record.rates))  # one write with the state
        if row.state == "cancelled":
            service.journal.update(job_id, **ended)
            return
        now = service.clock.now()
        if iterations >= row.target_iters:  # the last iteration's report to the exit: final save and evaluation
            exit_seconds = max(0.0, now - run.last_report)
            record.cost_sheet()["exit"] = exit_seconds
            finished = time.time()
            service.journal.update(job_id, **ended, state="done", finished=finished, fixed=row.fixed + exit_seconds)
            record.finished = True  # the round's booking takes it out of the scheduler
            with open(row.log_path, "a") as log:  # the log ends with the scheduler's word, not the ranks' last line
                log.write(f"[cluster] done: {iterations} of {row.target_iters} iterations, the ranks exited with "
                          f"code {code}\n")
            service.announce(f"job {job_id} ({row.name}) done: {iterations} iterations, JCT "
                             f"{finished - row.submitted:.1f} s")
            return
        if run.stop_requested is not None:
            self._add_overhead(job_id, now - run.stop_requested)
            record.cost_sheet()["stops"].append(now - run.stop_requested)
        if code == LOST:
            record.fenced_at = time.monotonic()  # ranks elsewhere may still be saving
        elif code != 0 and run.stop_requested is None:
            self.retire(record, "failed", error=_last_error(row.log_path, code), **ended)
            return
        service.journal.update(job_id, **ended, state="queued")
        service.wake.set()

    def retire(self, record: JobRecord, state: str, error: Optional[str] = None, **columns) -> None:
        """Out of the scheduler for good (``columns``: more of its row, written in the same transaction); its
        devices are freed (a running cancelled job is stopped)."""
        service = self.service
        service.journal.update(record.id, state=state, error=error, finished=time.time(), **columns)
        service.scheduler.active.pop(record.id, None)
        service.scheduler.needs_allocation = True
        if record.run is not None and record.run.stop_requested is None:
            service.leases.revoke(record)
        service.announce(f"job {record.id} {state}" + (f": {error}" if error else ""))

    def _add_overhead(self, job_id: int, seconds: float) -> None:
        row = self.service.journal.job(job_id)
        self.service.journal.update(job_id, overhead=row.overhead + max(0.0, seconds))


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
