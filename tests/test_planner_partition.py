"""PipeDream's hierarchical partitioner against brute-force enumeration, the paper's own
recurrence written literally, and the seeds' worked examples."""

import itertools
import math
from functools import lru_cache

import numpy as np
import pytest

from megapipe.errors import ConfigError
from megapipe.planner.partition import (Level, PartitionProblem, StageMemory, in_flight_counts, partition)

pytestmark = pytest.mark.unit


# ---- independent references ---------------------------------------------------------------------
def compositions(total, parts):
    """All ways to write ``total`` as ``parts`` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[k + 1] - bounds[k] for k in range(parts))


def contiguous_splits(start, end):
    """All ways to cut layers start..end-1 into consecutive non-empty ranges."""
    inner = range(start + 1, end)
    for k in range(len(inner) + 1):
        for cuts in itertools.combinations(inner, k):
            bounds = (start, *cuts, end)
            yield [(bounds[q], bounds[q + 1]) for q in range(len(bounds) - 1)]


def flat_configs(start, end, devices):
    """Every pipeline over layers start..end-1 using exactly ``devices`` devices: [(a, b, replicas)]."""
    for ranges in contiguous_splits(start, end):
        if len(ranges) > devices:
            continue
        for replicas in compositions(devices, len(ranges)):
            yield [(a, b, r) for (a, b), r in zip(ranges, replicas)]


def stage_time(compute, weights, a, b, replicas, bandwidth, inner=None):
    """T(a..b-1, r) = max(compute, 2 (r - 1) sum w / B) / r, compute = sum T_l or a lower level's bottleneck."""
    work = sum(compute[a:b]) if inner is None else inner
    return max(work, 2 * (replicas - 1) * sum(weights[a:b]) / bandwidth) / replicas


def flat_cost(config, compute, activations, weights, bandwidth):
    stages = [stage_time(compute, weights, a, b, r, bandwidth) for a, b, r in config]
    cuts = [2 * activations[b - 1] / bandwidth for _, b, _ in config[:-1]]
    return max(stages + cuts)


def fits(flat_stages, memory):
    """Memory of each device under weight stashing, with 1F1B-RR in-flight counts."""
    if memory is None:
        return True
    replicas = [r for _, _, r in flat_stages]
    for (a, b, r), k in zip(flat_stages, range(len(flat_stages))):
        n = math.ceil(sum(replicas[k:]) / r)
        need = n * sum(memory.version_bytes[a:b]) + sum(memory.state_bytes[a:b]) + n * sum(memory.stash_bytes[a:b])
        if need > memory.capacity:
            return False
    return True


def brute_force_flat(compute, activations, weights, devices, bandwidth, memory=None):
    best = math.inf
    for config in flat_configs(0, len(compute), devices):
        if fits(config, memory):
            best = min(best, flat_cost(config, compute, activations, weights, bandwidth))
    return best


def brute_force_two_levels(compute, activations, weights, per_node, b1, nodes, b2, memory=None):
    """Every top-level pipeline over nodes, each of its stages a pipeline inside one node."""
    n, best = len(compute), math.inf
    for top in flat_configs(0, n, nodes):
        inner_choices = [list(flat_configs(a, b, per_node)) for a, b, _ in top]
        for inner in itertools.product(*inner_choices):
            flat = [(a, b, r * c) for (_, _, c), config in zip(top, inner) for a, b, r in config]
            if not fits(flat, memory):
                continue
            parts = [stage_time(compute, weights, a, b, c, b2,
                                inner=flat_cost(config, compute, activations, weights, b1))
                     for (a, b, c), config in zip(top, inner)]
            parts += [2 * activations[b - 1] / b2 for _, b, _ in top[:-1]]
            best = min(best, max(parts))
    return best


def paper_recurrence(compute, activations, weights, levels):
    """Seed 002's A^k(i->j, m) exactly as printed (last stage peeled off), plus 001's single-stage case."""
    n = len(compute)

    @lru_cache(maxsize=None)
    def a_table(k, i, j, m):
        if k == 0:
            return sum(compute[i:j + 1])
        count, bandwidth = levels[k - 1]
        if m == 1:
            return a_table(k - 1, i, j, levels[k - 2][0] if k >= 2 else 1)
        best = t_table(k, i, j, m)
        for s in range(i, j):
            for m_prime in range(1, m):
                best = min(best, max(a_table(k, i, s, m - m_prime), 2 * activations[s] / bandwidth,
                                     t_table(k, s + 1, j, m_prime)))
        return best

    @lru_cache(maxsize=None)
    def t_table(k, i, j, m):
        count, bandwidth = levels[k - 1]
        lower = a_table(k - 1, i, j, levels[k - 2][0] if k >= 2 else 1)
        return max(lower, 2 * (m - 1) * sum(weights[i:j + 1]) / bandwidth) / m

    return a_table(len(levels), 0, n - 1, levels[-1][0])


def random_profile(rng, n):
    return (rng.integers(1, 10, n).tolist(), rng.integers(0, 8, n).tolist(), rng.integers(0, 12, n).tolist())


def random_memory(rng, n):
    version = rng.integers(1, 4, n).tolist()
    state = rng.integers(0, 3, n).tolist()
    stash = rng.integers(1, 4, n).tolist()
    return StageMemory(version, state, stash, capacity=float(rng.integers(6, 30)))


def check_structure(result, n, devices):
    stages = result.stages
    assert stages[0].start == 0 and stages[-1].end == n
    assert all(a.end == b.start for a, b in zip(stages, stages[1:]))
    assert sum(stage.replicas for stage in stages) == devices
    assert [stage.in_flight for stage in stages] == in_flight_counts([stage.replicas for stage in stages])
    assert result.noam == math.ceil(devices / stages[0].replicas)


# ---- brute force --------------------------------------------------------------------------------
def test_single_level_equals_brute_force_on_random_profiles():
    rng = np.random.default_rng(1)
    for _ in range(250):
        n, devices, bandwidth = int(rng.integers(1, 6)), int(rng.integers(1, 6)), float(rng.integers(1, 20))
        compute, activations, weights = random_profile(rng, n)
        result = partition(PartitionProblem(compute, activations, weights, [Level(devices, bandwidth)]))
        expected = brute_force_flat(compute, activations, weights, devices, bandwidth)
        assert result.time_per_input == pytest.approx(expected, rel=1e-12)
        check_structure(result, n, devices)
        config = [(s.start, s.end, s.replicas) for s in result.stages]
        assert flat_cost(config, compute, activations, weights, bandwidth) == pytest.approx(expected, rel=1e-12)


def test_two_levels_equal_brute_force_on_random_profiles():
    rng = np.random.default_rng(2)
    for _ in range(150):
        n = int(rng.integers(1, 6))
        per_node, nodes = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        b1, b2 = float(rng.integers(5, 30)), float(rng.integers(1, 6))
        compute, activations, weights = random_profile(rng, n)
        result = partition(PartitionProblem(compute, activations, weights, [Level(per_node, b1), Level(nodes, b2)]))
        expected = brute_force_two_levels(compute, activations, weights, per_node, b1, nodes, b2)
        assert result.time_per_input == pytest.approx(expected, rel=1e-12)
        check_structure(result, n, per_node * nodes)


def test_memory_limit_equals_brute_force_single_level():
    rng = np.random.default_rng(3)
    infeasible = 0
    for _ in range(200):
        n, devices, bandwidth = int(rng.integers(1, 6)), int(rng.integers(1, 6)), float(rng.integers(1, 20))
        compute, activations, weights = random_profile(rng, n)
        memory = random_memory(rng, n)
        expected = brute_force_flat(compute, activations, weights, devices, bandwidth, memory)
        problem = PartitionProblem(compute, activations, weights, [Level(devices, bandwidth)], memory)
        if math.isinf(expected):
            infeasible += 1
            with pytest.raises(ConfigError, match="no partition"):
                partition(problem)
            continue
        result = partition(problem)
        assert result.time_per_input == pytest.approx(expected, rel=1e-12)
        check_structure(result, n, devices)
        assert fits([(s.start, s.end, s.replicas) for s in result.stages], memory)
    assert 10 < infeasible < 190  # both branches were exercised


def test_memory_limit_equals_brute_force_two_levels():
    rng = np.random.default_rng(4)
    feasible = 0
    for _ in range(120):
        n = int(rng.integers(1, 5))
        per_node, nodes = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        b1, b2 = float(rng.integers(5, 30)), float(rng.integers(1, 6))
        compute, activations, weights = random_profile(rng, n)
        memory = random_memory(rng, n)
        expected = brute_force_two_levels(compute, activations, weights, per_node, b1, nodes, b2, memory)
        problem = PartitionProblem(compute, activations, weights, [Level(per_node, b1), Level(nodes, b2)], memory)
        if math.isinf(expected):
            with pytest.raises(ConfigError):
                partition(problem)
            continue
        feasible += 1
        result = partition(problem)
        assert result.time_per_input == pytest.approx(expected, rel=1e-12)
        check_structure(result, n, per_node * nodes)
        assert fits([(s.start, s.end, s.replicas) for s in result.stages], memory)
    assert feasible > 30


def test_equals_the_papers_recurrence_as_printed():
    rng = np.random.default_rng(5)
    for _ in range(120):
        n = int(rng.integers(1, 7))
        levels = [(int(rng.integers(1, 4)), float(rng.integers(5, 30)))]
        if rng.random() < 0.5:
            levels.append((int(rng.integers(1, 4)), float(rng.integers(1, 6))))
        compute, activations, weights = random_profile(rng, n)
        result = partition(PartitionProblem(compute, activations, weights, [Level(c, b) for c, b in levels]))
        assert result.time_per_input == pytest.approx(paper_recurrence(compute, activations, weights, levels),
                                                      rel=1e-12)


# ---- the seeds' examples ----------------------------------------------------------------------------
def test_figure_2_7_config_2_1():
    # Stage 1: forward 2 + backward 4 units; stage 2: forward 1 + backward 2 units; 3 workers.
    # Layer 2's large weights make replicating it costly, so stage 1 is replicated twice.
    result = partition(PartitionProblem([2 + 4, 1 + 2], [1, 0], [1, 100], [Level(3, 10.0)]))
    assert result.config_name == "2-1"
    assert [(s.start, s.end) for s in result.stages] == [(0, 1), (1, 2)]
    assert result.time_per_input == 3.0
    assert result.noam == 2  # ceil(3 workers / 2 input-stage replicas)
    assert [s.in_flight for s in result.stages] == [2, 1]


def test_pure_data_parallelism_is_chosen_for_compact_weights():
    # ResNet-like: tiny weights, large activations; one stage replicated on all 4 workers.
    result = partition(PartitionProblem([5, 5, 5, 5], [50, 50, 50, 0], [0.1] * 4, [Level(4, 10.0)]))
    assert result.config_name == "4"
    assert result.time_per_input == pytest.approx(max(20, 2 * 3 * 0.4 / 10) / 4)
    assert result.noam == 1


def test_vgg_like_replicated_front_and_unreplicated_classifier():
    # Large early activations and a weight-heavy last layer: "3-1", like VGG-16's 15-1.
    result = partition(PartitionProblem([4, 4, 4, 1], [30, 30, 1, 0], [1, 1, 1, 200], [Level(4, 10.0)]))
    assert result.config_name == "3-1"
    assert result.time_per_input == 4.0


def test_straight_pipeline_noam_is_the_depth():
    result = partition(PartitionProblem([1, 1, 1, 1], [0, 0, 0, 0], [100] * 4, [Level(4, 10.0)]))
    assert result.config_name == "1-1-1-1"
    assert result.noam == 4
    assert [s.in_flight for s in result.stages] == [4, 3, 2, 1]


def test_inputs_are_checked():
    with pytest.raises(ConfigError, match="one value per layer"):
        partition(PartitionProblem([1, 2], [1], [1, 1], [Level(2, 1.0)]))
    with pytest.raises(ConfigError, match="count of at least 1"):
        partition(PartitionProblem([1], [1], [1], [Level(0, 1.0)]))
