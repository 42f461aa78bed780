"""What a simulation reports: JCT over a window, makespan, finish-time fairness, cost, SLO violations."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Summary:
    average_jct_hours: float
    makespan_hours: float
    average_ftf: float
    total_cost: float
    slo_violations: int
    jobs_with_slo: int
    utilisation: float


def completion_times(records: dict) -> dict:
    """job id -> seconds from arrival to finish, for the jobs that finished."""
    return {i: r.finish_time - r.job.arrival_time for i, r in records.items() if r.finish_time is not None}


def summarise(scheduler, window: tuple[int, int] | None = None) -> Summary:
    """Averages over the jobs with ids in [window[0], window[1]) (all jobs when None)."""
    records = scheduler.records
    jct = completion_times(records)
    ids = sorted(jct) if window is None else [i for i in sorted(jct) if window[0] <= i < window[1]]
    first = min(r.job.arrival_time for r in records.values())
    last = max((r.finish_time for r in records.values() if r.finish_time is not None), default=first)
    ftf = [jct[i] / records[i].isolated_duration for i in ids if records[i].isolated_duration]
    with_slo = [r for r in records.values() if r.job.slo is not None and r.finish_time is not None]
    busy = sum((end - start) * n for start, end, n in scheduler.utilisation)
    span = (last - first) * scheduler.cluster.total
    return Summary(
        average_jct_hours=float(np.mean([jct[i] for i in ids])) / 3600 if ids else float("nan"),
        makespan_hours=(last - first) / 3600,
        average_ftf=float(np.mean(ftf)) if ftf else float("nan"),
        total_cost=sum(r.cost for r in records.values()),
        slo_violations=sum(r.finish_time - r.job.arrival_time > r.job.slo for r in with_slo),
        jobs_with_slo=len(with_slo),
        utilisation=busy / span if span > 0 else 0.0,
    )
