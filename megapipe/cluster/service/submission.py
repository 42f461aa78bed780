"""Jobs into the service: submitted ones checked and journaled, a restarted service's recovered, cancelled ones marked.

Each job gets its ``JobRecord`` here and its ``Job`` in the queue the next round takes
(``SubmittedJobs.pending``); a cancelled one is marked for the round loop to retire.
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Optional

from megapipe.checkpointing.paths import read_latest
from megapipe.cluster.core.jobs import Job
from megapipe.cluster.service.job_record import JobRecord
from megapipe.cluster.service.job_spec import JobSpec, parse_job
from megapipe.cluster.service.names import check_name
from megapipe.cluster.service.placeable import Unplaceable, unplaceable_reason
from megapipe.errors import ConfigError

if TYPE_CHECKING:
    from megapipe.cluster.service.service import ClusterService


class Submission:
    def __init__(self, service: "ClusterService"):
        self.service = service

    def recover(self) -> None:
        """Every unfinished job of the journal back into the scheduler; runs of a previous incarnation are fenced."""
        service = self.service
        for row in service.journal.jobs():
            spec = parse_job(row.command)
            record = service.jobs[row.id] = JobRecord(row.id, spec)  # a finished one's last report gets a plain stop
            if row.state not in ("queued", "running"):
                continue
            iterations = read_latest(row.save_dir) or 0
            if iterations >= row.target_iters:  # it finished while no scheduler watched
                service.journal.update(row.id, state="done", iterations=iterations, allocation=None,
                                       finished=time.time())
                continue
            job = _job(row.id, spec, row.priority)
            service.source.pending.append(job)
            for worker_type, rate in row.throughputs.items():
                record.rates[worker_type] = rate
                service.table.add_job_type(job.job_type, job.scale_factor, {worker_type: rate})
            if row.state == "running":
                record.fenced_at = time.monotonic()
            service.journal.update(row.id, state="queued", allocation=None, iterations=iterations)

    def submit(self, name: str, priority: float, command: list, strict: bool = False) -> int:
        """Check and journal a job; ConfigError (megapipe's own sentence) refuses it. ``strict``: refuse
        (``Unplaceable``) a job no registered worker type can hold now, rather than queue it to wait for one."""
        service = self.service
        check_name("--name", name)
        if not (math.isfinite(priority) and priority > 0):
            raise ConfigError(f"--priority {priority:g} must be positive (a weight; 1 is the default).")
        spec = parse_job(command, service.roots)
        with service.lock:
            by_type = service.workers.devices_by_type()
        reason = unplaceable_reason(spec.devices, by_type, queued=False) if strict else None
        if reason is not None:
            raise Unplaceable(f"--strict refused the job, which no registered worker type can hold now: {reason}")
        job_id = service.journal.add_job(name, spec.kind, spec.command, spec.target_iters, spec.devices, priority,
                                         os.path.join(service.work_dir, "logs"),
                                         os.path.join(service.work_dir, "checkpoints"))
        with service.lock:
            service.jobs[job_id] = JobRecord(job_id, spec)
            service.source.pending.append(_job(job_id, spec, priority))
        service.announce(f"job {job_id} ({name}) submitted: {spec.target_iters} iterations on {spec.devices} "
                         f"device{'s' if spec.devices > 1 else ''}, priority {priority:g}")
        service.wake.set()
        return job_id

    def unplaceable(self, job_id: int) -> Optional[str]:
        """Why a queued job cannot be placed on the workers there are now (what ``status`` shows as its
        ``waiting``), or None when some worker type can hold it; submission answers it at once."""
        with self.service.lock:
            return unplaceable_reason(self.service.jobs[job_id].spec.devices, self.service.workers.devices_by_type())

    def cancel(self, job_id: int) -> None:
        service = self.service
        row = service.journal.job(job_id)
        if row is None:
            raise ConfigError(f"job {job_id} does not exist; `tools/cluster.py status` lists the jobs.")
        if row.state in ("done", "failed", "cancelled"):
            raise ConfigError(f"job {job_id} is already {row.state}; only queued or running jobs can be cancelled.")
        with service.lock:
            service.source.pending = [j for j in service.source.pending if j.job_id != job_id]
            service.journal.update(job_id, state="cancelled", finished=time.time())
            service.jobs[job_id].cancel_requested = True  # the round loop takes it out of the scheduler (tick)


def _job(job_id: int, spec: JobSpec, priority: float) -> Job:
    """The scheduler's view of a job: its name, iterations, devices and weight."""
    return Job(job_id, f"job{job_id}", spec.target_iters, spec.devices, priority_weight=priority)
