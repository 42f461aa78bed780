"""The allocation problem of seed 002 section 5.3.1: rows of X, columns, T, and constraints (5.1)-(5.3).

Rows are job combinations: every active job alone and, with space sharing, every pair of jobs with
the same scale factor that can share an accelerator. Columns are accelerator types and, with
placement sensitivity, their ``_unconsolidated`` twins (multi-worker jobs spread over servers),
which draw on the same accelerators. ``A @ vec(X)`` is every job's effective throughput
``throughput(m, X) = sum_{k in C_m} sum_j T_kjm X_kj``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import scipy.sparse as sp

from megapipe.cluster.core.cluster_spec import ClusterSpec
from megapipe.cluster.core.jobs import Job
from megapipe.cluster.core.throughputs import UNCONSOLIDATED, ThroughputTable
from megapipe.cluster.core.lp import cp


@dataclass
class Problem:
    jobs: list[Job]
    combos: list[tuple[int, ...]]  # rows: indices into jobs
    columns: list[str]  # column worker types
    accelerator_of: list[str]  # column -> accelerator type whose workers it uses
    counts: dict  # accelerator type -> workers
    T: np.ndarray  # (rows, columns, 2): steps/s of each member of the combination
    steps_remaining: np.ndarray  # per job
    elapsed: np.ndarray  # seconds since each job arrived
    slo_remaining: np.ndarray = None  # seconds left to each job's SLO; inf for none
    prices: dict = field(default_factory=dict)  # accelerator type -> $ per accelerator-hour

    @property
    def scale(self) -> np.ndarray:
        return np.array([self.jobs[c[0]].scale_factor for c in self.combos], dtype=float)

    @property
    def weights(self) -> np.ndarray:
        return np.array([job.priority_weight for job in self.jobs], dtype=float)

    def runnable(self) -> np.ndarray:
        """(rows, columns) mask: every member of the combination has a positive throughput there."""
        members = np.array([len(c) for c in self.combos])
        ok = self.T[:, :, 0] > 0
        return ok & np.where(members[:, None] > 1, self.T[:, :, 1] > 0, True)

    def throughput_matrix(self) -> sp.csr_matrix:
        """A with throughput(m, X) = (A @ X.flatten())[m]."""
        n_cols = len(self.columns)
        rows, cols, vals = [], [], []
        for r, combo in enumerate(self.combos):
            for position, m in enumerate(combo):
                for j in range(n_cols):
                    if self.T[r, j, position] > 0:
                        rows.append(m)
                        cols.append(r * n_cols + j)
                        vals.append(self.T[r, j, position])
        return sp.csr_matrix((vals, (rows, cols)), shape=(len(self.jobs), len(self.combos) * n_cols))

    def membership(self) -> sp.csr_matrix:
        """M with (M @ X.flatten())[m] = total time fraction of job m over its combinations (5.2)."""
        n_cols = len(self.columns)
        rows, cols = [], []
        for r, combo in enumerate(self.combos):
            for m in combo:
                rows += [m] * n_cols
                cols += range(r * n_cols, (r + 1) * n_cols)
        return sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(self.jobs), len(self.combos) * n_cols))

    def capacity(self) -> tuple[sp.csr_matrix, np.ndarray]:
        """(C, n) with C @ X.flatten() <= n: accelerators used of each type (5.3)."""
        accelerators = sorted(self.counts)
        n_cols, scale = len(self.columns), self.scale
        rows, cols, vals = [], [], []
        for r in range(len(self.combos)):
            for j, acc in enumerate(self.accelerator_of):
                rows.append(accelerators.index(acc))
                cols.append(r * n_cols + j)
                vals.append(scale[r])
        matrix = sp.csr_matrix((vals, (rows, cols)), shape=(len(accelerators), len(self.combos) * n_cols))
        return matrix, np.array([self.counts[a] for a in accelerators], dtype=float)

    def constraints(self, x: cp.Variable) -> list:
        """(5.1)-(5.3) on a flattened X, plus X = 0 where a combination cannot run."""
        capacity, workers = self.capacity()
        blocked = np.flatnonzero(~self.runnable().flatten())
        result = [x >= 0, x <= 1, self.membership() @ x <= 1, capacity @ x <= workers]
        if blocked.size:
            result.append(x[blocked] == 0)
        return result

    def agnostic(self) -> "Problem":
        """The same problem as a heterogeneity-agnostic policy sees it: every runnable entry is 1."""
        return replace(self, T=(self.T > 0).astype(float))

    def equal_share(self) -> np.ndarray:
        """Per job, throughput(m, X^equal): equal time on every accelerator of the cluster (section 5.4.1)."""
        share = np.array([0.0 if c.endswith(UNCONSOLIDATED) else self.counts[a]
                          for c, a in zip(self.columns, self.accelerator_of)], dtype=float)
        share /= share.sum() if share.sum() else 1.0
        singles = self.single_rows()
        return np.array([max(self.T[singles[m], :, 0] @ share, 1e-12) for m in range(len(self.jobs))])

    def single_rows(self) -> list[int]:
        """Row of each job alone."""
        rows = [0] * len(self.jobs)
        for r, combo in enumerate(self.combos):
            if len(combo) == 1:
                rows[combo[0]] = r
        return rows

    def isolated_share(self) -> np.ndarray:
        """X^isolated over single rows: 1/n of every accelerator type, capped at 1 per job (Themis, section 5.4.2)."""
        x = np.zeros((len(self.combos), len(self.columns)))
        scale, rows, n = self.scale, self.single_rows(), len(self.jobs)
        for m in range(n):
            for j, acc in enumerate(self.accelerator_of):
                if not self.columns[j].endswith(UNCONSOLIDATED):
                    x[rows[m], j] = self.counts[acc] / n / scale[rows[m]]
            total = x[rows[m]].sum()
            if total > 1:
                x[rows[m]] /= total
        return x

    def by_key(self, x: np.ndarray) -> dict:
        """X as the mechanism reads it: (job ids of a combination) -> accelerator type -> time fraction."""
        allocation = {}
        for r, combo in enumerate(self.combos):
            key = tuple(self.jobs[m].job_id for m in combo)
            per_type = {acc: 0.0 for acc in self.counts}
            for j, acc in enumerate(self.accelerator_of):
                per_type[acc] += float(x[r, j])
            allocation[key] = per_type
        return allocation

    def throughput(self, x: np.ndarray) -> np.ndarray:
        """throughput(m, X) for a concrete X of shape (rows, columns)."""
        return self.throughput_matrix() @ x.flatten()


def build_problem(jobs: list[Job], table: ThroughputTable, cluster: ClusterSpec, now: float = 0.0,
                  steps_done: dict | None = None, space_sharing: bool = False,
                  placement_sensitive: bool = False, prices: dict | None = None) -> Problem:
    """The allocation problem for the active ``jobs`` at time ``now``."""
    steps_done = steps_done or {}
    accelerators = cluster.worker_types
    columns, accelerator_of = list(accelerators), list(accelerators)
    if placement_sensitive:
        for acc in accelerators:
            if table.has_unconsolidated(acc):
                columns.append(acc + UNCONSOLIDATED)
                accelerator_of.append(acc)
    combos = [(m,) for m in range(len(jobs))]
    if space_sharing:
        combos += [(a, b) for a in range(len(jobs)) for b in range(a + 1, len(jobs))
                   if jobs[a].scale_factor == jobs[b].scale_factor
                   and any(table.colocated(jobs[a].key, jobs[b].key, w)[0] > 0 for w in accelerators)]
    T = np.zeros((len(combos), len(columns), 2))
    for r, combo in enumerate(combos):
        for j, column in enumerate(columns):
            if len(combo) == 1:
                job = jobs[combo[0]]
                spread_only = column.endswith(UNCONSOLIDATED) and job.scale_factor == 1
                T[r, j, 0] = 0.0 if spread_only else table.alone(job.job_type, job.scale_factor, column)
            elif not column.endswith(UNCONSOLIDATED):
                T[r, j] = table.colocated(jobs[combo[0]].key, jobs[combo[1]].key, column)
    remaining = np.array([job.total_steps - steps_done.get(job.job_id, 0) for job in jobs], dtype=float)
    elapsed = np.array([max(now - job.arrival_time, 0.0) for job in jobs])
    slo_remaining = np.array([np.inf if job.slo is None else job.arrival_time + job.slo - now for job in jobs])
    return Problem(jobs, combos, columns, accelerator_of, dict(cluster.counts), T, remaining, elapsed,
                   slo_remaining, dict(prices or {}))
