"""POP: a large allocation problem solved as k small ones (Narayanan et al., SOSP'21).

The jobs are split at random into k parts of equal size and each accelerator type's workers into
k equal shares; each part is allocated by the policy on its share alone, the parts in parallel
processes, and the allocations are put side by side. Policies whose objective and constraints
are sums or extremes over jobs with per-job terms (max-min fairness, makespan, finish-time
fairness, throughput and cost) lose little: POP's paper reports within about 1.5% of the full
optimum on Gavel's policies once each part holds a few dozen jobs.

Parts are sticky: a job keeps its part while it is active, arrivals fill the smallest parts, and a
part is re-solved only when what the policy reads about its jobs changed (incremental rounds);
for a policy that reads progress (steps done, time elapsed) every part changes every round.
"""

from __future__ import annotations

import atexit
import hashlib
import multiprocessing
import os
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import numpy as np

from megapipe.cluster.core.policies.base import Policy
from megapipe.cluster.core.problem import Problem
from megapipe.errors import ConfigError


def check_partitions(k: int, jobs: int | None, counts: dict, policy: Policy) -> None:
    """Refuse a number of parts POP cannot use, in one sentence."""
    if k < 1:
        raise ConfigError(f"--pop-partitions {k} must be at least 1 (1 solves the whole problem at once).")
    if k == 1:
        return
    if policy.unpartitionable:
        raise ConfigError(f"--pop-partitions cannot split policy {policy.name}: {policy.unpartitionable}; "
                          f"leave --pop-partitions out for it.")
    if jobs is not None and k > jobs:
        raise ConfigError(f"--pop-partitions {k} exceeds the {jobs} jobs of the trace; use at most {jobs}.")
    for worker_type, count in counts.items():
        if k > count:
            raise ConfigError(f"--pop-partitions {k} exceeds the {count} {worker_type} workers (each part needs a "
                              f"share of every type); use at most {min(counts.values())}.")


def split_counts(counts: dict, k: int) -> list[dict]:
    """Each type's workers in k shares as equal as integers allow; the extra ones are dealt round-robin
    across the types, so that the parts' totals differ by at most one worker."""
    shares = [{worker_type: count // k for worker_type, count in counts.items()} for _ in range(k)]
    dealt = 0
    for worker_type, count in sorted(counts.items()):
        for _ in range(count % k):
            shares[dealt % k][worker_type] += 1
            dealt += 1
    return shares


def subproblem(problem: Problem, members: np.ndarray, counts: dict) -> tuple[Problem, np.ndarray]:
    """The part's problem on its share of the workers, and the full problem's row of each of its rows."""
    index_of = np.full(len(problem.jobs), -1)
    index_of[members] = np.arange(len(members))
    rows = [r for r, combo in enumerate(problem.combos) if all(index_of[m] >= 0 for m in combo)]
    part = replace(problem, jobs=[problem.jobs[m] for m in members],
                   combos=[tuple(int(index_of[m]) for m in problem.combos[r]) for r in rows], counts=counts,
                   T=problem.T[rows], steps_remaining=problem.steps_remaining[members],
                   elapsed=problem.elapsed[members], slo_remaining=problem.slo_remaining[members],
                   multiplicity=problem.multiplicity[members])
    return part, np.array(rows, dtype=np.int64)


def fingerprint(problem: Problem, progress: bool) -> str:
    """What a policy reads of a part: its jobs, their rows of T, weights and workers, and with
    ``progress`` their steps remaining and time elapsed."""
    digest = hashlib.sha256()
    digest.update(repr(([j.job_id for j in problem.jobs], problem.combos, sorted(problem.counts.items()))).encode())
    for array in (problem.T, problem.weights) + ((problem.steps_remaining, problem.elapsed, problem.slo_remaining)
                                                if progress else ()):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _allocate(policy: Policy, problem: Problem) -> np.ndarray:
    return policy.allocate(problem)


class Partitioned(Policy):
    """``policy`` applied by POP over ``partitions`` parts, solved in ``processes`` worker processes."""

    def __init__(self, policy: Policy, partitions: int, seed: int = 0, processes: int | None = None):
        check_partitions(partitions, None, {}, policy)
        self.policy, self.partitions = policy, partitions
        for name in ("name", "space_sharing", "heterogeneity_aware", "placement_sensitive", "skip_zero_priority",
                     "partners", "reads_progress"):
            setattr(self, name, getattr(policy, name))
        self.rng = random.Random(seed)
        self.processes = processes or min(partitions, os.cpu_count() or 1)
        self.part_of: dict[int, int] = {}  # job id -> part
        self.solved: dict[int, tuple[str, np.ndarray]] = {}  # part -> (fingerprint, X of the part)
        self.solves = 0  # parts solved so far (the rest were reused)
        self._pool = None

    def allocate(self, problem: Problem) -> np.ndarray:
        if len(problem.jobs) < self.partitions or min(problem.counts.values(), default=0) < self.partitions:
            # some part would hold no job, or no worker of a type: solve whole (the problem is small then)
            self.solves += 1
            return self.policy.allocate(problem)
        members = self.assign(problem.jobs)
        shares = split_counts(problem.counts, self.partitions)
        parts = [subproblem(problem, members[p], shares[p]) for p in range(self.partitions)]
        prints = [fingerprint(part, self.reads_progress) for part, _ in parts]
        stale = [p for p in range(self.partitions) if self.solved.get(p, ("",))[0] != prints[p]]
        for p, x in zip(stale, self._solve([parts[p][0] for p in stale])):
            self.solved[p] = (prints[p], x)
        self.solves += len(stale)
        x = np.zeros((len(problem.combos), len(problem.columns)))
        for p, (_, rows) in enumerate(parts):
            x[rows] = self.solved[p][1]
        return x

    def pair_groups(self, jobs: list) -> list[int] | None:
        """Pairs are chosen inside each part: a pair across parts could not run (each part is solved alone),
        and every job keeps its full number of partners within its part."""
        if not self.space_sharing:
            return None
        group = np.zeros(len(jobs), dtype=np.int64)
        for part, members in enumerate(self.assign(jobs)):
            group[members] = part
        return group.tolist()

    def assign(self, jobs: list) -> list[np.ndarray]:
        """Job indices of each part: sticky; an arrival joins, among the parts with the fewest jobs of
        its kind (type and scale factor), one with the fewest jobs, at random, so every part gets a
        near-equal mix of kinds (stratified sampling: a purely random split leaves a part with a
        kind's jobs and too small a share of the accelerators they are fast on, 1.9% off the full
        optimum at 2,048 jobs in 16 parts instead of 0.6%); part sizes stay within one of each other."""
        ids = [job.job_id for job in jobs]
        kind = {job.job_id: job.key for job in jobs}
        self.part_of = {i: p for i, p in self.part_of.items() if i in kind}
        sizes = np.bincount(list(self.part_of.values()), minlength=self.partitions)
        by_kind = {}
        for i, p in self.part_of.items():
            by_kind.setdefault(kind[i], np.zeros(self.partitions, dtype=np.int64))[p] += 1
        for i in ids:
            if i in self.part_of:
                continue
            same = by_kind.setdefault(kind[i], np.zeros(self.partitions, dtype=np.int64))
            candidates = np.flatnonzero(same == same.min())
            candidates = candidates[sizes[candidates] == sizes[candidates].min()]
            part = int(candidates[self.rng.randrange(len(candidates))])
            self.part_of[i], sizes[part], same[part] = part, sizes[part] + 1, same[part] + 1
        while sizes.max() - sizes.min() > 1:  # departures left parts uneven: move the newest jobs over
            largest, smallest = int(sizes.argmax()), int(sizes.argmin())
            moved = max(i for i, p in self.part_of.items() if p == largest)
            self.part_of[moved] = smallest
            sizes[largest] -= 1
            sizes[smallest] += 1
        index = {i: m for m, i in enumerate(ids)}
        return [np.array(sorted(index[i] for i, p in self.part_of.items() if p == part), dtype=np.int64)
                for part in range(self.partitions)]

    def _solve(self, problems: list[Problem]) -> list[np.ndarray]:
        if self.processes == 1 or len(problems) < 2:
            return [self.policy.allocate(p) for p in problems]
        return list(self.pool().map(_allocate, [self.policy] * len(problems), problems))

    def pool(self) -> ProcessPoolExecutor:
        """Worker processes, started once (spawned: the service forks nothing from its threads)."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
            atexit.register(self.close)
        return self._pool

    def close(self) -> None:
        """Stop the worker processes (started again if another solve needs them)."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def objective(self, problem: Problem, x: np.ndarray) -> float:
        return self.policy.objective(problem, x)

    def __getstate__(self):
        return {**self.__dict__, "_pool": None}
