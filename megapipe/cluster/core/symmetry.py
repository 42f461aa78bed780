"""Interchangeable jobs solved once: an exact reduction of the allocation problem.

Two jobs are interchangeable for a policy when every input it reads about them is equal (their
rows of T, scale factor, weight, and whatever else the policy names in its signature). The
policy's problem is then invariant under swapping them, and since it is convex, averaging any
optimum over those swaps is an optimum in which interchangeable jobs get equal rows of X. So the
problem can be solved over one representative per class, each standing for ``multiplicity``
jobs in the capacity constraint (5.3), and its row copied to every member: the same optimum with
as many variables as there are classes (26 job types at most in the chapter's traces, however
many jobs). Problems with pair rows are not reduced: a pair couples two specific jobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from megapipe.cluster.core.problem import Problem


def classes(problem: Problem, signature: Callable[[Problem, int], tuple]) -> np.ndarray:
    """Per job, the index of its class; classes numbered by first member."""
    first_seen, class_of = {}, np.empty(len(problem.jobs), dtype=np.int64)
    for m in range(len(problem.jobs)):
        class_of[m] = first_seen.setdefault(signature(problem, m), len(first_seen))
    return class_of


def reduce(problem: Problem, class_of: np.ndarray) -> Problem:
    """One job per class, its multiplicity the class's size."""
    representatives = np.unique(class_of, return_index=True)[1]
    return replace(problem, jobs=[problem.jobs[m] for m in representatives],
                   combos=[(c,) for c in range(len(representatives))], T=problem.T[representatives],
                   steps_remaining=problem.steps_remaining[representatives], elapsed=problem.elapsed[representatives],
                   slo_remaining=problem.slo_remaining[representatives],
                   multiplicity=np.bincount(class_of).astype(float))


def solve_by_class(problem: Problem, signature: Callable[[Problem, int], tuple],
                   solve: Callable[[Problem], np.ndarray]) -> np.ndarray:
    """``solve`` on the reduced problem, X expanded back to every job; pair problems solved whole."""
    if problem.combos != [(m,) for m in range(len(problem.jobs))] or not problem.jobs:
        return solve(problem)
    class_of = classes(problem, signature)
    if class_of.max() + 1 == len(problem.jobs):
        return solve(problem)
    return solve(reduce(problem, class_of))[class_of]


def throughput_signature(problem: Problem, m: int) -> tuple:
    """What max-min fairness reads about a job alone: its row of T, scale factor and priority weight."""
    job = problem.jobs[m]
    return problem.T[m].tobytes(), job.scale_factor, job.priority_weight
