"""The round-based mechanism of seed 002 section 5.5 (Algorithm 2), independent of any clock.

It keeps t_kj, the time each combination k has run on accelerator type j since the allocation
last changed, and per round turns the allocation X into placements: priorities X / f with
f_kj = t_kj / sum_k' t_k'j; the highest-priority combinations that fit are taken greedily, a
combination sharing a job with one already taken is dropped; multi-worker jobs are placed in
decreasing order of workers on as few servers as possible; a combination that runs again on the
same type keeps its workers (lease extension). Times are reported to ``record`` by whoever runs
the jobs: the simulator, or the workers of a real cluster.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from megapipe.cluster.core.cluster_spec import ClusterSpec

UNSEEN_PRIORITY = 1e9  # X / f for a combination with no time yet: above any finite ratio, ordered by X


@dataclass
class RoundPlan:
    """Per combination (job ids): accelerator type, worker ids, and whether its workers sit on one server."""

    assignments: dict = field(default_factory=dict)  # key -> (worker type, worker ids)
    consolidated: dict = field(default_factory=dict)  # key -> bool
    extended: set = field(default_factory=set)  # keys that keep last round's workers


class RoundMechanism:
    def __init__(self, cluster: ClusterSpec, round_seconds: float = 360.0, seed: int = 0,
                 global_queue: bool = False):
        self.cluster, self.round_seconds, self.global_queue = cluster, round_seconds, global_queue
        self.rng = random.Random(seed)
        self.servers = {}  # type -> list of lists of worker ids
        self.type_of = {}
        next_id = 0
        for worker_type in cluster.order:
            count = cluster.counts[worker_type]
            servers = []
            while count > 0:
                size = min(cluster.gpus_per_server, count)
                servers.append(list(range(next_id, next_id + size)))
                self.type_of.update({w: worker_type for w in servers[-1]})
                next_id, count = next_id + size, count - size
            self.servers[worker_type] = servers
        self.time_received = {}  # (key, type) -> seconds since the last reset
        self.type_time = {t: 0.0 for t in cluster.order}
        self.current = RoundPlan()

    def reset(self, keys) -> None:
        """The allocation changed: every combination restarts from the same half-round of credit."""
        self.time_received = {(k, t): self.round_seconds / 2 for k in keys for t in self.cluster.order}
        self.type_time = {t: self.round_seconds / 2 * len(keys) for t in self.cluster.order}

    def record(self, key, worker_type: str, seconds: float) -> None:
        self.time_received[(key, worker_type)] = self.time_received.get((key, worker_type), 0.0) + seconds
        self.type_time[worker_type] += seconds

    def fractions(self) -> dict:
        """f_kj = t_kj / sum_k' t_k'j."""
        return {(k, t): (s / self.type_time[t] if self.type_time[t] > 0 else 0.0)
                for (k, t), s in self.time_received.items()}

    def priorities(self, allocation: dict) -> dict:
        """(key, type) -> X_kj / f_kj (UNSEEN_PRIORITY * X_kj where f is 0; 0 where X is 0)."""
        return {(key, t): self.priority(key, t, per_type.get(t, 0.0))
                for key, per_type in allocation.items() for t in self.cluster.order}

    def priority(self, key, worker_type: str, x: float) -> float:
        """X_kj / f_kj for one entry, with f_kj computed for it alone."""
        if x <= 0:
            return 0.0
        total = self.type_time[worker_type]
        share = self.time_received.get((key, worker_type), 0.0) / total if total > 0 else 0.0
        return x / share if share > 0 else x * UNSEEN_PRIORITY

    def select(self, allocation: dict, scale_of: dict, runnable, shuffle_types: bool = False,
               skip_zero_priority: bool = False) -> list[tuple]:
        """Algorithm 2: greedily the highest-priority (combination, type) entries that fit, no job twice.

        Entries are visited type by type in the cluster's order (shuffled for agnostic policies),
        highest priority first within a type, as the original system does; with ``global_queue`` in
        one list across types, which is Algorithm 2 read literally. Ties go to the larger X.
        """
        order = list(self.cluster.order)
        if shuffle_types:
            self.rng.shuffle(order)
        free = dict(self.cluster.counts)
        taken, chosen = set(), []
        for value, _, key, worker_type in self._queue(allocation, order):
            if not any(free.values()):
                break
            if free[worker_type] == 0 or taken.intersection(key) or not runnable(key, worker_type):
                continue
            if skip_zero_priority and value <= 0:
                continue
            scale = scale_of[key]
            if scale > free[worker_type]:
                continue
            free[worker_type] -= scale
            taken.update(key)
            chosen.append((key, worker_type))
        return chosen

    def _queue(self, allocation: dict, order: list):
        """The entries (priority, X, key, type) in visiting order: by type (or across types with
        ``global_queue``), highest priority first, ties by X, then allocation order. Entries with
        X <= 0 have priority 0, below every other, so they are ranked apart from the rest without
        computing a priority: with space sharing most pair rows have no time, and a round then
        costs in proportion to the entries that do."""
        timed, untimed = [], []
        for key, per_type in allocation.items():
            for t in order:
                x = per_type.get(t, 0.0)
                if x > 0:
                    timed.append((self.priority(key, t, x), x, key, t))
                else:
                    untimed.append((0.0, x, key, t))
        ranked = lambda entries: sorted(entries, key=lambda e: (e[0], e[1]), reverse=True)  # noqa: E731  stable
        for types in ([order] if self.global_queue else [[t] for t in order]):
            yield from ranked([e for e in timed if e[3] in types])
            yield from ranked([e for e in untimed if e[3] in types])

    def place(self, chosen: list[tuple], scale_of: dict) -> RoundPlan:
        """Workers for each chosen combination: last round's if still free, else as few servers as possible."""
        plan, used = RoundPlan(), set()
        for key, worker_type in sorted(chosen, key=lambda c: -scale_of[c[0]]):
            previous = self.current.assignments.get(key)
            if previous and previous[0] == worker_type and not used.intersection(previous[1]):
                plan.assignments[key] = previous
                plan.extended.add(key)
                used.update(previous[1])
        for key, worker_type in sorted(chosen, key=lambda c: -scale_of[c[0]]):
            if key not in plan.assignments:
                plan.assignments[key] = (worker_type, self._consolidated_workers(worker_type, scale_of[key], used))
        for key, (worker_type, workers) in plan.assignments.items():
            plan.consolidated[key] = len({self._server_of(worker_type, w) for w in workers}) == 1
        self.current = plan
        return plan

    def schedule_round(self, allocation: dict, scale_of: dict, runnable, shuffle_types: bool = False,
                       skip_zero_priority: bool = False) -> RoundPlan:
        return self.place(self.select(allocation, scale_of, runnable, shuffle_types, skip_zero_priority), scale_of)

    def _server_of(self, worker_type: str, worker: int) -> int:
        return next(i for i, server in enumerate(self.servers[worker_type]) if worker in server)

    def _consolidated_workers(self, worker_type: str, count: int, used: set) -> tuple:
        free = [[w for w in server if w not in used] for server in self.servers[worker_type]]
        fitting = [s for s in free if len(s) >= count]
        if fitting:
            picked = min(fitting, key=len)[:count]
        else:
            picked = [w for s in sorted(free, key=len, reverse=True) for w in s][:count]
        used.update(picked)
        return tuple(picked)
