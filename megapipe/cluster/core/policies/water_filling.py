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

import functools
import os
import sys

import numpy as np

from megapipe.cluster.core.policies.base import Policy, shape_of, variable
from megapipe.errors import ConfigError
from megapipe.cluster.core.lp import cp

ENTITY_POLICIES = ("fairness", "fifo")


@functools.cache
def _silence_highs_banner() -> None:
    """HiGHS prints a banner to the process's stdout the first time it starts; send that one to /dev/null
    so that stdout carries only what tools print (scripts read tools/cluster.py's last lines)."""
    import highspy

    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


class WaterFilling(Policy):
    name = "max_min_fairness_water_filling"

    def __init__(self, entity_weights: dict | None = None, entity_policies: dict | None = None):
        self.entity_weights = dict(entity_weights or {})
        self.entity_policies = dict(entity_policies or {})
        for entity, policy in self.entity_policies.items():
            if policy not in ENTITY_POLICIES:
                raise ConfigError(f"entity {entity!r} has policy {policy!r}; choose one of {', '.join(ENTITY_POLICIES)}.")

    def job_weights(self, problem, bottlenecked: np.ndarray) -> np.ndarray:
        """Each entity's weight spread over its non-bottlenecked jobs by the entity's policy."""
        weights = np.zeros(len(problem.jobs))
        entities = sorted({job.entity for job in problem.jobs})
        for entity in entities:
            members = [m for m, job in enumerate(problem.jobs) if job.entity == entity and not bottlenecked[m]]
            if not members:
                continue
            share = self.entity_weights.get(entity, 1.0)
            if self.entity_policies.get(entity, "fairness") == "fifo":
                first = min(members, key=lambda m: (problem.jobs[m].arrival_time, problem.jobs[m].job_id))
                weights[first] = share
            else:
                priority = np.array([problem.jobs[m].priority_weight for m in members])
                weights[members] = share * priority / priority.sum()
        return weights

    def allocate(self, problem):
        _silence_highs_banner()
        n = len(problem.jobs)
        scale = np.array([job.scale_factor for job in problem.jobs], dtype=float)
        normalised = (scale / problem.equal_share())[:, None] * problem.throughput_matrix().toarray()
        constraints_of = problem.constraints
        level, bottlenecked = np.zeros(n), np.zeros(n, dtype=bool)
        x_value = np.zeros(shape_of(problem))
        while not bottlenecked.all():
            weights = self.job_weights(problem, bottlenecked)
            rising = ~bottlenecked & (weights > 0)
            if not rising.any():
                break
            x, theta = variable(problem), cp.Variable(nonneg=True)
            value = normalised @ x
            lp = cp.Problem(cp.Maximize(theta), constraints_of(x) + [value >= level + theta * weights])
            lp.solve(solver="HIGHS")
            if x.value is None:
                break
            level = np.where(rising, level + theta.value * weights, level)
            x_value = np.clip(x.value, 0, 1).reshape(shape_of(problem))
            improvable = self._improvable(problem, normalised, level * (1 - 1e-7), rising)
            newly = rising & ~improvable
            bottlenecked |= newly if newly.any() else rising
        return x_value

    @staticmethod
    def _improvable(problem, normalised, level, rising) -> np.ndarray:
        """MILP: the most jobs whose normalised throughput can rise above their level together."""
        x = variable(problem)
        z = cp.Variable(len(level), boolean=True)
        delta = 1e-4 * max(level.max(), 1e-6)
        value = normalised @ x
        constraints = problem.constraints(x) + [value >= level, value >= level + delta * z, z <= rising.astype(float)]
        milp = cp.Problem(cp.Maximize(cp.sum(z)), constraints)
        milp.solve(solver="HIGHS")
        if z.value is None:
            return np.zeros(len(level), dtype=bool)
        return z.value > 0.5
