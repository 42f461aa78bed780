"""Minimise makespan: min_X max_m steps_m / throughput(m, X) (section 5.4.2).

With u = 1 / makespan this is one LP: maximise u subject to throughput(m, X) >= steps_m u,
exact where the original system bisected on the makespan.
"""

from __future__ import annotations

from megapipe.cluster.core.policies.base import AwareOrAgnostic
from megapipe.cluster.core.ratio_lp import max_ratio


class MinTotalDuration(AwareOrAgnostic):
    reads_progress = True
    family = "min_total_duration"

    def allocate(self, problem):
        seen = self.seen(problem)
        return max_ratio(seen, seen.steps_remaining)

    def objective(self, problem, x) -> float:
        """The makespan in seconds, which this policy minimises."""
        seen = self.seen(problem)
        return float((seen.steps_remaining / seen.throughput(x)).max())
