"""The scheduling loop around the mechanism, written against an abstract clock, job source and progress source.

``run_rounds`` admits the jobs the ``JobSource`` has, has the ``Scheduler`` recompute the
allocation when jobs arrived or finished (at most every ``reallocation_seconds``, as the original
system's simulator does) and ask the mechanism for the round's placements, hands them to the
``ProgressSource`` and books what it reports, round after round. The simulator supplies a
simulated clock, the trace and progress computed from the throughput table; a cluster service
supplies the wall clock, submitted jobs and the steps its workers report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from megapipe.cluster.core.cluster_spec import ClusterSpec
from megapipe.cluster.core.jobs import Job
from megapipe.cluster.core.mechanism import RoundMechanism, RoundPlan
from megapipe.cluster.core.policies.base import Policy
from megapipe.cluster.core.problem import build_problem
from megapipe.cluster.core.throughputs import ThroughputTable


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the scheduler started."""

    def wait_until(self, time: float) -> None:
        """Return at ``time`` (a simulated clock jumps there)."""


@dataclass
class RunReport:
    """What one combination did in a round: steps and seconds per job, when the last stopped."""

    key: tuple
    worker_type: str
    steps: dict  # job id -> steps done
    job_seconds: dict  # job id -> seconds it ran
    end_time: float

    @property
    def seconds(self) -> float:
        """How long the combination held its accelerators."""
        return max(self.job_seconds.values())


class ProgressSource(Protocol):
    def run_round(self, plan: RoundPlan, jobs: dict, remaining: dict, start: float) -> list[RunReport]:
        """Run ``plan`` for one round from ``start`` and report what every combination did."""


class JobSource(Protocol):
    def arrived(self, now: float) -> list[Job]:
        """Jobs submitted up to ``now`` and not handed out before."""

    def next_arrival(self) -> float | None:
        """When the next known job arrives; None when unknown or none."""

    def exhausted(self) -> bool:
        """No job will ever arrive again."""


@dataclass
class JobRecord:
    job: Job
    steps_done: int = 0
    finish_time: float | None = None
    cost: float = 0.0
    isolated_duration: float | None = None  # steps / throughput(m, X^isolated) when it arrived


@dataclass
class Scheduler:
    policy: Policy
    table: ThroughputTable
    cluster: ClusterSpec
    round_seconds: float = 360.0
    reallocation_seconds: float = 1920.0
    seed: int = 0
    prices: dict = field(default_factory=dict)
    global_queue: bool = False
    policy_table: ThroughputTable | None = None  # what policies see (estimates); None: the true table

    def __post_init__(self):
        self.policy_table = self.policy_table or self.table
        self.mechanism = RoundMechanism(self.cluster, self.round_seconds, self.seed + 5, self.global_queue)
        self.records: dict[int, JobRecord] = {}
        self.active: dict[int, Job] = {}
        self.allocation: dict = {}
        self.needs_allocation = False
        self.last_reset: float | None = None
        self.utilisation: list[tuple] = []  # (round start, round end, busy accelerators)
        self.solve_seconds: list[float] = []

    def add_job(self, job: Job) -> None:
        self.active[job.job_id] = job
        self.records[job.job_id] = JobRecord(job)
        self.needs_allocation = True

    def remaining(self) -> dict:
        return {i: job.total_steps - self.records[i].steps_done for i, job in self.active.items()}

    def maybe_reallocate(self, now: float) -> None:
        due = self.last_reset is None or now - self.last_reset >= self.reallocation_seconds
        if not (self.needs_allocation and due and self.active):
            return
        jobs = list(self.active.values())
        problem = build_problem(jobs, self.policy_table, self.cluster, now,
                                {i: r.steps_done for i, r in self.records.items()},
                                space_sharing=self.policy.space_sharing, partners=self.policy.partners,
                                groups=self.policy.pair_groups(jobs),
                                placement_sensitive=self.policy.placement_sensitive, prices=self.prices)
        started = time.perf_counter()
        x = self.policy.allocate(problem)
        self.solve_seconds.append(time.perf_counter() - started)
        self.allocation = problem.by_key(x)
        self._note_isolated(problem)
        self.mechanism.reset(self.allocation)
        self.last_reset, self.needs_allocation = now, False

    def _note_isolated(self, problem) -> None:
        isolated = problem.throughput(problem.isolated_share())
        for m, job in enumerate(problem.jobs):
            record = self.records[job.job_id]
            if record.isolated_duration is None and isolated[m] > 0:
                record.isolated_duration = job.total_steps / isolated[m]

    def runnable(self, key, worker_type) -> bool:
        jobs = [self.active[i] for i in key]
        if len(jobs) == 1:
            return self.table.alone(jobs[0].job_type, jobs[0].scale_factor, worker_type) > 0
        return min(self.policy_table.colocated(jobs[0].key, jobs[1].key, worker_type)) > 0

    def plan_round(self) -> RoundPlan:
        allocation = {k: v for k, v in self.allocation.items() if all(i in self.active for i in k)}
        scale_of = {k: self.active[k[0]].scale_factor for k in allocation}
        return self.mechanism.schedule_round(allocation, scale_of, self.runnable,
                                             shuffle_types=not (self.policy.heterogeneity_aware or self.policy.space_sharing),
                                             skip_zero_priority=self.policy.skip_zero_priority)

    def _learn(self, report: RunReport) -> None:
        """A co-located pair that ran replaces its estimated throughputs by the measured ones."""
        if len(report.key) != 2 or self.policy_table is self.table or report.seconds <= 0:
            return
        first, second = (self.active[i].key for i in report.key)
        measured = tuple(report.steps[i] / report.job_seconds[i] if report.job_seconds[i] > 0 else 0.0
                         for i in report.key)
        pairs = self.policy_table.pairs.setdefault(report.worker_type, {})
        pairs[(first, second)], pairs[(second, first)] = measured, measured[::-1]
        if min(measured) <= 0 and self.allocation.get(report.key):
            self.needs_allocation = True

    def book(self, reports: list[RunReport], start: float) -> list[int]:
        """Apply a round's reports; returns the ids of jobs that finished."""
        finished, busy = [], 0
        for report in reports:
            self.mechanism.record(report.key, report.worker_type, report.seconds)
            self._learn(report)
            scale = self.active[report.key[0]].scale_factor
            busy += scale
            price = self.prices.get(report.worker_type, 0.0) * scale * report.seconds / 3600 / len(report.key)
            for job_id, steps in report.steps.items():
                record = self.records[job_id]
                record.steps_done += steps
                record.cost += price
                if record.steps_done >= record.job.total_steps:
                    record.finish_time = report.end_time
                    finished.append(job_id)
        end = max((r.end_time for r in reports), default=start)
        self.utilisation.append((start, end, busy))
        for job_id in finished:
            del self.active[job_id]
        if finished:
            self.needs_allocation = True
        return finished


def run_rounds(scheduler: Scheduler, clock: Clock, progress: ProgressSource, source: JobSource,
               on_finished=None, stop_when=None) -> None:
    """Schedule round after round until every job finished (or ``stop_when(scheduler)`` holds).

    A round ends when its last combination stops (at most ``round_seconds`` after it began);
    jobs arriving meanwhile join at the next round; with nothing to run the clock moves to the
    next arrival (or one round on).
    """
    while not source.exhausted() or scheduler.active:
        now = clock.now()
        for job in source.arrived(now):
            scheduler.add_job(job)
        if scheduler.active:
            scheduler.maybe_reallocate(now)
            reports = progress.run_round(scheduler.plan_round(), scheduler.active, scheduler.remaining(), now)
        else:
            reports = []
        if not reports:
            if scheduler.active and source.exhausted():
                raise RuntimeError("no active job can run on this cluster; check the jobs against the cluster.")
            scheduler.needs_allocation = scheduler.needs_allocation or bool(scheduler.active)
            upcoming = source.next_arrival()
            clock.wait_until(upcoming if upcoming is not None else now + scheduler.round_seconds)
            continue
        finished = scheduler.book(reports, now)
        clock.wait_until(max(r.end_time for r in reports))
        if on_finished is not None and finished:
            on_finished(finished)
        if stop_when is not None and stop_when(scheduler):
            break
