"""What the service does as a round starts: the cluster brought up to date, then the round's placements taken.

Before a round the scheduler gets the workers there are now (waiting until there is one), planner
predictions for every job not measured on a type yet, and each queued job that no worker type can
hold is announced once with why. As the round begins, each job gets its placement and each run
its lease extended or revoked (``leases.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megapipe.cluster.core.cluster_spec import ClusterSpec
from megapipe.cluster.core.mechanism import RoundMechanism
from megapipe.cluster.service.placeable import unplaceable_reason
from megapipe.cluster.service.relayout import predicted_iterations_per_second

if TYPE_CHECKING:
    from megapipe.cluster.service.service import ClusterService


class RoundStart:
    def __init__(self, service: "ClusterService"):
        self.service = service
        self.number = 0  # rounds begun
        self.end = 0.0  # when the current round ends (service clock)

    def before(self) -> None:
        """Bring the cluster up to date (agents joined or lost) and wait until it has a worker."""
        service = self.service
        while not service.stopping:
            with service.lock:
                service.runs.tick()
                counts = service.workers.devices_by_type()
                scheduler = service.scheduler
                if counts != scheduler.cluster.counts:
                    per_server = max((n for devices in service.workers.hosts.values() for n in devices.values()),
                                     default=1)
                    scheduler.cluster = ClusterSpec(counts, per_server)
                    scheduler.mechanism = RoundMechanism(scheduler.cluster, service.round_seconds, scheduler.seed + 5)
                    scheduler.needs_allocation = True
                self._predict_missing()
                self._announce_unplaceable(counts)
                if counts:
                    return
            service.wake.wait(0.5)

    def begin(self, placements: dict, end: float, renew: bool) -> None:
        """Say the round's placements when they changed, give each job its own, and extend or revoke the
        runs' leases (``Leases.extend_or_revoke``); the scheduler books each active job's known iterations."""
        service = self.service
        with service.lock:
            self.number += 1
            if placements != service.placements():
                service.announce(f"round {self.number} ({service.round_seconds:g} s): " + (
                    "; ".join(f"job {j} on {_slots(hosts)}" for j, hosts in sorted(placements.items()))
                    or "no job placed"))
            for job_id, record in service.jobs.items():
                record.placement = placements.get(job_id)
            self.end = end
            service.leases.extend_or_revoke(placements, end, renew)
            for job_id in service.scheduler.active:
                service.scheduler.records[job_id].steps_done = service.runs.known_iterations(job_id)

    def _announce_unplaceable(self, counts: dict) -> None:
        """Say once why each queued job cannot be placed on the workers there are (and nothing again until
        that changes); a job the workers can hold is forgotten."""
        service = self.service
        for job in service.source.pending + list(service.scheduler.active.values()):
            record = service.jobs[job.job_id]
            reason = unplaceable_reason(job.scale_factor, counts)
            if reason is not None and record.unplaceable != reason:
                service.announce(f"job {job.job_id} cannot be placed: {reason}")
            record.unplaceable = reason

    def _predict_missing(self) -> None:
        """Planner predictions for every (job, type) not measured yet."""
        service = self.service
        speeds = service.workers.type_speeds()
        for job_id, record in service.jobs.items():
            key = (f"job{job_id}", record.spec.devices)
            for worker_type, speed in speeds.items():
                if service.table.isolated.get(worker_type, {}).get(key) is None:
                    service.table.add_job_type(key[0], key[1], {worker_type: predicted_iterations_per_second(
                        record.spec, worker_type, speed)})


def _slots(hosts: tuple) -> str:
    """A placement's hosts as "host-a: 1 fast, host-b: 1 fast"."""
    return ", ".join(f"{slot.host}: {slot.devices} {slot.worker_type}" for slot in hosts)
