"""Event-driven simulation of the scheduler on a trace (seed 002 section 5.7).

``run_rounds`` with a clock that jumps from round end to round end, the trace as job source, and
progress from the throughput table: a combination on a type runs ``int(throughput *
round_seconds)`` steps (capped by what is left) and stops when they are done.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.cluster.core.jobs import Job
from megapipe.cluster.core.mechanism import RoundPlan
from megapipe.cluster.core.scheduler import RunReport, Scheduler, run_rounds
from megapipe.cluster.core.throughputs import UNCONSOLIDATED, ThroughputTable


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


@dataclass
class TraceSource:
    """The jobs of a trace, handed out at their arrival times."""

    pending: list

    def arrived(self, now: float) -> list[Job]:
        count = next((i for i, job in enumerate(self.pending) if job.arrival_time > now), len(self.pending))
        arrived, self.pending = self.pending[:count], self.pending[count:]
        return arrived

    def next_arrival(self) -> float | None:
        return self.pending[0].arrival_time if self.pending else None

    def exhausted(self) -> bool:
        return not self.pending


def simulate(scheduler: Scheduler, jobs: list[Job], progress_bar=None, stop_when=None) -> SimulatedClock:
    """Run ``jobs`` (sorted by arrival) to completion, or until ``stop_when(scheduler)`` holds."""
    clock = SimulatedClock(jobs[0].arrival_time)
    on_finished = None if progress_bar is None else (lambda finished: progress_bar.update(len(finished)))
    run_rounds(scheduler, clock, SimulatedProgress(scheduler.table, scheduler.round_seconds), TraceSource(list(jobs)),
               on_finished, stop_when)
    return clock
