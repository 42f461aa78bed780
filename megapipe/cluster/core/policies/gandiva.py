"""Gandiva-style ad-hoc space sharing, the chapter's baseline (section 5.7).

While the jobs fit in the cluster they get equal time shares; when they do not, jobs are paired at
random (same scale factor) and the pairs share accelerators; a pair whose summed normalised
throughput falls below 1 is split again. The pairing is state carried across allocations.
"""

from __future__ import annotations

import random

import numpy as np

from megapipe.cluster.core.policies.base import Policy


class Gandiva(Policy):
    name = "gandiva"
    space_sharing = True
    unpartitionable = "it pairs jobs at random and solves no optimisation problem to split"
    partners = None  # pairs at random over every co-locatable pair, as the original baseline does
    heterogeneity_aware = False

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.partner = {}  # job id -> job id it is paired with (None: alone)

    def allocate(self, problem):
        ids = [job.job_id for job in problem.jobs]
        row_of = {tuple(ids[m] for m in combo): r for r, combo in enumerate(problem.combos)}
        self._forget_stale(problem, ids, row_of)
        demand = sum(job.scale_factor for job in problem.jobs)
        if demand <= sum(problem.counts.values()):
            chosen = [row_of[(i,)] for i in ids]
        else:
            self._pair_new(problem, ids, row_of)
            chosen = sorted({row_of[self._row_key(i)] for i in ids})
        return self._equal_split(problem, chosen)

    def _row_key(self, job_id):
        other = self.partner.get(job_id)
        return (job_id,) if other is None else tuple(sorted((job_id, other)))

    def _forget_stale(self, problem, ids, row_of):
        active, singles = set(ids), problem.single_rows()
        for job_id, other in list(self.partner.items()):
            if job_id not in active or (other is not None and other not in active):
                self.partner.pop(job_id, None)
                if other in self.partner:
                    self.partner[other] = None
            elif other is not None and self._normalised(problem, singles, row_of[self._row_key(job_id)]) < 1.0:
                self.partner[job_id] = self.partner[other] = None

    @staticmethod
    def _normalised(problem, singles, row) -> float:
        """Summed throughput of the pair in ``row`` as fractions of each job alone; 0 where it cannot run."""
        total = 0.0
        for j in range(len(problem.columns)):
            for position, m in enumerate(problem.combos[row]):
                alone = problem.T[singles[m], j, 0]
                if problem.T[row, j, position] <= 0 or alone <= 0:
                    return 0.0
                total += problem.T[row, j, position] / alone
        return total

    def _pair_new(self, problem, ids, row_of):
        scale = {job.job_id: job.scale_factor for job in problem.jobs}
        waiting = [i for i in ids if self.partner.get(i) is None]
        for _ in range(len(waiting)):
            if len(waiting) < 2:
                break
            a, b = self.rng.sample(waiting, 2)
            if scale[a] != scale[b] or tuple(sorted((a, b))) not in row_of:
                continue
            waiting.remove(a)
            waiting.remove(b)
            self.partner[a], self.partner[b] = b, a
        for i in waiting:
            self.partner[i] = None

    @staticmethod
    def _equal_split(problem, rows) -> np.ndarray:
        x = np.zeros((len(problem.combos), len(problem.columns)))
        scale, runnable = problem.scale, problem.runnable()
        for r in rows:
            x[r] = [problem.counts[a] / len(rows) / scale[r] for a in problem.accelerator_of]
            x[r] *= runnable[r]
            if x[r].sum() > 1:
                x[r] /= x[r].sum()
        return x
