"""max u subject to throughput(m, X) >= demand_m u and (5.1)-(5.3), handed to an interior-point solver as sparse rows.

Max-min fairness (demand = the equal share times weight over scale factor) and minimum makespan
(demand = steps remaining, u = 1 / makespan) are both this LP. Building it with numpy and calling
the solver directly skips cvxpy's compilation, which took most of the time at 2,048 jobs, and
gives variables only to the entries of X that can run.

Interior-point methods, like the original system's ECOS, return a point inside the optimal face
where the optimum is not unique (max-min fairness fixes only the least ratio), which spreads
spare capacity over the jobs instead of leaving it at a vertex's whim. Which point depends on
the barrier, one log term per row: a job standing for k interchangeable jobs (symmetry.py) has
its rows repeated k times, so that the barrier is the whole problem's (without the repetition the
agnostic LAS entry of Table 5.3 moved from 5.75 h to 6.06 h with the same optimum). Such a
problem has few columns and many rows, which Clarabel's direct factorisation handles fastest;
a problem of one job per class has thousands of columns and dense capacity rows, which
Clarabel's factorisation fills in (50 s at 2,048 jobs with space sharing) and HiGHS's
interior-point method without crossover solves in 2 s.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from megapipe.cluster.core.lp import INFINITY, clarabel, cleaned, highs_model, solution
from megapipe.cluster.core.problem import Problem


def ratio_rows(problem: Problem, demand: np.ndarray, free: np.ndarray) -> tuple[sp.csc_matrix, np.ndarray]:
    """(G, h) with G @ [X over ``free``, u] <= h: demand u - throughput <= 0, (5.2), (5.3), X <= 1,
    X >= 0, u >= 0, each row of a job repeated once per job it stands for."""
    copies = np.repeat(np.arange(len(problem.jobs)), problem.multiplicity.astype(np.int64))
    job_of_variable = np.repeat(problem.members()[0], len(problem.columns))[free]
    variable_copies = np.repeat(np.arange(free.size), problem.multiplicity.astype(np.int64)[job_of_variable])
    capacity, workers = problem.capacity()
    no_u = sp.csc_matrix((len(problem.jobs), 1))
    identity = sp.identity(free.size + 1, format="csr")
    G = sp.vstack([
        sp.hstack([-problem.throughput_matrix()[:, free], sp.csc_matrix(np.asarray(demand, float)[:, None])],
                  format="csr")[copies],
        sp.hstack([problem.membership()[:, free], no_u], format="csr")[copies],  # (5.2)
        sp.hstack([capacity[:, free], sp.csc_matrix((capacity.shape[0], 1))]),  # (5.3)
        identity[variable_copies], -identity[variable_copies], -identity[[free.size]],
    ], format="csc")
    h = np.concatenate([np.zeros(copies.size), np.ones(copies.size), workers, np.ones(variable_copies.size),
                        np.zeros(variable_copies.size + 1)])
    return G, h


def max_ratio(problem: Problem, demand: np.ndarray) -> np.ndarray:
    """X of shape (rows, columns) maximising u with throughput(m, X) >= demand_m u for every job m."""
    shape = (len(problem.combos), len(problem.columns))
    free = np.flatnonzero(problem.runnable().flatten())
    G, h = ratio_rows(problem, demand, free)
    cost = np.zeros(free.size + 1)
    cost[-1] = -1.0
    z = _clarabel(cost, G, h) if (problem.multiplicity > 1).any() else _highs(cost, G, h)
    x = np.zeros(shape[0] * shape[1])
    x[free] = cleaned(z[:free.size])
    return x.reshape(shape)


def _clarabel(cost: np.ndarray, G: sp.csc_matrix, h: np.ndarray) -> np.ndarray:
    settings = clarabel.DefaultSettings()
    settings.verbose = False
    settings.direct_solve_method = "qdldl"  # "auto" picks a supernodal solver, 10x slower on these systems
    settings.iterative_refinement_enable = False  # halves the time; the optimum agrees to 1e-11 at 2,048 jobs
    result = clarabel.DefaultSolver(sp.csc_matrix((cost.size, cost.size)), cost, G, h,
                                    [clarabel.NonnegativeConeT(G.shape[0])], settings).solve()
    if result.status not in (clarabel.SolverStatus.Solved, clarabel.SolverStatus.AlmostSolved):
        raise RuntimeError(f"the allocation problem is {result.status}")
    return np.asarray(result.x)


def _highs(cost: np.ndarray, G: sp.csc_matrix, h: np.ndarray) -> np.ndarray:
    """HiGHS's interior point; Clarabel's where HiGHS stops short of its tolerances without crossover
    (status unknown, seen on heterogeneity-agnostic makespan problems, whose T is all ones)."""
    highs = highs_model(cost, G, np.full(G.shape[0], -INFINITY), h, np.full(cost.size, INFINITY), interior=True)
    z = solution(highs)
    return _clarabel(cost, G, h) if z is None else z
