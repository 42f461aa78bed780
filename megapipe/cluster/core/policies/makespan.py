"""Minimise makespan: min_X max_m steps_m / throughput(m, X) (section 5.4.2).

With u = 1 / makespan this is one LP: maximise u subject to throughput(m, X) >= steps_m u,
exact where the original system bisected on the makespan.
"""

from __future__ import annotations

from megapipe.cluster.core.policies.base import Policy
from megapipe.cluster.core.ratio_lp import max_ratio


class MinTotalDuration(Policy):
    reads_progress = True

    def __init__(self, heterogeneity_aware: bool = True):
        self.heterogeneity_aware = heterogeneity_aware
        self.name = "min_total_duration" + ("_perf" if heterogeneity_aware else "")

    def allocate(self, problem):
        seen = problem if self.heterogeneity_aware else problem.agnostic()
        return max_ratio(seen, seen.steps_remaining)

    def objective(self, problem, x) -> float:
        """The makespan in seconds, which this policy minimises."""
        seen = problem if self.heterogeneity_aware else problem.agnostic()
        return float((seen.steps_remaining / seen.throughput(x)).max())
