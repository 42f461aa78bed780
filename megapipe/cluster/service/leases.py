"""Leases and fencing: no job runs twice at once, and a run trains only while its lease holds.

A run's lease number is its fencing token: a report under any other (a run this service revoked,
or a previous incarnation's) is told to stop and fences the job. A job is launched only when no
agent reports ranks of it alive and no run it did not launch has reported within
``fence_seconds``; a renewal waits for the next round to extend or revoke the lease.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megapipe.cluster.service.service import ClusterService

STOP_GRACE_SECONDS = 60.0  # a stopped job saves before SIGKILL


class Leases:
    def __init__(self, service: "ClusterService", fence_seconds: float):
        self.service, self.fence_seconds = service, fence_seconds
        self.started = time.monotonic()  # a restarted service fences every job this long

    def report(self, job_id: int, lease: int, report: dict) -> dict:
        """A running job's report and, with ``renew``, its request to renew (blocks until the round is decided)."""
        service = self.service
        with service.lock:
            record = service.jobs.get(job_id)
            if record is None:
                service.announce(f"refused a lease report from job {job_id}, which this scheduler does not know")
                return {"error": f"job {job_id} is not known to this scheduler; run jobs through tools/cluster.py "
                                 "submit."}
            run = record.run
            if run is None or run.lease != lease:  # a run this service revoked, or a previous incarnation's
                record.fenced_at = None if report.get("exiting") else time.monotonic()
                return {"stop": "the lease is no longer current"}
            service.runs.note_progress(record, report, service.clock.now())
            if report.get("exiting"):
                return {"ok": True}
            deadline = time.monotonic() + 2 * service.round_seconds + 30
            # two iterations' worth of lease, but never more than the next round grants: a job slower than
            # that waits for the next round's decision, not for the deadline at every iteration
            margin = min(max(2 * run.seconds_per_iteration, 1.0), service.round_seconds / 2)
            while (report.get("renew") and run.stop_requested is None and not service.stopping
                   and run.lease_end - service.clock.now() < margin and time.monotonic() < deadline):
                service.lease_changed.wait(0.5)  # until the next round extends or revokes the lease
            if run.stop_requested is not None or service.stopping:
                return {"stop": "the job was placed elsewhere, preempted or cancelled"}
            return {"expires_in": max(0.0, run.lease_end - service.clock.now())}

    def extend_or_revoke(self, placements: dict, end: float, renew: bool) -> None:
        """Extend to ``end`` the lease of each run that keeps its workers (with ``renew``); revoke every
        other, except a run that reported its last iteration: it is finishing on its own (final save,
        evaluation, exit), and a SIGTERM then could only cut that short; one that lands while a rank's
        interpreter exits (which restores the default action) kills the rank, and torchrun ends the
        finished job's log with FAILED."""
        for record in self.service.running():
            run = record.run
            if run.stop_requested is not None or run.iteration >= record.spec.target_iters:
                continue
            if renew and placements.get(record.id) == run.hosts:
                run.lease_end = end
            else:
                self.revoke(record)
        self.service.lease_changed.notify_all()

    def revoke(self, record) -> None:
        """Stop a run: its next lease report is answered ``stop``; SIGTERM too (the loop saves either way)."""
        record.run.stop_requested = self.service.clock.now()
        self.service.backend.stop(record.id, STOP_GRACE_SECONDS)
        self.service.lease_changed.notify_all()

    def can_launch(self, job_id: int, hosts: tuple) -> bool:
        """The job runs nowhere (no fence) and its devices on ``hosts`` are free."""
        service = self.service
        with service.lock:
            record = service.jobs[job_id]
            if record.run is not None or record.finished or record.ranks_alive:
                return False
            now = time.monotonic()
            if record.fenced_at is not None and (now - record.fenced_at < self.fence_seconds
                                                 or now - self.started < self.fence_seconds):
                return False
            hosts_now = service.workers.hosts
            for slot in hosts:
                if slot.host not in hosts_now:
                    return False
                used = sum(s.devices for other in service.running() for s in other.run.hosts
                           if s.host == slot.host and s.worker_type == slot.worker_type)
                if used + slot.devices > hosts_now[slot.host].get(slot.worker_type, 0):
                    return False
            return True
