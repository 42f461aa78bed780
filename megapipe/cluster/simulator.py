"""Event-driven simulation of the scheduler on a trace (seed 002 section 5.7).

Time jumps from round end to round end: a round lasts until its slowest combination has run its
steps for ``round_seconds`` (or finished early); jobs arriving meanwhile join at the next round;
with nothing to run the clock jumps to the next arrival. Progress comes from the throughput table:
a combination on a type runs ``int(throughput * round_seconds)`` steps (capped by what is left).
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.cluster.jobs import Job
from megapipe.cluster.mechanism import RoundPlan
from megapipe.cluster.scheduler import RunReport, Scheduler
from megapipe.cluster.throughputs import UNCONSOLIDATED, ThroughputTable


@dataclass
class SimulatedClock:
    time: float = 0.0

    def now(self) -> float:
        return self.time

    def wait_until(self, time: float) -> None:
        self.time = max(self.time, time)


@dataclass
class SimulatedProgress:
    """Steps from the throughput table: consolidated, unconsolidated (spread workers) or co-located."""

    table: ThroughputTable
    round_seconds: float

    def throughputs(self, jobs: list[Job], worker_type: str, consolidated: bool) -> list[float]:
        if len(jobs) == 2:
            return list(self.table.colocated(jobs[0].key, jobs[1].key, worker_type))
        job = jobs[0]
        alone = self.table.alone(job.job_type, job.scale_factor, worker_type)
        if job.scale_factor > 1 and not consolidated:
            return [self.table.alone(job.job_type, job.scale_factor, worker_type + UNCONSOLIDATED) or alone]
        return [alone]

    def run_round(self, plan: RoundPlan, jobs: dict, remaining: dict, start: float) -> list[RunReport]:
        reports = []
        for key, (worker_type, _) in plan.assignments.items():
            rates = self.throughputs([jobs[i] for i in key], worker_type, plan.consolidated[key])
            if min(rates) <= 0:  # an estimated pair that cannot share an accelerator: the round is lost
                reports.append(RunReport(key, worker_type, {i: 0 for i in key}, {i: self.round_seconds for i in key},
                                         start + self.round_seconds))
                continue
            steps, seconds = {}, {}
            for job_id, rate in zip(key, rates):
                steps[job_id] = min(int(rate * self.round_seconds), remaining[job_id])
                seconds[job_id] = steps[job_id] / rate
            reports.append(RunReport(key, worker_type, steps, seconds, start + max(seconds.values())))
        return reports


def simulate(scheduler: Scheduler, jobs: list[Job], progress_bar=None, stop_when=None) -> SimulatedClock:
    """Run ``jobs`` (sorted by arrival) to completion, or until ``stop_when(scheduler)`` holds."""
    clock = SimulatedClock(jobs[0].arrival_time)
    progress = SimulatedProgress(scheduler.table, scheduler.round_seconds)
    pending = list(jobs)
    while pending or scheduler.active:
        now = clock.now()
        while pending and pending[0].arrival_time <= now:
            scheduler.add_job(pending.pop(0), now)
        if not scheduler.active:
            clock.wait_until(pending[0].arrival_time)
            continue
        scheduler.maybe_reallocate(now)
        plan = scheduler.plan_round()
        reports = progress.run_round(plan, scheduler.active, scheduler.remaining(), now)
        if not reports:
            if not pending:
                raise RuntimeError("no active job can run on this cluster; check the trace against --cluster.")
            clock.wait_until(pending[0].arrival_time)
            scheduler.needs_allocation = True
            continue
        finished = scheduler.book(reports, now)
        clock.wait_until(max(r.end_time for r in reports))
        if progress_bar is not None and finished:
            progress_bar.update(len(finished))
        if stop_when is not None and stop_when(scheduler):
            break
    return clock
