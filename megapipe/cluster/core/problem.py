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
from megapipe.cluster.core.pairs import PARTNERS_PER_JOB, candidate_pairs
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
    multiplicity: np.ndarray = None  # per job: how many interchangeable jobs it stands for (symmetry.py)

    def __post_init__(self):
        if self.multiplicity is None:
            self.multiplicity = np.ones(len(self.jobs))

    @property
    def scale(self) -> np.ndarray:
        return np.array([self.jobs[c[0]].scale_factor for c in self.combos], dtype=float)

    @property
    def weights(self) -> np.ndarray:
        return np.array([job.priority_weight for job in self.jobs], dtype=float)

    def members(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row, its first job and its second (-1 for a job alone)."""
        first = np.array([c[0] for c in self.combos], dtype=np.int64)
        second = np.array([c[1] if len(c) > 1 else -1 for c in self.combos], dtype=np.int64)
        return first, second

    def runnable(self) -> np.ndarray:
        """(rows, columns) mask: every member of the combination has a positive throughput there."""
        paired = self.members()[1] >= 0
        ok = self.T[:, :, 0] > 0
        return ok & np.where(paired[:, None], self.T[:, :, 1] > 0, True)

    def _per_member(self, values: np.ndarray) -> sp.csr_matrix:
        """(jobs, rows * columns): each member's entry of ``values`` (rows, columns, 2) at its job's row."""
        first, second = self.members()
        n_rows, n_cols = len(self.combos), len(self.columns)
        flat = np.arange(n_rows * n_cols).reshape(n_rows, n_cols)
        rows, cols, vals = [], [], []
        for position, job in ((0, first), (1, second)):
            mask = (job[:, None] >= 0) & (values[:, :, position] != 0)
            rows.append(np.broadcast_to(job[:, None], mask.shape)[mask])
            cols.append(flat[mask])
            vals.append(values[:, :, position][mask])
        return sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                             shape=(len(self.jobs), n_rows * n_cols))

    def throughput_matrix(self) -> sp.csr_matrix:
        """A with throughput(m, X) = (A @ X.flatten())[m]."""
        return self._per_member(np.where(self.T > 0, self.T, 0.0))

    def membership(self) -> sp.csr_matrix:
        """M with (M @ X.flatten())[m] = total time fraction of job m over its combinations (5.2)."""
        return self._per_member(np.ones_like(self.T))

    def capacity(self) -> tuple[sp.csr_matrix, np.ndarray]:
        """(C, n) with C @ X.flatten() <= n: accelerators used of each type (5.3).

        A row stands for ``multiplicity`` identical combinations (1 unless symmetry.py merged jobs).
        """
        accelerators = sorted(self.counts)
        n_rows, n_cols = len(self.combos), len(self.columns)
        weight = self.scale * self.multiplicity[self.members()[0]]
        type_of = np.array([accelerators.index(acc) for acc in self.accelerator_of])
        matrix = sp.csr_matrix((np.repeat(weight, n_cols), (np.tile(type_of, n_rows), np.arange(n_rows * n_cols))),
                               shape=(len(accelerators), n_rows * n_cols))
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
        return np.maximum(self.T[self.single_rows(), :, 0] @ share, 1e-12)

    def single_rows(self) -> np.ndarray:
        """Row of each job alone."""
        first, second = self.members()
        rows = np.zeros(len(self.jobs), dtype=np.int64)
        alone = np.flatnonzero(second < 0)
        rows[first[alone]] = alone
        return rows

    def isolated_share(self) -> np.ndarray:
        """X^isolated over single rows: 1/n of every accelerator type, capped at 1 per job (Themis, section 5.4.2)."""
        x = np.zeros((len(self.combos), len(self.columns)))
        rows, n = self.single_rows(), self.multiplicity.sum()
        per_worker = np.array([0.0 if c.endswith(UNCONSOLIDATED) else self.counts[a] / n
                               for c, a in zip(self.columns, self.accelerator_of)])
        x[rows] = per_worker[None, :] / self.scale[rows][:, None]
        total = x[rows].sum(axis=1)
        x[rows] /= np.maximum(total, 1.0)[:, None]
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
                  placement_sensitive: bool = False, prices: dict | None = None,
                  partners: int | None = PARTNERS_PER_JOB, groups: list[int] | None = None) -> Problem:
    """The allocation problem for the active ``jobs`` at time ``now``.

    With ``space_sharing``, each job gets pair rows with ``partners`` others (pairs.py); None gives
    every co-locatable pair, the chapter's formulation; ``groups`` (POP's parts) keeps pairs inside a group.
    """
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
        combos += candidate_pairs(jobs, table, accelerators, partners, groups)
    T = np.zeros((len(combos), len(columns), 2))
    alone = {key: [0.0 if column.endswith(UNCONSOLIDATED) and key[1] == 1 else table.alone(key[0], key[1], column)
                   for column in columns] for key in {job.key for job in jobs}}
    T[:len(jobs), :, 0] = [alone[job.key] for job in jobs]
    shared = [j for j, column in enumerate(columns) if not column.endswith(UNCONSOLIDATED)]
    pair_rates = {}
    for r, (a, b) in enumerate(combos[len(jobs):], start=len(jobs)):
        keys = jobs[a].key, jobs[b].key
        if keys not in pair_rates:
            pair_rates[keys] = [table.colocated(*keys, columns[j]) for j in shared]
        T[r, shared] = pair_rates[keys]
    remaining = np.array([job.total_steps - steps_done.get(job.job_id, 0) for job in jobs], dtype=float)
    elapsed = np.array([max(now - job.arrival_time, 0.0) for job in jobs])
    slo_remaining = np.array([np.inf if job.slo is None else job.arrival_time + job.slo - now for job in jobs])
    return Problem(jobs, combos, columns, accelerator_of, dict(cluster.counts), T, remaining, elapsed,
                   slo_remaining, dict(prices or {}))
