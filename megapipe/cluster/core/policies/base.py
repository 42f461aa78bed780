"""What every policy is: a pure function from a Problem to an allocation X (rows x columns)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from megapipe.cluster.core.pairs import PARTNERS_PER_JOB
from megapipe.cluster.core.problem import Problem
from megapipe.cluster.core.lp import cleaned, cp


class Policy(ABC):
    """``allocate(problem)`` returns X of shape (rows, columns) satisfying (5.1)-(5.3).

    ``space_sharing``: the problem must carry pair rows. The mechanism visits accelerator types in
    the cluster's order for heterogeneity-aware and space-sharing policies and in a shuffled order
    each round for the others, which have no preference among types (the original system's rule).
    """

    name = ""
    space_sharing = False
    heterogeneity_aware = True
    placement_sensitive = False
    skip_zero_priority = False  # FIFO: never run a job the allocation gives no time
    partners = PARTNERS_PER_JOB  # with space_sharing: pair rows per job (pairs.py); None for every pair
    unpartitionable = ""  # why POP (pop.py) cannot split this policy; empty when it can
    reads_progress = False  # reads steps done or time elapsed, so an unchanged job set still needs a new solve

    @abstractmethod
    def allocate(self, problem: Problem) -> np.ndarray:
        """X for ``problem``."""

    def pair_groups(self, jobs: list) -> list[int] | None:
        """With space sharing, a group per job within which pairs are chosen (POP's parts); None: one group."""
        return None

    def seen(self, problem: Problem) -> Problem:
        """The problem as this policy sees it: its measured throughputs when heterogeneity-aware, else
        every runnable entry as 1."""
        return problem if self.heterogeneity_aware else problem.agnostic()


class AwareOrAgnostic(Policy):
    """A policy with two forms: heterogeneity-aware (``family`` + "_perf", the default) and agnostic
    (``family`` alone)."""

    family = ""

    def __init__(self, heterogeneity_aware: bool = True):
        self.heterogeneity_aware = heterogeneity_aware
        self.name = self.family + ("_perf" if heterogeneity_aware else "")


def variable(problem: Problem) -> cp.Variable:
    return cp.Variable(len(problem.combos) * len(problem.columns))


def solve(problem: cp.Problem, x: cp.Variable, shape: tuple, solver: str = "CLARABEL") -> np.ndarray:
    """Solve and return X clipped into [0, 1], solver noise set to 0; raises if there is no optimum.

    The default is an interior-point solver, as in the original system (ECOS): where the optimum
    is not unique (max-min fairness only fixes the minimum) it returns a central optimum, which
    spreads leftover capacity over the jobs instead of leaving it at a vertex's arbitrary choice.
    """
    problem.solve(solver=solver)
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) or x.value is None:
        raise RuntimeError(f"the allocation problem is {problem.status}")
    return cleaned(x.value).reshape(shape)


def shape_of(problem: Problem) -> tuple[int, int]:
    return len(problem.combos), len(problem.columns)


def fair_share(problem: Problem) -> np.ndarray:
    """throughput(m, X^equal) * w_m / scale_factor_m: max-min fairness maximises the least ratio of
    throughput(m, X) to it (section 5.4.1)."""
    scale = np.array([job.scale_factor for job in problem.jobs], dtype=float)
    return problem.equal_share() * problem.weights / scale
