"""Which job pairs may share an accelerator: a few partners per job, chosen by measured co-location.

Every co-locatable pair is a row of X, so with n jobs the chapter's formulation has O(n^2) rows
(2M at 2,048 jobs: 48 GiB in the original system). Which pairs help is decided by job type,
not by job: two jobs of the same types gain the same from sharing. So partner types are ranked
once, on the types present, by their best normalised co-located throughput over the worker types
(T_ab[0] / T_a + T_ab[1] / T_b, above 1 where sharing beats taking turns), and each job takes one
partner from each of its ``partners`` best-ranked types, drawn round-robin within a type so that
the pairs spread evenly over its jobs. The rows are O(n * partners) and no n x n matrix is built.
"""

from __future__ import annotations

from collections import defaultdict

from megapipe.cluster.core.jobs import Job
from megapipe.cluster.core.throughputs import ThroughputTable

PARTNERS_PER_JOB = 16


def colocation_gain(table: ThroughputTable, key, other, worker_types) -> float:
    """Best over worker types of both jobs' co-located throughput as fractions of running alone; 0: never."""
    best = 0.0
    for worker in worker_types:
        pair = table.colocated(key, other, worker)
        alone = (table.alone(key[0], key[1], worker), table.alone(other[0], other[1], worker))
        if min(pair) > 0 and min(alone) > 0:
            best = max(best, pair[0] / alone[0] + pair[1] / alone[1])
    return best


def candidate_pairs(jobs: list[Job], table: ThroughputTable, worker_types, partners: int | None,
                    groups: list[int] | None = None) -> list[tuple[int, int]]:
    """Pairs (a, b), a < b, of job indices that may share; every co-locatable pair when ``partners`` is None.

    ``groups``: a group per job (POP's parts); partners are then chosen within each job's group.
    """
    if groups is not None:
        pairs = []
        for group in sorted(set(groups)):
            members = [m for m, g in enumerate(groups) if g == group]
            pairs += [(members[a], members[b]) for a, b in candidate_pairs([jobs[m] for m in members], table,
                                                                           worker_types, partners)]
        return sorted(pairs)
    by_key = defaultdict(list)
    for index, job in enumerate(jobs):
        by_key[job.key].append(index)
    gains = {(k, o): colocation_gain(table, k, o, worker_types) for k in by_key for o in by_key if k[1] == o[1]}
    if partners is None:
        return [(a, b) for a in range(len(jobs)) for b in range(a + 1, len(jobs))
                if gains.get((jobs[a].key, jobs[b].key), 0) > 0]
    ranked = {k: sorted((o for o in by_key if gains.get((k, o), 0) > 0), key=lambda o: (-gains[(k, o)], o))
              for k in by_key}
    cursor = {k: 0 for k in by_key}
    chosen = set()
    for a, job in enumerate(jobs):
        wanted = partners
        for other in ranked[job.key]:
            members = by_key[other]
            for _ in range(len(members)):
                b = members[cursor[other] % len(members)]
                cursor[other] += 1
                if b != a and (min(a, b), max(a, b)) not in chosen:
                    chosen.add((min(a, b), max(a, b)))
                    wanted -= 1
                    break
            if wanted == 0:
                break
    return sorted(chosen)
