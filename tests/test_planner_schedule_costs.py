"""The planner's schedule formulas (seed 002 Table 7.1, per rank) against megapipe.schedules.analysis.simulate,
and its weight-version counts against the versions the PipeDream and 2BW schedules actually use
(and against the seeds' closed-form version rules)."""

from fractions import Fraction

import numpy as np
import pytest

from schedule_helpers import assert_closed_forms_match_the_simulator, versions_held
from megapipe.schedules.catalog import build_schedule
from megapipe.schedules.analysis.simulate import CostModel, peak_activations, simulate
from megapipe.planner.schedule_costs import (bubble_fraction, in_flight, microbatch_problem, pipeline_time,
                                             weight_versions)

pytestmark = pytest.mark.unit


def per_rank(costs, p):
    """Sum per-virtual-stage costs over the chunks of each rank (virtual stage s lives on rank s % p)."""
    return [sum(costs[s] for s in range(len(costs)) if s % p == r) for r in range(p)]


def cases():
    for p in range(1, 7):
        for m in sorted({1, 2, p, p + 1, 2 * p, 3 * p + 1}):
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
                if microbatch_problem(name, p, m, v) is None:
                    yield name, p, m, v


@pytest.mark.parametrize("name,p,m,v", list(cases()))
def test_equal_stages_time_bubble_and_activations_match_the_simulator(name, p, m, v):
    assert_closed_forms_match_the_simulator(name, p, m, v)  # F = 1, B = 2 per rank


def test_gpipe_is_a_flow_shop_for_any_stage_times():
    rng = np.random.default_rng(0)
    for _ in range(30):
        p, m = int(rng.integers(1, 6)), int(rng.integers(1, 10))
        forward = [int(x) for x in rng.integers(1, 6, p)]
        backward = [int(x) for x in rng.integers(1, 11, p)]
        result = simulate(build_schedule("gpipe", p, m).compute_only(), CostModel(forward=forward, backward=backward))
        assert pipeline_time("gpipe", forward, backward, m) == result.makespan


def test_1f1b_with_heavier_first_and_last_stage_against_the_simulator():
    # The planner's ranks are equal except the embedding on the first and the head on the last.
    # Exact when the last rank's step is the longer one (the head outweighs the embedding);
    # otherwise the first rank's turnaround makes it off by less than two steps.
    rng = np.random.default_rng(1)
    exact = 0
    for _ in range(30):
        p = int(rng.integers(2, 7))
        m = p * int(rng.integers(1, 4)) + int(rng.integers(0, p))
        forward, backward = [Fraction(4)] * p, [Fraction(8)] * p
        forward[0] += int(rng.integers(0, 5))
        backward[0] += int(rng.integers(0, 5))
        forward[-1] += int(rng.integers(0, 9))
        backward[-1] += int(rng.integers(0, 17))
        result = simulate(build_schedule("1f1b", p, m).compute_only(), CostModel(forward=forward, backward=backward))
        predicted = pipeline_time("1f1b", forward, backward, m)
        steps = [f + b for f, b in zip(forward, backward)]
        if steps[-1] >= steps[0]:
            exact += 1
            assert predicted == result.makespan
        else:
            assert abs(predicted - result.makespan) < 2 * max(steps)
    assert exact > 15


def test_table_7_1_activation_and_weight_counts():
    p, m, v = 4, 12, 2
    assert max(in_flight("gpipe", p, m, 1, r) for r in range(p)) == m
    for name in ("1f1b", "2bw"):
        assert max(in_flight(name, p, m, 1, r) for r in range(p)) == p
    assert max(in_flight("pipedream", p, 1, 1, r) for r in range(p)) == p  # NOAM, whatever the batch
    # Interleaving: Table 7.1 says p; exactly it is p + (p - 1) / v on the first rank.
    assert max(in_flight("interleaved", p, m, v, r) for r in range(p)) == p + Fraction(p - 1, v)
    assert [weight_versions(n, p, 0) for n in ("gpipe", "1f1b", "interleaved", "2bw", "pipedream")] == [1, 1, 1, 2, p]
    assert [bubble_fraction(n, p, m, 1) for n in ("gpipe", "1f1b", "2bw", "pipedream")] == [Fraction(p - 1, m)] * 2 + [0, 0]
    assert bubble_fraction("interleaved", p, m, v) == Fraction(p - 1, v * m)


@pytest.mark.parametrize("name", ["2bw", "pipedream"])
def test_asynchronous_schedules_hold_the_planned_versions_and_activations(name):
    for p in range(1, 6):
        for m in sorted({p, p + 1, 2 * p}):
            schedule = build_schedule(name, p, m)
            assert tuple(peak_activations(schedule)) == tuple(in_flight(name, p, m, 1, r) for r in range(p))
            for rank, actions in enumerate(schedule.actions):
                assert max(versions_held(actions).values()) == weight_versions(name, p, rank), (p, m, rank)


def test_2bw_needs_two_versions_by_its_version_rule():
    # Seed 002: microbatch k (1-indexed) uses version max(floor((k-1)/m) - 1, 0); 1F1B keeps the
    # p - r microbatches k-(p-r)+1 .. k in flight on rank r, so the versions they need at once are
    # those of a window of p - r consecutive microbatches; with m >= p that is never more than two.
    def version(k, m):
        return max((k - 1) // m - 1, 0)

    for p in range(1, 7):
        for m in range(p, 3 * p + 1):
            for r in range(p):
                window = p - r
                needed = max(len({version(k, m) for k in range(first, first + window)})
                             for first in range(1, 6 * m))
                assert needed <= weight_versions("2bw", p, r)
            if p > 1:  # a window straddling a version boundary needs both
                assert len({version(k, m) for k in range(2 * m, 2 * m + 2)}) == 2


def test_pipedream_stashes_one_version_per_input_in_flight():
    # Seed 002 (Fig. 2.8): the forward of input k on stage s (1-indexed) uses the weights updated
    # through input k - p + s - 1, so the p - s + 1 inputs in flight there each use a different version.
    for p in range(1, 8):
        for stage in range(1, p + 1):
            in_flight_inputs = range(10, 10 + p - stage + 1)
            versions = {k - p + stage - 1 for k in in_flight_inputs}
            assert len(versions) == weight_versions("pipedream", p, stage - 1) == in_flight("pipedream", p, p, 1, stage - 1)


def test_microbatch_rules():
    assert microbatch_problem("interleaved", 4, 6, 2) is not None  # m not a multiple of p
    assert microbatch_problem("interleaved", 4, 8, 2) is None
    assert microbatch_problem("1f1b", 4, 3, 1) is not None
    assert microbatch_problem("gpipe", 4, 3, 1) is None
    assert microbatch_problem("2bw", 4, 3, 1) is not None
    assert microbatch_problem("pipedream", 4, 2, 1) is not None
    assert microbatch_problem("1f1b", 4, 8, 2) is not None  # chunks only with interleaving


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p", range(2, 7))
def test_v_schedules_time_bubble_and_activations_match_the_simulator(name, p):
    # F = 1, B = 2 per rank split over the V's two chunks; DualPipeV's pairs run one pass after the
    # other, as megapipe's executor runs them (no overlap: F&B = F + B)
    for m in sorted({2 * p - 1, 2 * p, 3 * p + 1}):
        assert microbatch_problem(name, p, m, 2) is None
        assert_closed_forms_match_the_simulator(name, p, m, 2)
