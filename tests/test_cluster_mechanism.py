"""Algorithm 2: no job twice per round, no type oversubscribed, time fractions converge to X."""

import random

import numpy as np
import pytest

from megapipe.cluster.core.cluster_spec import ClusterSpec
from megapipe.cluster.core.mechanism import RoundMechanism

ROUND = 360.0


def run_rounds(mechanism, allocation, scale_of, rounds):
    """Run ``rounds`` rounds, checking the invariants; returns rounds each (key, type) ran."""
    counts = {}
    for _ in range(rounds):
        plan = mechanism.schedule_round(allocation, scale_of, lambda key, worker_type: True)
        jobs = [job for key in plan.assignments for job in key]
        assert len(jobs) == len(set(jobs)), "a job runs in two combinations in one round"
        workers = [w for _, ids in plan.assignments.values() for w in ids]
        assert len(workers) == len(set(workers)), "a worker serves two combinations"
        for worker_type, count in mechanism.cluster.counts.items():
            used = sum(len(ids) for t, ids in plan.assignments.values() if t == worker_type)
            assert used <= count
        for key, (worker_type, ids) in plan.assignments.items():
            assert len(ids) == scale_of[key]
            assert all(mechanism.type_of[w] == worker_type for w in ids)
            mechanism.record(key, worker_type, ROUND)
            counts[(key, worker_type)] = counts.get((key, worker_type), 0) + 1
    return counts


def test_time_fractions_converge_to_the_allocation():
    """Single-worker jobs with a tight allocation: the share of rounds on each type approaches X."""
    cluster = ClusterSpec({"v100": 2, "k80": 3})
    x = {(0,): {"v100": 0.6, "k80": 0.4}, (1,): {"v100": 0.4, "k80": 0.6}, (2,): {"v100": 0.5, "k80": 0.5},
         (3,): {"v100": 0.5, "k80": 0.5}, (4,): {"v100": 0.0, "k80": 1.0}}
    mechanism = RoundMechanism(cluster, ROUND)
    mechanism.reset(x)
    scale_of = {key: 1 for key in x}
    rounds = 600
    counts = run_rounds(mechanism, x, scale_of, rounds)
    errors = [abs(counts.get((key, t), 0) / rounds - share) for key, per_type in x.items() for t, share in per_type.items()]
    print(f"largest |fraction - X| after {rounds} rounds: {max(errors):.4f}")
    assert max(errors) < 0.02


@pytest.mark.parametrize("global_queue", [False, True])
def test_pairs_and_multi_worker_jobs_respect_algorithm_2(global_queue):
    rng = random.Random(3)
    cluster = ClusterSpec({"v100": 4, "p100": 4, "k80": 8}, gpus_per_server=4)
    scale = {0: 1, 1: 1, 2: 2, 3: 4, 4: 1, 5: 2, 6: 1}
    keys = [(i,) for i in scale] + [(0, 1), (0, 4), (1, 6), (2, 5)]
    allocation = {k: {t: rng.random() / 4 for t in cluster.order} for k in keys}
    scale_of = {k: scale[k[0]] for k in keys}
    mechanism = RoundMechanism(cluster, ROUND, seed=1, global_queue=global_queue)
    mechanism.reset(allocation)
    run_rounds(mechanism, allocation, scale_of, 200)


def test_multi_worker_job_placed_on_one_server_and_lease_extended():
    cluster = ClusterSpec({"v100": 8}, gpus_per_server=4)
    allocation = {(0,): {"v100": 1.0}, (1,): {"v100": 1.0}}
    mechanism = RoundMechanism(cluster, ROUND)
    mechanism.reset(allocation)
    scale_of = {(0,): 4, (1,): 2}
    first = mechanism.schedule_round(allocation, scale_of, lambda k, t: True)
    assert first.consolidated[(0,)] and first.consolidated[(1,)]
    for key, (worker_type, _) in first.assignments.items():
        mechanism.record(key, worker_type, ROUND)
    second = mechanism.schedule_round(allocation, scale_of, lambda k, t: True)
    assert second.extended == {(0,), (1,)}
    assert second.assignments == first.assignments


def test_priorities_follow_x_over_f():
    cluster = ClusterSpec({"v100": 1})
    mechanism = RoundMechanism(cluster, ROUND)
    allocation = {(0,): {"v100": 0.75}, (1,): {"v100": 0.25}}
    mechanism.reset(allocation)
    mechanism.record((0,), "v100", 3 * ROUND)
    f = mechanism.fractions()
    priorities = mechanism.priorities(allocation)
    for key in allocation:
        assert np.isclose(priorities[(key, "v100")], allocation[key]["v100"] / f[(key, "v100")])
    assert priorities[((1,), "v100")] > priorities[((0,), "v100")]
