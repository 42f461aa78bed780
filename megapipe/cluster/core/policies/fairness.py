"""Max-min fairness (least attained service, weighted), agnostic, heterogeneity-aware and with space sharing."""

from __future__ import annotations


from megapipe.cluster.core.policies.base import Policy, scaled_throughput, shape_of, solve, variable
from megapipe.cluster.core.lp import cp


class MaxMinFairness(Policy):
    """max_X min_m (1/w_m) throughput(m, X) / throughput(m, X^equal) * scale_factor_m (section 5.4.1).

    The agnostic form sees every runnable entry of T as 1 (LAS by accelerator time); with
    ``space_sharing`` the rows include job pairs and throughput(m, X) sums over them.
    """

    def __init__(self, heterogeneity_aware: bool = True, space_sharing: bool = False):
        self.heterogeneity_aware = heterogeneity_aware
        self.space_sharing = space_sharing
        self.name = "max_min_fairness" + ("_packed" if space_sharing else "_perf" if heterogeneity_aware else "")

    def allocate(self, problem):
        seen = problem if self.heterogeneity_aware else problem.agnostic()
        x = variable(seen)
        objective = cp.Maximize(cp.min(scaled_throughput(seen, x)))
        return solve(cp.Problem(objective, seen.constraints(x)), x, shape_of(seen))
