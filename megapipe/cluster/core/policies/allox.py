"""AlloX (Le et al.), the chapter's average-JCT baseline for single-worker jobs (section 5.7.3).

Jobs are matched to (accelerator, position-from-last) slots by a min-cost bipartite matching whose
cost k * p_ij (k-th from last on accelerator i, processing time p_ij = remaining steps / T_ij) sums
to the total completion time; each accelerator runs the job in its highest position now.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from megapipe.cluster.core.policies.base import Policy


class AlloX(Policy):
    name = "allox"
    unpartitionable = "its min-cost matching orders every job against every other on each accelerator"
    reads_progress = True

    def allocate(self, problem):
        singles = problem.single_rows()
        n = len(problem.jobs)
        accelerators = [j for j, acc in enumerate(problem.accelerator_of) for _ in range(problem.counts[acc])]
        T = problem.T[singles][:, accelerators, 0]
        with np.errstate(divide="ignore"):
            processing = np.where(T > 0, problem.steps_remaining[:, None] / np.where(T > 0, T, 1), 1e12)
        positions = np.arange(1, n + 1)
        cost = (processing[:, :, None] * positions[None, None, :]).reshape(n, -1)
        jobs, slots = linear_sum_assignment(cost)
        x = np.zeros((len(problem.combos), len(problem.columns)))
        first = {}
        for m, slot in zip(jobs, slots):
            accelerator, position = divmod(slot, n)
            if accelerator not in first or position > first[accelerator][1]:
                first[accelerator] = (m, position)
        for accelerator, (m, _) in first.items():
            if problem.jobs[m].scale_factor == 1 and T[m, accelerator] > 0:
                x[singles[m], accelerators[accelerator]] = 1.0
        return x
