"""The V placement and the schedules on it (ZBV, V-Half, V-Min, DualPipeV) on the simulator.

Units: F = BI = BW = 1 per virtual stage (a V rank holds two stages, so one microbatch is 6 units
of work per rank), free messages, exact integer and Fraction arithmetic. Activations are counted
in whole ranks' worth (one rank's layers for one microbatch: two V chunks), the unit in which
1F1B (one stage per rank) holds p. References: the bounds and closed forms of the papers, each
computed here independently of the generators:

* ZBV (Qi et al., ICLR 2024) has no bubble for every m it accepts (m >= 2p - 1, the bound): the
  batch takes 6m + p - 1, the least any order can (the last rank cannot start before p - 1
  forwards ran), with 1F1B's peak p.
* V-Half and V-Min (Qi et al., NeurIPS 2024) hold half and a third of 1F1B's activations up to a
  constant: exactly floor(p / 2) + 1 and floor((p + 4) / 3) once m >= p (never more below); their
  bubble is the same for every m (the values docs/schedules.md quotes, pinned here as regression
  values of the squeeze, not a closed form).
* DualPipeV's idle per rank is at most (p - 1)(F&B + B - 3W) (DualPipe's README, p counted in V
  ranks), reached by the busiest rank, for the two ends of what overlap can give
  (F&B = max(F, B) and F&B = F + B).
"""

import operator
from fractions import Fraction

import pytest

from megapipe.errors import ConfigError, ScheduleError
from megapipe.schedules.analysis.simulate import CostModel, simulate
from megapipe.schedules.actions import Action, ActionKind, Schedule, parse_action
from megapipe.schedules.schedule_file import load_schedule, save_schedule
from megapipe.schedules.catalog import build_schedule
from megapipe.schedules.validate import validate_schedule
from megapipe.layout.placement import Placement

pytestmark = pytest.mark.unit

UNIT = CostModel(forward=1, backward=2, input_backward=1, weight_backward=1)
SIZES = [(p, m) for p in range(2, 7) for m in sorted({2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 1, 4 * p})]


def test_v_placement_puts_the_last_stage_with_the_first():
    schedule = build_schedule("zbv", 4, 8, 2)
    assert [schedule.stages_on_rank(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [schedule.rank_of(s, 0) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [schedule.chunk_of_stage(s) for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    looped = build_schedule("interleaved", 4, 8, 2)
    assert looped.placement is Placement.LOOPED and looped.stages_on_rank(0) == [0, 4]


def test_the_turn_of_the_v_sends_nothing():
    schedule = build_schedule("zbv", 3, 6, 2)
    messages = [a for actions in schedule.actions for a in actions if a.kind.is_communication]
    assert not any(a.kind is ActionKind.SEND_F and a.stage == 2 for a in messages)  # stage 2 -> 3: one rank
    assert not any(a.kind is ActionKind.SEND_B and a.stage == 3 for a in messages)
    assert {(a.stage, a.peer) for a in messages if a.kind is ActionKind.SEND_F} == {(0, 1), (1, 2), (3, 1), (4, 0)}


@pytest.mark.parametrize("p, m", SIZES)
def test_zbv_has_no_bubble_with_1f1b_memory(p, m):
    zbv = simulate(build_schedule("zbv", p, m, 2), UNIT)
    one_f_one_b = simulate(build_schedule("1f1b", p, m), UNIT)
    assert zbv.makespan == 6 * m + p - 1
    assert zbv.idle_in_span[p - 1] == 0
    assert max(zbv.peak_activations) == max(one_f_one_b.peak_activations) == p


@pytest.mark.parametrize("name, peak", [("v-half", lambda p: p // 2 + 1), ("v-min", lambda p: (p + 4) // 3)])
@pytest.mark.parametrize("p", range(2, 9))
def test_v_half_and_v_min_hold_a_half_and_a_third(name, peak, p):
    for m in sorted({1, p - 1, p, p + 1, 2 * p}):
        held = max(simulate(build_schedule(name, p, m, 2), UNIT).peak_activations)
        assert held == peak(p) if m >= p else held <= peak(p), (m, held)


@pytest.mark.parametrize("name, extra", [("v-half", {2: 0, 4: 2, 6: 6}), ("v-min", {2: 0, 4: 8, 6: 12})])
def test_v_half_and_v_min_bubbles_do_not_grow_with_m(name, extra):
    # the squeezed block leaves the same idle time at the ends whatever the number of microbatches
    for p, bubble in extra.items():
        for m in (p, 2 * p, 3 * p):
            assert simulate(build_schedule(name, p, m, 2), UNIT).makespan == 6 * m + p - 1 + bubble


@pytest.mark.parametrize("overlap, pair", [(max, 2), (operator.add, 3)])
@pytest.mark.parametrize("p, m", SIZES)
def test_dualpipev_bubble_matches_its_closed_form(overlap, pair, p, m):
    result = simulate(build_schedule("dualpipev", p, m, 2), CostModel(forward=1, backward=2, input_backward=1,
                                                                       weight_backward=1, overlap=overlap))
    idle = [result.makespan - busy for busy in result.busy_time]
    assert max(idle) == (p - 1) * (pair + 2 - 3 * 1)  # (p - 1)(F&B + B - 3W)
    assert max(result.peak_activations) == Fraction(2 * p + 1, 2)


def test_overlapped_pairs_in_text_and_their_rules():
    schedule = build_schedule("dualpipev", 2, 4, 2)
    pairs = [a for actions in schedule.actions for a in actions if a.overlapped]
    assert pairs and all(a.kind is ActionKind.B for a in pairs)
    assert parse_action("&B3.1") == Action(ActionKind.B, 3, 1, overlapped=True) and str(pairs[0]).startswith("&B")
    bad = Schedule("bad", 1, 2, 1, [[parse_action(t) for t in "F0.0 &B0.0 F0.1 B0.1 STEP".split()]])
    with pytest.raises(ScheduleError, match="overlaps &B0.0 with F0.0"):
        validate_schedule(bad)
    with pytest.raises(ScheduleError, match="only a B or BI can be overlapped"):
        parse_action("&BW0.1")


@pytest.mark.parametrize("name, least", [("zbv", lambda p: 2 * p - 1), ("dualpipev", lambda p: 2 * p - 1)])
def test_too_few_microbatches_name_the_flag_and_least_value(name, least):
    with pytest.raises(ConfigError, match=rf"--pipeline-schedule {name} needs at least m={least(4)} .*"
                                          rf"m >= {least(4)}"):
        build_schedule(name, 4, least(4) - 1, 2)


@pytest.mark.parametrize("name", ["zbv", "v-half", "v-min", "dualpipev"])
def test_v_schedules_need_two_chunks_per_rank(name):
    for v in (1, 3):
        with pytest.raises(ConfigError, match=rf"--pipeline-schedule {name} places two model chunks per rank in "
                                              r"a V, but this run has v=\d; set --num-layers-per-virtual-pipeline"):
            build_schedule(name, 2, 8, v)


@pytest.mark.parametrize("suffix", [".txt", ".csv"])
def test_schedule_files_keep_the_placement(tmp_path, suffix):
    for name in ("zbv", "dualpipev", "interleaved"):
        schedule = build_schedule(name, 3, 6, 2)
        path = tmp_path / f"{name}{suffix}"
        save_schedule(schedule.compute_only() if suffix == ".txt" else schedule, path)
        loaded = load_schedule(path)
        assert loaded.placement is schedule.placement
        assert loaded.to_text() == schedule.to_text()


@pytest.mark.parametrize("name", ["zbv", "v-half", "v-min", "dualpipev"])
def test_per_rank_times_land_on_the_ranks_the_v_places_them(name):
    """Each rank's times (``CostModel.per_rank``) cost its own two chunks: stage s on rank s down the V and on
    2p - 1 - s back up, so every rank computes for m times its own F + BI + BW (pairs cost their sum here)."""
    p, m = 3, 6
    forward, input_backward, weight_backward = [1, 2, 4], [2, 3, 5], [1, 2, 3]
    schedule = build_schedule(name, p, m, 2)
    costs = CostModel.per_rank(p, 2, forward, input_backward, weight_backward, placement=schedule.placement,
                               overlap=operator.add)
    assert simulate(schedule, costs).busy_time == tuple(m * (forward[r] + input_backward[r] + weight_backward[r])
                                                        for r in range(p))
