"""Max-min fairness by water filling, single-level or hierarchical (seed 002 section 5.4.3).

Each iteration solves an LP that raises the normalised throughput of every non-bottlenecked job
with a positive weight at a rate proportional to its weight while no job drops below the level it
already has, then a MILP that finds the bottlenecked jobs: the largest set of jobs that can all be
improved at once in one allocation; the rest are bottlenecked and keep their level. Weights come
from each entity's policy: ``fairness`` splits the entity's weight over its jobs by priority
weight, ``fifo`` gives it all to the earliest non-bottlenecked job. Iterations stop when every job
is bottlenecked.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from megapipe.cluster.core.lp import INFINITY, highs_model, solution
from megapipe.cluster.core.policies.base import Policy, shape_of
from megapipe.cluster.core.symmetry import solve_by_class, throughput_signature
from megapipe.errors import ConfigError

ENTITY_POLICIES = ("fairness", "fifo")


class WaterFilling(Policy):
    name = "max_min_fairness_water_filling"
    unpartitionable = "an entity's weight is shared by its jobs in every part"

    def __init__(self, entity_weights: dict | None = None, entity_policies: dict | None = None,
                 max_iterations: int | None = None):
        """``max_iterations``: stop after that many LP + MILP iterations (the original system stopped after 2
        at 2,048 jobs); None: until every job is bottlenecked, as the chapter defines it."""
        self.max_iterations = max_iterations
        self.entity_weights = dict(entity_weights or {})
        self.entity_policies = dict(entity_policies or {})
        for entity, policy in self.entity_policies.items():
            if policy not in ENTITY_POLICIES:
                raise ConfigError(f"entity {entity!r} has policy {policy!r}; choose one of {', '.join(ENTITY_POLICIES)}.")

    def job_weights(self, problem, bottlenecked: np.ndarray) -> np.ndarray:
        """Each entity's weight spread over its non-bottlenecked jobs by the entity's policy.

        A job of a reduced problem (symmetry.py) stands for ``multiplicity`` jobs, each with this weight.
        """
        weights = np.zeros(len(problem.jobs))
        for entity in sorted({job.entity for job in problem.jobs}):
            members = [m for m, job in enumerate(problem.jobs) if job.entity == entity and not bottlenecked[m]]
            if not members:
                continue
            share = self.entity_weights.get(entity, 1.0)
            if self.entity_policies.get(entity, "fairness") == "fifo":
                first = min(members, key=lambda m: (problem.jobs[m].arrival_time, problem.jobs[m].job_id))
                weights[first] = share
            else:
                priority = np.array([problem.jobs[m].priority_weight for m in members])
                weights[members] = share * priority / (priority @ problem.multiplicity[members])
        return weights

    def signature(self, problem, m: int) -> tuple:
        """What water filling reads about a job: max-min fairness's inputs, its entity, and under a
        FIFO entity the job itself (its place in the queue)."""
        job = problem.jobs[m]
        fifo = self.entity_policies.get(job.entity, "fairness") == "fifo"
        return throughput_signature(problem, m) + (job.entity, job.job_id if fifo else None)

    def allocate(self, problem):
        return solve_by_class(problem, self.signature, self._fill)

    def _fill(self, problem):
        n = len(problem.jobs)
        scale = np.array([job.scale_factor for job in problem.jobs], dtype=float)
        free = np.flatnonzero(problem.runnable().flatten())
        normalised = (sp.diags(scale / problem.equal_share()) @ problem.throughput_matrix()).tocsc()[:, free]
        capacity, workers = problem.capacity()
        limits = (sp.vstack([problem.membership()[:, free], capacity[:, free]], format="csc"),
                  np.concatenate([np.ones(n), workers]))
        raise_level = RaiseLevel(normalised, limits)
        level, bottlenecked = np.zeros(n), np.zeros(n, dtype=bool)
        x_free, iterations = np.zeros(free.size), 0
        while not bottlenecked.all() and iterations != self.max_iterations:
            iterations += 1
            weights = self.job_weights(problem, bottlenecked)
            rising = ~bottlenecked & (weights > 0)
            if not rising.any():
                break
            solved = raise_level(level, weights)
            if solved is None:
                break
            theta, x_free = solved
            level = np.where(rising, level + theta * weights, level)
            improvable = _improvable(problem, normalised, limits, level * (1 - 1e-7), rising)
            newly = rising & ~improvable
            bottlenecked |= newly if newly.any() else rising
        x = np.zeros(len(problem.combos) * len(problem.columns))
        x[free] = np.clip(x_free, 0, 1)
        return x.reshape(shape_of(problem))


class RaiseLevel:
    """The iteration's LP, max theta s.t. normalised X >= level + theta * weights and (5.1)-(5.3), kept
    in one HiGHS instance: each iteration changes only the level and the weights, so the simplex
    starts from the previous iteration's optimal basis (a warm start) instead of from scratch."""

    def __init__(self, normalised: sp.csc_matrix, limits: tuple):
        rows, self.jobs, self.theta = normalised.shape[0], normalised.shape[0], normalised.shape[1]
        matrix = sp.vstack([sp.hstack([normalised, sp.csc_matrix((rows, 1))]),
                            sp.hstack([limits[0], sp.csc_matrix((limits[0].shape[0], 1))])], format="csc")
        cost = np.zeros(self.theta + 1)
        cost[-1] = -1.0
        self.highs = highs_model(cost, matrix, np.full(matrix.shape[0], -INFINITY),
                                 np.concatenate([np.full(rows, INFINITY), limits[1]]),
                                 np.append(np.ones(self.theta), INFINITY))

    def __call__(self, level: np.ndarray, weights: np.ndarray):
        """(theta, X over the free entries), or None when the LP has no optimum."""
        for m, weight in enumerate(weights):
            self.highs.changeCoeff(m, self.theta, -float(weight))
        self.highs.changeRowsBounds(self.jobs, np.arange(self.jobs, dtype=np.int32), level,
                                    np.full(self.jobs, INFINITY))
        z = solution(self.highs)
        return None if z is None else (z[-1], z[:-1])


def _improvable(problem, normalised, limits, level, rising) -> np.ndarray:
    """MILP: the most jobs (counted with multiplicity) whose normalised throughput can rise above
    their level together."""
    n, variables = normalised.shape
    delta = 1e-4 * max(level.max(), 1e-6)
    matrix = sp.vstack([sp.hstack([normalised, sp.csc_matrix((n, n))]),
                        sp.hstack([normalised, -delta * sp.identity(n, format="csc")]),
                        sp.hstack([limits[0], sp.csc_matrix((limits[0].shape[0], n))])], format="csc")
    cost = np.concatenate([np.zeros(variables), -problem.multiplicity])
    highs = highs_model(cost, matrix, np.concatenate([level, level, np.full(limits[0].shape[0], -INFINITY)]),
                        np.concatenate([np.full(2 * n, INFINITY), limits[1]]),
                        np.concatenate([np.ones(variables), rising.astype(float)]),
                        integer=np.concatenate([np.zeros(variables, bool), np.ones(n, bool)]))
    z = solution(highs)
    if z is None:
        return np.zeros(n, dtype=bool)
    return z[variables:] > 0.5
