"""Throughput and cost policies of seed 002 chapter 6 (section 6.4).

Effective cost is sum_j c_j X_mj. Maximising sum_m throughput(m, X) / cost(m, X) is taken, as the
original system does, in its linear form sum_m sum_j (T_mj / c_j) X_mj (throughput per dollar on
each type), with throughputs normalised per job by the fastest type so that no job dominates by
its step size. The SLO form adds throughput(m, X) >= steps_m / SLO_m.

These are policies for rented cloud instances: an accelerator the allocation does not ask for is
not rented, so the mechanism never runs a job where its allocation is zero (``skip_zero_priority``).
"""

from __future__ import annotations

import numpy as np

from megapipe.cluster.core.policies.base import Policy, shape_of, solve, variable
from megapipe.cluster.core.policies.ordering import _fastest
from megapipe.errors import ConfigError
from megapipe.cluster.core.lp import cp


class MaxSumThroughput(Policy):
    """maximise sum_m throughput(m, X) / throughput(m, X^fastest)."""

    name = "max_sum_throughput_perf"
    skip_zero_priority = True

    def allocate(self, problem):
        x = variable(problem)
        objective = cp.Maximize((1.0 / _fastest(problem)) @ (problem.throughput_matrix() @ x))
        return solve(cp.Problem(objective, problem.constraints(x)), x, shape_of(problem))


def price_per_column(problem) -> np.ndarray:
    missing = [a for a in problem.counts if a not in problem.prices]
    if missing:
        raise ConfigError(f"no price for accelerator type {missing[0]}; pass --prices with every type of --cluster.")
    return np.array([problem.prices[a] for a in problem.accelerator_of])


class MaxThroughputPerDollar(Policy):
    """maximise sum_m sum_j (T_mj / c_j) X_mj (normalised per job), optionally subject to SLOs."""

    skip_zero_priority = True

    def __init__(self, slos: bool = False):
        self.slos = slos
        self.reads_progress = slos
        self.name = "max_sum_throughput_normalized_by_cost_perf" + ("_SLOs" if slos else "")

    def allocate(self, problem):
        prices = price_per_column(problem)
        T = problem.T[:, :, 0] + problem.T[:, :, 1]
        per_dollar = (T / prices[None, :]).flatten()
        row_job = np.repeat([c[0] for c in problem.combos], len(problem.columns))
        per_dollar = per_dollar / _fastest(problem)[row_job] * prices.max()
        x = variable(problem)
        constraints = problem.constraints(x)
        if not self.slos:
            return solve(cp.Problem(cp.Maximize(per_dollar @ x), constraints), x, shape_of(problem))
        return self._with_slos(problem, x, per_dollar, constraints)

    def _with_slos(self, problem, x, per_dollar, constraints):
        """Add every SLO that can still be met; when together they cannot, drop the tightest ones."""
        required = np.where(np.isfinite(problem.slo_remaining),
                            problem.steps_remaining / np.maximum(problem.slo_remaining, 1e-9), 0.0)
        keep = np.flatnonzero(required > 0)
        throughput = problem.throughput_matrix() @ x
        while True:
            slo = [throughput[keep] >= required[keep]] if keep.size else []
            try:
                return solve(cp.Problem(cp.Maximize(per_dollar @ x), constraints + slo), x, shape_of(problem))
            except RuntimeError:
                if not keep.size:
                    raise
                keep = keep[keep != keep[np.argmax(required[keep] / _fastest(problem)[keep])]]


def check_slos(jobs, table, cluster) -> None:
    """Refuse, before simulating, a job whose SLO it cannot meet even alone on its fastest accelerator."""
    for job in jobs:
        if job.slo is None:
            continue
        fastest = max(table.alone(job.job_type, job.scale_factor, w) for w in cluster.worker_types)
        if fastest <= 0 or job.total_steps / fastest > job.slo:
            raise ConfigError(f"job {job.job_id} ({job.job_type}) cannot meet its SLO of {job.slo:.0f} s even alone on "
                              f"its fastest accelerator; loosen the SLO in the trace.")
