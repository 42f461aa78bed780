"""The simulator against closed forms: bubble fractions, peak activations, makespans, messages."""

from fractions import Fraction

import pytest

from megapipe.schedules.actions import ActionKind
from megapipe.schedules.catalog import build_schedule
from megapipe.schedules.analysis.simulate import CostModel, simulate

pytestmark = pytest.mark.unit

PS = range(1, 9)


def microbatch_counts(p):
    return sorted({1, 2, p, p + 1, 2 * p, 3 * p + 1})


@pytest.mark.parametrize("p", PS)
def test_gpipe_unit_costs(p):
    for m in microbatch_counts(p):
        result = simulate(build_schedule("gpipe", p, m))
        assert result.makespan == 3 * (m + p - 1)
        assert result.bubble_fraction == Fraction(p - 1, m + p - 1)
        assert result.peak_activations == (m,) * p


@pytest.mark.parametrize("p", PS)
def test_1f1b_unit_costs(p):
    for m in (x for x in microbatch_counts(p) if x >= p):
        result = simulate(build_schedule("1f1b", p, m))
        assert result.makespan == 3 * (m + p - 1)
        assert result.bubble_fraction == Fraction(p - 1, m + p - 1)
        assert all(fraction == Fraction(p - 1, m + p - 1) for fraction in result.idle_fraction)
        assert result.peak_activations == tuple(p - rank for rank in range(p))  # rank 0 holds p


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_unit_costs(p, v):
    # Per-chunk costs F = 1/v, B = 2/v: each rank still does 3m of work per batch.
    for m in (p, 2 * p, 3 * p):
        result = simulate(build_schedule("interleaved", p, m, v), CostModel.per_chunk(v))
        assert result.makespan == Fraction(3 * (v * m + p - 1), v)
        assert result.bubble_fraction == Fraction(p - 1, v * m + p - 1)
        assert result.busy_time == (3 * m,) * p
        peak = result.peak_activations
        assert peak[0] == max(peak)
        if m > p:  # Megatron's formula p (1 + (p-1)/(p v)) for the first rank
            assert peak[0] == p * (1 + Fraction(p - 1, p * v))
        else:  # m = p: every chunk's forwards fit in the warm-up, so all m v chunk-microbatches are held
            assert peak[0] == m


def test_interleaving_shrinks_the_bubble_by_v_against_1f1b():
    one = simulate(build_schedule("1f1b", 4, 8))
    two = simulate(build_schedule("interleaved", 4, 8, 2), CostModel.per_chunk(2))
    ideal = 3 * 8
    assert (one.makespan - ideal) == 2 * (two.makespan - ideal) == 2 * Fraction(9, 2)


def test_gpipe_makespan_with_message_latency_and_bandwidth():
    # Each hop adds c = latency + bytes/bandwidth; the last microbatch crosses p-1 hops forward and
    # p-1 hops backward: makespan = 3m + (p-1)(3 + 2c).
    p, m = 4, 6
    costs = CostModel(latency=Fraction(1, 4), message_bytes=1000, bandwidth=4000)
    c = Fraction(1, 4) + Fraction(1000, 4000)
    result = simulate(build_schedule("gpipe", p, m).compute_only(), costs)
    assert result.makespan == 3 * m + (p - 1) * (3 + 2 * c)
    assert result.messages_sent == (m, 2 * m, 2 * m, m)
    assert result.bytes_sent == (1000 * m, 2000 * m, 2000 * m, 1000 * m)


def test_gpipe_with_uneven_stages_is_a_flow_shop():
    # Identical jobs through machines in series: the last job leaves after sum(t) + (m-1) max(t),
    # once for the forwards and once for the backwards.
    forward, backward, m = [1, 3, 2], [2, 5, 1], 4
    costs = CostModel(forward=forward, backward=lambda stage: backward[stage], step=Fraction(1, 2))
    result = simulate(build_schedule("gpipe", 3, m), costs)
    expected = sum(forward) + (m - 1) * max(forward) + sum(backward) + (m - 1) * max(backward) + Fraction(1, 2)
    assert result.makespan == expected
    assert result.busy_time == tuple(m * (f + b) + Fraction(1, 2) for f, b in zip(forward, backward))


def test_receive_placement_matters_only_when_messages_take_time():
    full = build_schedule("interleaved", 2, 4, 2)
    free = CostModel.per_chunk(2)
    placed_for_free, placed_again = simulate(full, free), simulate(full.compute_only(), free)
    assert (placed_for_free.makespan, placed_for_free.busy_time, placed_for_free.messages_sent) == \
        (placed_again.makespan, placed_again.busy_time, placed_again.messages_sent)
    # With latency, receives placed for free messages are posted late and hold their messages up;
    # lowering with the real costs posts them when the sender sends and recovers the closed form.
    p, m, c = 4, 6, Fraction(1, 2)
    slow = CostModel(latency=c)
    assert simulate(build_schedule("gpipe", p, m).compute_only(), slow).makespan == 3 * m + (p - 1) * (3 + 2 * c)
    assert simulate(build_schedule("gpipe", p, m), slow).makespan > 3 * m + (p - 1) * (3 + 2 * c)


def test_timeline_respects_order_and_dependencies():
    schedule = build_schedule("interleaved", 4, 8, 2)
    costs = CostModel.per_chunk(2, latency=Fraction(1, 5))
    events = simulate(schedule, costs).timeline.events
    compute = {(e.action.kind, e.action.stage, e.action.microbatch): e for e in events
               if e.action.kind in (ActionKind.F, ActionKind.B)}
    for rank in range(4):
        mine = [e for e in events if e.rank == rank and e.is_compute]
        assert [e.action for e in mine] == [a for a in schedule.actions[rank] if not a.kind.is_communication]
        assert all(earlier.end <= later.start for earlier, later in zip(mine, mine[1:]))
    for (kind, stage, microbatch), event in compute.items():
        if kind is ActionKind.F and stage > 0:
            assert event.start >= compute[(kind, stage - 1, microbatch)].end + Fraction(1, 5)
        if kind is ActionKind.B:
            assert event.start >= compute[(ActionKind.F, stage, microbatch)].end
            if stage < 7:
                assert event.start >= compute[(kind, stage + 1, microbatch)].end + Fraction(1, 5)


def test_float_costs_give_float_results():
    result = simulate(build_schedule("1f1b", 2, 4), CostModel(forward=0.5, backward=1.0))
    assert result.makespan == pytest.approx(1.5 * 5)
    assert result.bubble_fraction == pytest.approx(1 / 5)
