"""max u subject to throughput(m, X) >= demand_m u and (5.1)-(5.3), handed to HiGHS in its sparse form.

Max-min fairness (demand = the equal share times weight over scale factor) and minimum makespan
(demand = steps remaining, u = 1 / makespan) are both this LP. Building it with numpy and calling
the solver directly skips cvxpy's compilation, which took most of the time at 2,048 jobs, and
gives variables only to the entries of X that can run. It is solved by HiGHS's interior-point
method without crossover, like the original system's ECOS an interior-point solver: where the
optimum is not unique it returns one inside the optimal face, which spreads spare capacity over
the jobs instead of leaving it at a vertex's whim. (Clarabel, cvxpy's default, gives the same
allocation but factorises these KKT systems 30x slower at 2,048 jobs with space sharing.)
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from megapipe.cluster.core.lp import INFINITY, SOLVER_NOISE, highs_model, solution
from megapipe.cluster.core.problem import Problem


def max_ratio(problem: Problem, demand: np.ndarray) -> np.ndarray:
    """X of shape (rows, columns) maximising u with throughput(m, X) >= demand_m u for every job m."""
    shape = (len(problem.combos), len(problem.columns))
    free = np.flatnonzero(problem.runnable().flatten())
    capacity, workers = problem.capacity()
    jobs = len(problem.jobs)
    rows = sp.vstack([
        sp.hstack([-problem.throughput_matrix()[:, free], sp.csc_matrix(np.asarray(demand, float)[:, None])]),
        sp.hstack([problem.membership()[:, free], sp.csc_matrix((jobs, 1))]),  # (5.2)
        sp.hstack([capacity[:, free], sp.csc_matrix((capacity.shape[0], 1))]),  # (5.3)
    ], format="csc")
    cost = np.zeros(free.size + 1)
    cost[-1] = -1.0
    highs = highs_model(cost, rows, np.full(rows.shape[0], -INFINITY),
                        np.concatenate([np.zeros(jobs), np.ones(jobs), workers]),
                        np.append(np.ones(free.size), INFINITY), interior=True)
    z = solution(highs)
    if z is None:
        raise RuntimeError(f"the allocation problem is {highs.modelStatusToString(highs.getModelStatus())}")
    x = np.zeros(shape[0] * shape[1])
    x[free] = np.clip(z[:free.size], 0.0, 1.0)
    x[x < SOLVER_NOISE] = 0.0
    return x.reshape(shape)
