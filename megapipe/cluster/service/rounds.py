"""The part-1 scheduling loop against real time: a wall clock, submitted jobs, and rounds run by a backend.

``run_rounds`` (megapipe/cluster/core/scheduler.py) drives these exactly as it drives the simulator;
only the three protocols differ. ``LiveRounds.run_round`` turns a round's placements into
leases: a job that keeps its workers has its lease renewed (when renewals are on), every other
running job is stopped (it saves at the end of its lease and exits), and each placed job not
running is launched, re-planned for its hosts, once the devices it gets are free. The round
ends after ``round_seconds`` or when all its jobs ended; each job's steps are the iterations
its checkpoint or its last report shows beyond what the scheduler had booked.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from megapipe.cluster.core.jobs import Job
from megapipe.cluster.core.mechanism import RoundPlan
from megapipe.cluster.core.scheduler import RunReport

if TYPE_CHECKING:
    from megapipe.cluster.service.service import ClusterService

TICK = 0.2  # seconds between looks at the backend during a round


class ServiceStopped(Exception):
    """Raised inside the round loop to leave it when the service shuts down."""


class WallClock:
    """Seconds since the service started; waiting ends early when ``wake`` is set (a job arrived)."""

    def __init__(self, wake: threading.Event):
        self.start, self.wake = time.time(), wake

    def now(self) -> float:
        return time.time() - self.start

    def wait_until(self, moment: float) -> None:
        self.wake.wait(max(0.0, moment - self.now()))
        self.wake.clear()


class SubmittedJobs:
    """Jobs submitted since the last round (and, before a round, the cluster brought up to date)."""

    def __init__(self, service: "ClusterService"):
        self.service, self.pending = service, []

    def arrived(self, now: float) -> list[Job]:
        self.service.before_round()
        if self.service.stopping:
            raise ServiceStopped
        with self.service.lock:
            arrived, self.pending = self.pending, []
        return arrived

    def next_arrival(self):
        return None  # unknown: submissions wake the clock

    def exhausted(self) -> bool:
        return False  # a service takes submissions until it stops (ServiceStopped ends the loop)


class LiveRounds:
    """``ProgressSource`` of the service: leases, launches and stops through the backend."""

    def __init__(self, service: "ClusterService"):
        self.service = service

    def run_round(self, plan: RoundPlan, jobs: dict, remaining: dict, start: float) -> list[RunReport]:
        service = self.service
        end = start + service.round_seconds
        placements = {key[0]: service.host_slots(worker_type, workers)
                      for key, (worker_type, workers) in plan.assignments.items()}
        service.begin_round(placements, end, renew=service.renew_leases)
        waiting = dict(placements)
        held_since = {}
        while True:
            service.tick()
            for job_id, hosts in list(waiting.items()):
                if job_id not in service.scheduler.active:
                    del waiting[job_id]  # cancelled or failed meanwhile
                elif service.can_launch(job_id, hosts):
                    service.launch(job_id, hosts, end)
                    held_since[job_id] = service.clock.now()
                    del waiting[job_id]
            for job_id in placements:
                if job_id not in waiting and job_id not in held_since and service.is_running(job_id):
                    held_since[job_id] = start  # kept its workers from the last round
            ended = all(not service.is_running(j) for j in placements if j not in waiting)
            if service.stopping:
                raise ServiceStopped
            if service.clock.now() >= end or (ended and not waiting):
                break
            time.sleep(TICK)
        now = service.clock.now()
        reports = []
        for key, (worker_type, _) in plan.assignments.items():
            job_id = key[0]
            if job_id not in service.scheduler.active:
                continue
            steps = max(0, service.known_iterations(job_id) - service.scheduler.records[job_id].steps_done)
            seconds = max(now - held_since.get(job_id, now), 1e-3)
            reports.append(RunReport(key, worker_type, {job_id: steps}, {job_id: seconds}, now))
        return reports
