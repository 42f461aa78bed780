"""Order-based policies: FIFO and shortest job first (section 5.4.2).

FIFO maximises sum_m throughput(m, X) / throughput(m, X^fastest) * (M - m) with jobs numbered in
arrival order, so earlier jobs are served first and each on its fastest type. Shortest job first
is written the same way with jobs ranked by their shortest possible remaining duration
steps_m / max_j T_mj: the chapter's objective (minimise the shortest job's duration) fixes only
the first job, and the ranked weights extend it to every job.
"""

from __future__ import annotations

import numpy as np

from megapipe.cluster.core.policies.base import AwareOrAgnostic, Policy, shape_of, solve, variable
from megapipe.cluster.core.lp import cp


def _fastest(problem) -> np.ndarray:
    rows = problem.single_rows()
    return np.array([max(problem.T[rows[m], :, 0].max(), 1e-12) for m in range(len(problem.jobs))])


def ranked_allocation(problem, order: np.ndarray) -> np.ndarray:
    """Maximise sum_m normalised throughput * (M - rank_m) for the given ranking."""
    x = variable(problem)
    weights = np.empty(len(problem.jobs))
    weights[order] = len(order) - np.arange(len(order))
    objective = cp.Maximize((weights / _fastest(problem)) @ (problem.throughput_matrix() @ x))
    return solve(cp.Problem(objective, problem.constraints(x)), x, shape_of(problem))


class Fifo(Policy):
    unpartitionable = "it ranks every job against every other, which parts would split"
    skip_zero_priority = True

    def __init__(self, heterogeneity_aware: bool = True, space_sharing: bool = False):
        self.heterogeneity_aware, self.space_sharing = heterogeneity_aware, space_sharing
        self.name = "fifo" + ("_packed" if space_sharing else "_perf" if heterogeneity_aware else "")

    def allocate(self, problem):
        seen = self.seen(problem)
        order = np.array(sorted(range(len(seen.jobs)), key=lambda m: (seen.jobs[m].arrival_time, seen.jobs[m].job_id)))
        return ranked_allocation(seen, order)


class ShortestJobFirst(AwareOrAgnostic):
    unpartitionable = "it ranks every job against every other, which parts would split"
    reads_progress = True
    skip_zero_priority = True
    family = "shortest_job_first"

    def allocate(self, problem):
        seen = self.seen(problem)
        durations = seen.steps_remaining / _fastest(seen)
        return ranked_allocation(seen, np.argsort(durations, kind="stable"))
