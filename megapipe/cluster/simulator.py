"""Event-driven simulation of the scheduler on a trace (seed 002 section 5.7).

``run_rounds`` with a clock that jumps from round end to round end, the trace as job source, and
progress from the throughput table: a combination on a type runs ``int(throughput *
round_seconds)`` steps (capped by what is left) and stops when they are done. Optionally, the
seconds real jobs spend starting, stopping and exiting (``StartStopCosts``, measured by the
scheduler service) come off the rounds they happen in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megapipe.cluster.jobs import Job
from megapipe.cluster.mechanism import RoundPlan
from megapipe.cluster.scheduler import RunReport, Scheduler, run_rounds
from megapipe.cluster.throughputs import UNCONSOLIDATED, ThroughputTable


@dataclass
class SimulatedClock:
    time: float = 0.0

    def now(self) -> float:
        return self.time

    def wait_until(self, time: float) -> None:
        self.time = max(self.time, time)


@dataclass
class StartStopCosts:
    """Seconds a job spends not training around its runs, as measured on a real cluster.

    ``first_start``: from its first launch to its first iteration (process start, model build);
    ``restart``: the same for a relaunch (the checkpoint load included); ``stop``: from a preemption
    to its processes' exit (the save), while its devices stay busy; ``exit``: from its last
    iteration to its exit (final save and evaluation), part of its JCT. The chapter's simulator
    leaves them out (all 0), which its 6-minute rounds and hours-long jobs allow.
    """

    first_start: float = 0.0
    restart: float = 0.0
    stop: float = 0.0
    exit: float = 0.0


@dataclass
class SimulatedProgress:
    """Steps from the throughput table: consolidated, unconsolidated (spread workers) or co-located.

    With ``costs`` (job id -> ``StartStopCosts``), a job placed on other workers than last round
    (or on any, without lease ``renew``als) first waits until the previous holders of its workers
    have stopped (or exited), then starts, and trains for what is left of the round; a job that
    finishes holds its workers while it exits.
    """

    table: ThroughputTable
    round_seconds: float
    costs: dict = field(default_factory=dict)
    renew: bool = True
    placed: dict = field(default_factory=dict)  # job id -> (worker type, workers) it ran on last round
    started: set = field(default_factory=set)  # jobs launched at least once
    busy_until: dict = field(default_factory=dict)  # (worker type, worker) -> when its last holder is gone

    def throughputs(self, jobs: list[Job], worker_type: str, consolidated: bool) -> list[float]:
        if len(jobs) == 2:
            return list(self.table.colocated(jobs[0].key, jobs[1].key, worker_type))
        job = jobs[0]
        alone = self.table.alone(job.job_type, job.scale_factor, worker_type)
        if job.scale_factor > 1 and not consolidated:
            return [self.table.alone(job.job_type, job.scale_factor, worker_type + UNCONSOLIDATED) or alone]
        return [alone]

    def run_round(self, plan: RoundPlan, jobs: dict, remaining: dict, start: float) -> list[RunReport]:
        where = {job_id: (worker_type, tuple(workers)) for key, (worker_type, workers) in plan.assignments.items()
                 for job_id in key}
        for job_id, (worker_type, workers) in self.placed.items():
            if not self._continues(job_id, where):  # preempted: it saves and exits on its workers
                for worker in workers:
                    self.busy_until[(worker_type, worker)] = start + self._cost(job_id).stop
        delays = {job_id: self._delay(job_id, where, start) for job_id in where}  # before this round's exits
        reports, self.placed = [], {}
        for key, (worker_type, workers) in plan.assignments.items():
            rates = self.throughputs([jobs[i] for i in key], worker_type, plan.consolidated[key])
            if min(rates) <= 0:  # an estimated pair that cannot share an accelerator: the round is lost
                reports.append(RunReport(key, worker_type, {i: 0 for i in key}, {i: self.round_seconds for i in key},
                                         start + self.round_seconds))
                continue
            steps, seconds = {}, {}
            for job_id, rate in zip(key, rates):
                delay = delays[job_id]
                steps[job_id] = min(int(rate * max(0.0, self.round_seconds - delay)), remaining[job_id])
                seconds[job_id] = delay + steps[job_id] / rate
                if steps[job_id] == remaining[job_id]:
                    seconds[job_id] += self._cost(job_id).exit
                    for worker in workers:
                        self.busy_until[(worker_type, worker)] = start + seconds[job_id]
                else:
                    self.placed[job_id] = where[job_id]
            reports.append(RunReport(key, worker_type, steps, seconds, start + max(seconds.values())))
        return reports

    def _cost(self, job_id: int) -> StartStopCosts:
        return self.costs.get(job_id, NO_COSTS)

    def _continues(self, job_id: int, where: dict) -> bool:
        """The job keeps running on the same workers (its lease renewed)."""
        return self.renew and self.placed.get(job_id) == where.get(job_id)

    def _delay(self, job_id: int, where: dict, start: float) -> float:
        """Seconds from the round's start to the job's first iteration in it."""
        if self._continues(job_id, where):
            return 0.0
        worker_type, workers = where[job_id]
        free = max([start] + [self.busy_until.get((worker_type, w), start) for w in workers])
        cost = self._cost(job_id)
        launch = cost.restart if job_id in self.started else cost.first_start
        self.started.add(job_id)
        return free - start + launch


NO_COSTS = StartStopCosts()


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


def simulate(scheduler: Scheduler, jobs: list[Job], progress_bar=None, stop_when=None, costs: dict | None = None,
             renew: bool = True) -> SimulatedClock:
    """Run ``jobs`` (sorted by arrival) to completion, or until ``stop_when(scheduler)`` holds; ``costs`` and
    ``renew`` as ``SimulatedProgress`` takes them (none: the chapter's simulator)."""
    clock = SimulatedClock(jobs[0].arrival_time)
    on_finished = None if progress_bar is None else (lambda finished: progress_bar.update(len(finished)))
    progress = SimulatedProgress(scheduler.table, scheduler.round_seconds, costs or {}, renew)
    run_rounds(scheduler, clock, progress, TraceSource(list(jobs)), on_finished, stop_when)
    return clock
