"""What every policy is: a pure function from a Problem to an allocation X (rows x columns)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import cvxpy as cp
import numpy as np

from megapipe.cluster.problem import Problem


class Policy(ABC):
    """``allocate(problem)`` returns X of shape (rows, columns) satisfying (5.1)-(5.3).

    ``space_sharing``: the problem must carry pair rows. ``heterogeneity_aware``: the mechanism
    keeps accelerator types in a fixed order (the agnostic ones are shuffled each round, as
    the original system does, since they have no preference among types).
    """

    name = ""
    space_sharing = False
    heterogeneity_aware = True
    placement_sensitive = False
    skip_zero_priority = False  # FIFO: never run a job the allocation gives no time

    @abstractmethod
    def allocate(self, problem: Problem) -> np.ndarray:
        """X for ``problem``."""


def variable(problem: Problem) -> cp.Variable:
    return cp.Variable(len(problem.combos) * len(problem.columns))


def solve(problem: cp.Problem, x: cp.Variable, shape: tuple, solver: str = "CLARABEL") -> np.ndarray:
    """Solve and return X clipped into [0, 1]; raises if the solver found no optimum."""
    problem.solve(solver=solver)
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) or x.value is None:
        raise RuntimeError(f"the allocation problem is {problem.status}")
    return np.clip(x.value, 0.0, 1.0).reshape(shape)


def shape_of(problem: Problem) -> tuple[int, int]:
    return len(problem.combos), len(problem.columns)


def scaled_throughput(problem: Problem, x: cp.Variable):
    """throughput(m, X) / throughput(m, X^equal) * scale_factor_m / w_m: the LAS quantity (section 5.4.1)."""
    scale = np.array([job.scale_factor for job in problem.jobs], dtype=float)
    factor = scale / problem.equal_share() / problem.weights
    return cp.multiply(factor, problem.throughput_matrix() @ x)
