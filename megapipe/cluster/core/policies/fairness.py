"""Max-min fairness (least attained service, weighted), agnostic, heterogeneity-aware and with space sharing."""

from __future__ import annotations

from megapipe.cluster.core.policies.base import Policy, fair_share
from megapipe.cluster.core.ratio_lp import max_ratio
from megapipe.cluster.core.symmetry import solve_by_class, throughput_signature


class MaxMinFairness(Policy):
    """max_X min_m (1/w_m) throughput(m, X) / throughput(m, X^equal) * scale_factor_m (section 5.4.1).

    The agnostic form sees every runnable entry of T as 1 (LAS by accelerator time); with
    ``space_sharing`` the rows include job pairs and throughput(m, X) sums over them. Jobs alike in
    T, scale factor and weight are solved as one class (symmetry.py).
    """

    def __init__(self, heterogeneity_aware: bool = True, space_sharing: bool = False):
        self.heterogeneity_aware = heterogeneity_aware
        self.space_sharing = space_sharing
        self.name = "max_min_fairness" + ("_packed" if space_sharing else "_perf" if heterogeneity_aware else "")

    def allocate(self, problem):
        seen = self.seen(problem)
        return solve_by_class(seen, throughput_signature, lambda p: max_ratio(p, fair_share(p)))

    def objective(self, problem, x) -> float:
        """The least normalised throughput, which this policy maximises."""
        seen = self.seen(problem)
        return float((seen.throughput(x) / fair_share(seen)).min())
