"""PipeDream's partitioner: layers into stages, a replication factor per stage, and NOAM.

The hierarchical dynamic program of seed 002 section 2.4.1. The topology has levels; level k
joins m_k components of level k-1 by links of bandwidth B_k (level 0 is one device). With
T_l the forward+backward time of layer l per input, a_l its output bytes and w_l its weight
bytes:

  T^k(i->j, m) = max(A^{k-1}(i->j, m_{k-1}), 2 (m-1) sum_{l=i..j} w_l / B_k) / m
  A^k(i->j, m) = min over a split s and m' of max(A^k(i->s, m-m'), 2 a_s / B_k, T^k(s+1->j, m'))
  A^0(i->j)    = sum_{l=i..j} T_l

A^k is the time per input of the slowest stage. As in seed 001's flat version (Case 1), a
single stage replicated m times, T^k(i->j, m), is also a candidate, so pure data parallelism
can win. We peel the first stage off instead of the last one: the same pipelines are
enumerated (so the optimum is the same), but the number of inputs in flight at a stage is
then known when it is placed, which makes a per-device memory limit exact, something the
paper lacks. Under 1F1B-RR a stage with R replicas followed (itself included) by D devices
holds ceil(D / R) inputs in flight per replica (NOAM at the input stage, 1 at an unreplicated
output stage); with weight stashing each holds a weight version and an activation stash.
A stage replicated over m' components that have e devices downstream per replica sees the
same counts as one component with e / m' devices downstream, so each level's table is kept
per such e (only e = 0 without a memory limit). Each level is vectorised over (i, s, j) with
numpy, looping only over device counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np

from megapipe.errors import ConfigError
from megapipe.planner.units import human_bytes


@dataclass(frozen=True)
class Level:
    """m_k components of the level below, joined by links of ``bandwidth`` bytes per second."""

    count: int
    bandwidth: float


@dataclass(frozen=True)
class StageMemory:
    """Per-layer bytes: with weight stashing every in-flight input holds a weight version and a stash."""

    version_bytes: Sequence[float]
    state_bytes: Sequence[float]  # held once per device: gradients and optimizer state
    stash_bytes: Sequence[float]
    capacity: float  # bytes per device


@dataclass(frozen=True)
class PartitionProblem:
    compute: Sequence[float]  # T_l: forward + backward seconds per input
    activation_bytes: Sequence[float]  # a_l: output of layer l, sent forward (and its gradient backward)
    weight_bytes: Sequence[float]  # w_l: what data parallelism synchronises
    levels: Sequence[Level]  # lowest first
    memory: Optional[StageMemory] = None


@dataclass(frozen=True)
class Stage:
    start: int  # first layer
    end: int  # one past the last layer
    replicas: int
    in_flight: int  # inputs each replica holds under 1F1B-RR


@dataclass(frozen=True)
class Partition:
    stages: tuple[Stage, ...]
    time_per_input: float  # the slowest stage's time per input, A^L(0->N, m_L)

    @property
    def workers(self) -> int:
        return sum(stage.replicas for stage in self.stages)

    @property
    def noam(self) -> int:
        """NUM_OPT_ACTIVE_MINIBATCHES = ceil(workers / replicas of the input stage)."""
        return math.ceil(self.workers / self.stages[0].replicas)

    @property
    def config_name(self) -> str:
        """The seeds' notation: "2-1" is a 2-way replicated stage followed by one worker."""
        return "-".join(str(stage.replicas) for stage in self.stages)


def in_flight_counts(replicas: Sequence[int]) -> list[int]:
    """Inputs in flight per replica of each stage: ceil(devices from the stage on / its replicas)."""
    return [math.ceil(sum(replicas[k:]) / replicas[k]) for k in range(len(replicas))]


def _segment_sums(values: np.ndarray, below: float = np.inf) -> np.ndarray:
    """[i, j] = sum of values[i..j] for j >= i, ``below`` under the diagonal (no such segment)."""
    prefix = np.concatenate([[0.0], np.cumsum(values, dtype=float)])
    sums = prefix[None, 1:] - prefix[:-1, None]
    return np.where(np.triu(np.ones_like(sums, dtype=bool)), sums, below)


class _Solver:
    def __init__(self, problem: PartitionProblem):
        self.levels = list(problem.levels)
        self.n = len(problem.compute)
        self.compute = _segment_sums(np.asarray(problem.compute, dtype=float))
        self.weights = _segment_sums(np.asarray(problem.weight_bytes, dtype=float), below=0.0)
        self.activations = np.asarray(problem.activation_bytes, dtype=float)
        self.memory = problem.memory
        if self.memory is not None:
            self.version = _segment_sums(np.asarray(self.memory.version_bytes, dtype=float))
            self.state = _segment_sums(np.asarray(self.memory.state_bytes, dtype=float))
            self.stash = _segment_sums(np.asarray(self.memory.stash_bytes, dtype=float))
        self.devices_below = [math.prod(level.count for level in self.levels[:k]) for k in range(len(self.levels))]
        self.solved: dict = {}  # (level, e) -> (A by device count, stage times by (m', e'), columns)
        self._cube: Optional[np.ndarray] = None  # scratch space of _split_all

    # ---- one stage ----------------------------------------------------------------------------
    def _base(self, e: Fraction) -> np.ndarray:
        """A^0: one device holding layers i..j, with ceil(1 + e) inputs in flight (memory permitting)."""
        if self.memory is None:
            return self.compute
        n = math.ceil(1 + e)
        needed = n * self.version + self.state + n * self.stash
        return np.where(needed <= self.memory.capacity, self.compute, np.inf)

    def _external(self, k: int, m_prime: int, downstream: int, e: Fraction) -> Fraction:
        """Devices downstream per replica seen by a stage on m' components with ``downstream`` after it."""
        if self.memory is None:
            return Fraction(0)
        return (downstream * self.devices_below[k - 1] + e) / m_prime

    def _full_component(self, k: int, e: Fraction) -> np.ndarray:
        """A^k(i->j, m_k) over all (i, j): the best pipeline inside one whole level-k component."""
        if k == 0:
            return self._base(e)
        tables, _, _ = self.solve(k, e)
        return tables[self.levels[k - 1].count]

    def _stage_time(self, k: int, m_prime: int, downstream: int, e: Fraction, cache: dict) -> np.ndarray:
        """T^k(i->j, m') over all (i, j)."""
        inner = self._external(k, m_prime, downstream, e)
        key = (m_prime, inner)
        if key not in cache:
            sync = 2 * (m_prime - 1) * self.weights / self.levels[k - 1].bandwidth
            cache[key] = np.maximum(self._full_component(k - 1, inner), sync) / m_prime
        return cache[key]

    # ---- one level ----------------------------------------------------------------------------
    def _key(self, k: int, e: Fraction):
        """What a level-k table depends on: at level 1 only the in-flight counts ceil((m + e) / m') matter."""
        if k != 1 or self.memory is None:
            return (k, e)
        count = self.levels[0].count
        return (1, tuple(math.ceil((m + e) / m_prime) for m in range(1, count + 1) for m_prime in range(1, m + 1)))

    def solve(self, k: int, e: Fraction):
        """A^k(i->j, m) for m = 1..m_k; only j = N-1 at the top level, every j below it."""
        key = self._key(k, e)
        if key in self.solved:
            return self.solved[key]
        top = k == len(self.levels)
        columns = [self.n - 1] if top else list(range(self.n))
        level = self.levels[k - 1]
        comm = 2 * self.activations / level.bandwidth  # per split point s
        stage_times: dict = {}
        tables: dict = {}
        for m in range(1, level.count + 1):
            best = self._stage_time(k, m, 0, e, stage_times)[:, columns]
            for m_prime in range(1, m):
                first = np.maximum(self._stage_time(k, m_prime, m - m_prime, e, stage_times), comm[None, :])
                rest = tables[m - m_prime]
                if top:
                    best = np.minimum(best, self._split_top(first, rest))
                else:
                    self._split_all(first, rest, best)
            tables[m] = best
        self.solved[key] = (tables, stage_times, columns)
        return self.solved[key]

    def _split_top(self, first: np.ndarray, rest: np.ndarray) -> np.ndarray:
        """min over s of max(first[i, s], rest[s + 1]) for the single column j = N - 1."""
        shifted = np.append(rest[1:, 0], np.inf)
        return np.maximum(first, shifted[None, :]).min(axis=1)[:, None]

    def _split_all(self, first: np.ndarray, rest: np.ndarray, best: np.ndarray, rows: int = 8) -> None:
        """best[i, j] = min(best[i, j], min over i <= s < j of max(first[i, s], rest[s + 1, j])), in place.

        Blocks of rows keep the (s, i, j) cube small and skip s < i and j <= i, which are infinite;
        the cube is laid out with s first so the minimum runs over whole contiguous planes.
        """
        n = self.n
        if self._cube is None:
            self._cube = np.empty(n * rows * n)
        for i0 in range(0, n - 1, rows):
            i1 = min(i0 + rows, n - 1)
            width = n - 1 - i0
            cube = self._cube[:width * (i1 - i0) * width].reshape(width, i1 - i0, width)
            np.maximum(first[i0:i1, i0:n - 1].T[:, :, None], rest[i0 + 1:, None, i0 + 1:], out=cube)
            np.minimum(best[i0:i1, i0 + 1:], cube.min(axis=0), out=best[i0:i1, i0 + 1:])

    # ---- reading the plan back ------------------------------------------------------------------
    def stages(self, k: int, e: Fraction, i: int, j: int, m: int) -> list[tuple[int, int, int]]:
        """(start, end, replicas) of the best pipeline for layers i..j on m level-k components."""
        if k == 0:
            return [(i, j + 1, 1)]
        tables, stage_times, columns = self.solve(k, e)
        column = columns.index(j)
        target = tables[m][i, column]
        below = self.levels[k - 2].count if k >= 2 else 1
        if self._stage_time(k, m, 0, e, stage_times)[i, j] == target:
            inner = self.stages(k - 1, self._external(k, m, 0, e), i, j, below)
            return [(a, b, r * m) for a, b, r in inner]
        comm = 2 * self.activations / self.levels[k - 1].bandwidth
        for m_prime in range(1, m):
            first = self._stage_time(k, m_prime, m - m_prime, e, stage_times)
            for s in range(i, j):
                if max(first[i, s], comm[s], tables[m - m_prime][s + 1, column]) == target:
                    inner = self.stages(k - 1, self._external(k, m_prime, m - m_prime, e), i, s, below)
                    return [(a, b, r * m_prime) for a, b, r in inner] + self.stages(k, e, s + 1, j, m - m_prime)
        raise AssertionError("the table value has no witness")  # unreachable: tables come from these terms


def partition(problem: PartitionProblem) -> Partition:
    """The fastest pipeline over all layers and all devices of the topology (seed 002 Fig. 2.6)."""
    n = len(problem.compute)
    if n == 0 or not problem.levels:
        raise ConfigError("the partitioner needs at least one layer and one topology level.")
    if not (len(problem.activation_bytes) == len(problem.weight_bytes) == n):
        raise ConfigError(f"compute, activation and weight lists have lengths {n}, {len(problem.activation_bytes)} "
                          f"and {len(problem.weight_bytes)}; give one value per layer in each.")
    for level in problem.levels:
        if level.count < 1 or not level.bandwidth > 0:
            raise ConfigError(f"topology level {level} needs a count of at least 1 and a positive bandwidth.")
    solver = _Solver(problem)
    top = len(problem.levels)
    tables, _, _ = solver.solve(top, Fraction(0))
    best = float(tables[problem.levels[-1].count][0, 0])
    workers = math.prod(level.count for level in problem.levels)
    if not math.isfinite(best):
        capacity = human_bytes(problem.memory.capacity) if problem.memory else "memory"
        raise ConfigError(f"no partition of the {n} layers over {workers} devices fits in {capacity} per device "
                          "with weight stashing; add devices or memory, or use a schedule with fewer weight versions "
                          "(2bw or 1f1b).")
    stages = solver.stages(top, Fraction(0), 0, n - 1, problem.levels[-1].count)
    counts = in_flight_counts([r for _, _, r in stages])
    return Partition(tuple(Stage(a, b, r, c) for (a, b, r), c in zip(stages, counts)), best)
