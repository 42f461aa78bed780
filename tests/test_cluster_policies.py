"""Gavel policies: the chapter's worked example, constraints (5.1)-(5.3), brute force over a grid of X."""

import itertools

import numpy as np
import pytest

from megapipe.cluster.core.cluster_spec import ClusterSpec
from megapipe.cluster.core.jobs import Job
from megapipe.cluster.core.policies import POLICY_NAMES, make_policy
from megapipe.cluster.core.policies.water_filling import WaterFilling
from megapipe.cluster.core.problem import build_problem
from megapipe.cluster.core.throughputs import ThroughputTable
from cluster_helpers import small_jobs, small_table

PRICES = {"v100": 2.48, "p100": 1.46, "k80": 0.45}


def example_problem():
    table = ThroughputTable()
    for name, (v100, k80) in zip("abc", [(40, 10), (12, 4), (100, 50)]):
        table.add_job_type(name, 1, {"v100": v100, "k80": k80})
    jobs = [Job(i, name, 100) for i, name in enumerate("abc")]
    return build_problem(jobs, table, ClusterSpec({"v100": 1, "k80": 1}))


@pytest.mark.system
def test_section_5_3_worked_example():
    """LAS-perf on T = [[40, 10], [12, 4], [100, 50]] with one V100 and one K80 gives the chapter's X."""
    problem = example_problem()
    x = make_policy("max_min_fairness_perf").allocate(problem)
    v100, k80 = problem.columns.index("v100"), problem.columns.index("k80")
    chapter = np.array([[0.45, 0.0], [0.45, 0.09], [0.09, 0.91]])
    assert np.abs(x[:, [v100, k80]] - chapter).max() < 0.01


def assert_valid(problem, x):
    """(5.1) 0 <= X <= 1, (5.2) a job's fractions over its combinations sum to <= 1, (5.3) no type oversubscribed."""
    tolerance = 1e-6
    assert x.shape == (len(problem.combos), len(problem.columns))
    assert x.min() >= -tolerance and x.max() <= 1 + tolerance
    flat = x.flatten()
    assert (problem.membership() @ flat <= 1 + tolerance).all()
    capacity, workers = problem.capacity()
    assert (capacity @ flat <= workers + tolerance).all()
    assert np.abs(x[~problem.runnable()]).max(initial=0) <= tolerance


@pytest.mark.unit
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_satisfies_constraints(name):
    policy = make_policy(name, seed=1)
    cluster = ClusterSpec({"v100": 1, "p100": 2, "k80": 2})
    problem = build_problem(small_jobs(), small_table(), cluster, now=100.0, space_sharing=policy.space_sharing,
                            partners=policy.partners, prices=PRICES)
    x = policy.allocate(problem)
    assert_valid(problem, x)
    assert x.sum() > 0


@pytest.mark.unit
def test_placement_sensitive_columns_share_accelerators():
    table = small_table()
    for name in "abc":
        table.add_job_type(name, 2, {"v100_unconsolidated": 1.0, "p100_unconsolidated": 1.0, "k80_unconsolidated": 1.0})
    problem = build_problem(small_jobs(), table, ClusterSpec({"v100": 1, "p100": 2, "k80": 2}),
                            placement_sensitive=True)
    assert "v100_unconsolidated" in problem.columns
    single_worker = problem.single_rows()[0]
    assert problem.T[single_worker, problem.columns.index("v100_unconsolidated"), 0] == 0
    assert_valid(problem, make_policy("max_min_fairness_perf").allocate(problem))


def grid_allocations(step=0.05):
    """Every X for 2 single-worker jobs on 1 V100 + 1 K80 on a grid, feasible under (5.1)-(5.3)."""
    values = np.arange(0, 1 + 1e-9, step)
    grid = np.array(list(itertools.product(values, repeat=4)))  # x00 x01 x10 x11 (job, type)
    feasible = ((grid[:, 0] + grid[:, 1] <= 1 + 1e-9) & (grid[:, 2] + grid[:, 3] <= 1 + 1e-9)
                & (grid[:, 0] + grid[:, 2] <= 1 + 1e-9) & (grid[:, 1] + grid[:, 3] <= 1 + 1e-9))
    return grid[feasible]


def two_job_problem():
    table = ThroughputTable()
    table.add_job_type("fast", 1, {"v100": 30.0, "k80": 5.0})
    table.add_job_type("flat", 1, {"v100": 8.0, "k80": 6.0})
    jobs = [Job(0, "fast", 6000, arrival_time=0), Job(1, "flat", 2000, arrival_time=0)]
    return build_problem(jobs, table, ClusterSpec({"v100": 1, "k80": 1}), now=600.0)


OBJECTIVES = {  # policy -> (objective of a throughput vector, maximise?)
    "max_min_fairness_perf": lambda p, thr: (thr / p.equal_share()).min(axis=-1),
    "min_total_duration_perf": lambda p, thr: -(p.steps_remaining / thr).max(axis=-1),
    "max_sum_throughput_perf": lambda p, thr: (thr / np.array([30.0, 8.0])).sum(axis=-1),
    "finish_time_fairness_perf": lambda p, thr: -((p.elapsed + p.steps_remaining / thr)
                                                 / (p.elapsed + p.steps_remaining / p.throughput(p.isolated_share()))).max(axis=-1),
}


@pytest.mark.system
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_optimum_matches_brute_force(name):
    """No grid point beats the solver, and the best grid point is within the grid's resolution of it."""
    problem = two_job_problem()
    x = make_policy(name).allocate(problem)
    columns = [problem.columns.index("v100"), problem.columns.index("k80")]
    grid = grid_allocations()
    T = np.array([[30.0, 5.0], [8.0, 6.0]])
    thr = np.stack([grid[:, 0] * T[0, 0] + grid[:, 1] * T[0, 1], grid[:, 2] * T[1, 0] + grid[:, 3] * T[1, 1]], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        values = np.nan_to_num(OBJECTIVES[name](problem, thr), nan=-np.inf)
    ours = OBJECTIVES[name](problem, problem.throughput(x))
    best = values.max()
    # the solver's interior-point tolerance is ~1e-7 relative; the grid step 0.05 bounds how far the best grid point can lag
    assert ours >= best - 1e-6 * abs(best)
    scale = abs(best)
    assert best >= ours - 0.12 * scale
    assert x[:, columns].shape == (2, 2)


@pytest.mark.system
def test_water_filling_chapter_example():
    """4 identical jobs (weights 3, 1, 1, 1) on 4 identical GPUs: after water filling every job has a full GPU."""
    table = ThroughputTable()
    table.add_job_type("same", 1, {"v100": 10.0})
    jobs = [Job(i, "same", 100, priority_weight=w) for i, w in enumerate((3.0, 1.0, 1.0, 1.0))]
    problem = build_problem(jobs, table, ClusterSpec({"v100": 4}))
    x = WaterFilling().allocate(problem)
    assert np.allclose(x[:, 0], 1.0, atol=1e-6)
    single = make_policy("max_min_fairness_perf").allocate(
        build_problem(jobs, table, ClusterSpec({"v100": 2})))
    assert single[0, 0] == pytest.approx(3 * single[1, 0], rel=1e-4)  # weights divide the max-min objective


@pytest.mark.system
def test_hierarchical_fifo_entity_gives_its_share_to_its_first_job():
    table = ThroughputTable()
    table.add_job_type("same", 1, {"v100": 10.0})
    jobs = [Job(0, "same", 100, entity="fair"), Job(1, "same", 100, entity="fair"),
            Job(2, "same", 100, entity="queue", arrival_time=0), Job(3, "same", 100, entity="queue", arrival_time=1)]
    problem = build_problem(jobs, table, ClusterSpec({"v100": 2}))
    x = WaterFilling(entity_policies={"queue": "fifo"}).allocate(problem)
    assert x[2, 0] == pytest.approx(1.0, abs=1e-4)  # the queue entity's whole share goes to its first job
    assert x[3, 0] == pytest.approx(0.0, abs=1e-4)
    assert x[0, 0] == pytest.approx(0.5, abs=1e-4) and x[1, 0] == pytest.approx(0.5, abs=1e-4)
