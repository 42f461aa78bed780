"""Minimise makespan: min_X max_m steps_m / throughput(m, X) (section 5.4.2).

With u = 1 / makespan this is one LP: maximise u subject to throughput(m, X) >= steps_m u,
exact where the original system bisected on the makespan.
"""

from __future__ import annotations


from megapipe.cluster.core.policies.base import Policy, shape_of, solve, variable
from megapipe.cluster.core.lp import cp


class MinTotalDuration(Policy):
    def __init__(self, heterogeneity_aware: bool = True):
        self.heterogeneity_aware = heterogeneity_aware
        self.name = "min_total_duration" + ("_perf" if heterogeneity_aware else "")

    def allocate(self, problem):
        seen = problem if self.heterogeneity_aware else problem.agnostic()
        x, u = variable(seen), cp.Variable(nonneg=True)
        constraints = seen.constraints(x) + [seen.throughput_matrix() @ x >= u * seen.steps_remaining]
        return solve(cp.Problem(cp.Maximize(u), constraints), x, shape_of(seen))
