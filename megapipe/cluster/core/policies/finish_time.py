"""Finish-time fairness (Themis), seed 002 section 5.4.2.

rho(m, X) = (t_m + steps_m / throughput(m, X)) / (t_m + steps_m / throughput(m, X^isolated)),
minimised in the max. ``steps / throughput`` is convex in X (cvxpy's inv_pos), so the problem is a
second-order cone program. t^isolated_m is taken as the job's elapsed time t_m (it would have
been running since it arrived under an isolated share as well).
"""

from __future__ import annotations

import numpy as np

from megapipe.cluster.core.policies.base import AwareOrAgnostic, shape_of, solve, variable
from megapipe.cluster.core.lp import cp


class FinishTimeFairness(AwareOrAgnostic):
    reads_progress = True
    family = "finish_time_fairness"

    def allocate(self, problem):
        seen = self.seen(problem)
        x = variable(seen)
        throughput = seen.throughput_matrix() @ x
        denominator = isolated_finish(seen)
        rho = cp.multiply(1.0 / denominator,
                          seen.elapsed + cp.multiply(seen.steps_remaining, cp.inv_pos(throughput)))
        return solve(cp.Problem(cp.Minimize(cp.max(rho)), seen.constraints(x)), x, shape_of(seen))

    def objective(self, problem, x) -> float:
        """The largest finish-time fairness rho, which this policy minimises."""
        seen = self.seen(problem)
        finish = seen.elapsed + seen.steps_remaining / np.maximum(seen.throughput(x), 1e-12)
        return float((finish / isolated_finish(seen)).max())


def isolated_finish(problem) -> np.ndarray:
    """Per job, t_m + steps_m / throughput(m, X^isolated): when it would finish on its isolated share."""
    return problem.elapsed + problem.steps_remaining / np.maximum(problem.throughput(problem.isolated_share()), 1e-9)
