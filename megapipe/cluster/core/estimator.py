"""Throughput estimator for co-located jobs (seed 002 sections 5.3.3 and 5.6).

Reference jobs have a fully profiled co-location matrix R (R[a, b]: a's throughput next to b,
normalised by a alone). A new job is profiled next to a few reference jobs only; its partial row
is completed by low-rank matrix completion (iterative SVD soft-thresholding over R with the new
row appended), and the completed row, its fingerprint, picks the closest reference job, whose
measured row is the estimate. ``estimate_error`` reports the mean relative error against the truth.
"""

from __future__ import annotations

import random

import numpy as np


def complete(matrix: np.ndarray, known: np.ndarray, rank: int = 3, iterations: int = 200) -> np.ndarray:
    """Fill the unknown entries of ``matrix`` with a rank-``rank`` fit of the known ones."""
    filled = np.where(known, matrix, matrix[known].mean())
    for _ in range(iterations):
        u, s, vt = np.linalg.svd(filled, full_matrices=False)
        low_rank = (u[:, :rank] * s[:rank]) @ vt[:rank]
        filled = np.where(known, matrix, low_rank)
    return filled


def fingerprint_match(reference: np.ndarray, row: np.ndarray, known: np.ndarray, rank: int = 3) -> int:
    """Index of the reference job whose row is closest to the completed ``row``."""
    stacked = np.vstack([reference, row[None, :]])
    mask = np.vstack([np.ones_like(reference, dtype=bool), known[None, :]])
    completed = complete(stacked, mask, rank)[-1]
    return int(np.argmin(np.linalg.norm(reference - completed[None, :], axis=1)))


def colocation_matrix(table, job_types: list[str], worker_type: str) -> np.ndarray:
    """R[a, b] = steps/s of a next to b over steps/s of a alone (single-worker jobs)."""
    n = len(job_types)
    result = np.zeros((n, n))
    for a, first in enumerate(job_types):
        alone = table.alone(first, 1, worker_type)
        for b, second in enumerate(job_types):
            together = table.colocated((first, 1), (second, 1), worker_type)[0]
            result[a, b] = together / alone if alone > 0 else 0.0
    return result


def estimate_error(table, worker_type: str = "v100", profiled_fraction: float = 0.3, seed: int = 0,
                   rank: int = 3) -> float:
    """Leave-one-out: each job type in turn is the new job; mean relative error of its estimated row."""
    rng = random.Random(seed)
    job_types = sorted(t for t in table.job_types() if table.alone(t, 1, worker_type) > 0)
    matrix = colocation_matrix(table, job_types, worker_type)
    errors = []
    for new in range(len(job_types)):
        others = [i for i in range(len(job_types)) if i != new]
        reference = matrix[np.ix_(others, others)]
        truth = matrix[new, others]
        known = np.zeros(len(others), dtype=bool)
        known[rng.sample(range(len(others)), max(1, int(profiled_fraction * len(others))))] = True
        match = fingerprint_match(reference, np.where(known, truth, 0.0), known, rank)
        estimate = np.where(known, truth, reference[match])
        positive = truth > 0
        errors.append(np.mean(np.abs(estimate[positive] - truth[positive]) / truth[positive]))
    return float(np.mean(errors))


def estimated_table(table, profiled_fraction: float, seed: int = 0, rank: int = 3):
    """A copy of ``table`` whose single-worker co-location entries are the estimator's.

    Every job type in turn is the new job, profiled next to ``profiled_fraction`` of the others
    (the reference jobs); its unprofiled pair entries come from its matched reference job's row,
    scaled by its own throughput alone. Policies read this table; the simulator runs jobs at the
    true throughputs, as a cluster would.
    """
    from megapipe.cluster.core.throughputs import UNCONSOLIDATED, ThroughputTable

    rng = random.Random(seed)
    estimated = ThroughputTable(isolated=table.isolated, pairs={w: dict(p) for w, p in table.pairs.items()})
    for worker_type in (w for w in table.worker_types if not w.endswith(UNCONSOLIDATED)):
        job_types = sorted(t for t in table.job_types() if table.alone(t, 1, worker_type) > 0)
        if len(job_types) < 3:
            continue
        matrix = colocation_matrix(table, job_types, worker_type)
        for new, job_type in enumerate(job_types):
            others = [i for i in range(len(job_types)) if i != new]
            known = np.zeros(len(others), dtype=bool)
            known[rng.sample(range(len(others)), max(1, int(profiled_fraction * len(others))))] = True
            reference = matrix[np.ix_(others, others)]
            match = fingerprint_match(reference, np.where(known, matrix[new, others], 0.0), known, rank)
            alone = table.alone(job_type, 1, worker_type)
            for position, other in enumerate(others):
                if known[position]:
                    continue
                key, other_key = (job_type, 1), (job_types[other], 1)
                mine = reference[match, position] * alone
                theirs = estimated.pairs[worker_type].get((other_key, key), (0.0, 0.0))[0]
                estimated.pairs[worker_type][(key, other_key)] = (mine, theirs)
    return estimated
