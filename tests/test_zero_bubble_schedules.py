"""Split backward (BI/BW) in the IR and the zero-bubble schedules ZB-H1 and ZB-H2 on the simulator.

References: the closed forms of Qi et al. (ICLR 2024) at unit costs F = BI = BW = 1 (1F1B's B
= BI + BW = 2) and free messages, computed exactly (integers and Fractions): 1F1B idles
3 (p - 1) per rank, ZB-H1 p - 1 (a third); ZB-H2 has no idle time between a rank's first and
last action once m >= 2p - 1, and some below that bound. Peak activations: ZB-H1 holds p
microbatches like 1F1B's first rank, ZB-H2 2p - 1 (about twice). Interleaved zero bubble with v
chunks per rank (each chunk F = BI = BW = 1/v) idles (p - 1)/v per rank once m >= p, a third of
interleaved 1F1B's 3 (p - 1)/v, so its makespan is 3m + (p - 1)/v; a rank holds
((v - 1) k + p)/v stages' worth of microbatches (k = m / max(1, m // p), its round size), at most
m: 1F1B's p when p divides m. The planner's closed forms
(``planner/schedule_costs.py``) give the same batch time and memory.
"""

from fractions import Fraction

import pytest

from megapipe.errors import ConfigError, ScheduleError
from megapipe.schedules.analysis.simulate import CostModel, simulate
from megapipe.schedules.actions import Action, ActionKind, Schedule, parse_action
from megapipe.schedules.catalog import build_schedule
from megapipe.schedules.transport import ALL_TRANSPORTS
from megapipe.schedules.validate import validate_schedule
from megapipe.planner.schedule_costs import bubble_fraction, in_flight, microbatch_problem, pipeline_time

pytestmark = pytest.mark.unit

UNIT = CostModel(forward=1, backward=2, input_backward=1, weight_backward=1)
SIZES = [(p, m) for p in range(2, 6) for m in range(p, 3 * p + 1)]


def idle(result):
    return [result.makespan - busy for busy in result.busy_time]


@pytest.mark.parametrize("p, m", SIZES)
def test_zb_h1_idles_a_third_of_1f1b_with_its_memory(p, m):
    one_f_one_b = simulate(build_schedule("1f1b", p, m), UNIT)
    zb_h1 = simulate(build_schedule("zb-h1", p, m), UNIT)
    assert idle(one_f_one_b) == [3 * (p - 1)] * p
    assert idle(zb_h1) == [p - 1] * p
    assert zb_h1.makespan == 3 * m + p - 1
    assert max(zb_h1.peak_activations) == max(one_f_one_b.peak_activations) == p


@pytest.mark.parametrize("p, m", SIZES)
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_zb_idles_a_third_of_interleaved_1f1b(p, m, v):
    if m % max(1, m // p):
        with pytest.raises(ConfigError, match=r"--pipeline-schedule interleaved-zb runs m=\d+ microbatches in \d+ "
                                              r"rounds .*raise --global-batch-size so that m=\d+\."):
            build_schedule("interleaved-zb", p, m, v)
        return
    chunk = Fraction(1, v)
    unit_chunks = CostModel(forward=chunk, backward=2 * chunk, input_backward=chunk, weight_backward=chunk)
    result = simulate(build_schedule("interleaved-zb", p, m, v), unit_chunks)
    assert idle(result) == [Fraction(p - 1, v)] * p
    assert result.makespan == 3 * m + Fraction(p - 1, v)
    if m % p == 0:
        interleaved = simulate(build_schedule("interleaved", p, m, v), unit_chunks)
        assert idle(interleaved) == [3 * Fraction(p - 1, v)] * p
    round_size = m // max(1, m // p)
    assert result.peak_activations == (min(m, Fraction((v - 1) * round_size + p, v)),) * p


def test_interleaved_zb_bad_sizes_name_the_flag_and_least_value():
    with pytest.raises(ConfigError, match=r"--pipeline-schedule interleaved-zb needs at least v=2 .*v >= 2"):
        build_schedule("interleaved-zb", 4, 8, 1)
    with pytest.raises(ConfigError, match=r"m=9 microbatches in 2 rounds .*so that m=10\."):
        build_schedule("interleaved-zb", 4, 9, 2)


@pytest.mark.parametrize("p, m", SIZES)
def test_zb_h2_has_no_bubble_inside_once_m_reaches_2p_minus_1(p, m):
    zb_h2 = simulate(build_schedule("zb-h2", p, m), UNIT)
    if m >= 2 * p - 1:
        assert zb_h2.idle_in_span == (0,) * p
        assert zb_h2.makespan == 3 * m + p - 1  # only the parallelogram's offsets remain
        assert max(zb_h2.peak_activations) == 2 * p - 1  # 1F1B's p, about twice
    else:
        assert max(zb_h2.idle_in_span) > 0


def test_split_backward_text_and_lowering():
    schedule = build_schedule("zb-h1", 2, 3)
    assert schedule.to_text().splitlines()[1].split()[:5] == ["RECV_F1.0<0", "F1.0", "RECV_F1.1<0", "BI1.0",
                                                               "SEND_B1.0>0"]
    for actions in schedule.actions:  # SEND_B always follows the BI that makes its gradient
        for before, action in zip(actions, actions[1:]):
            if action.kind is ActionKind.SEND_B:
                assert (before.kind, before.stage, before.microbatch) == (ActionKind.BI, action.stage,
                                                                          action.microbatch)
    assert parse_action("BW0.2") == Action(ActionKind.BW, 0, 2)


def lists(text):
    return [[parse_action(token) for token in line.split()] for line in text.strip().splitlines()]


@pytest.mark.parametrize("text, message", [
    ("F0.0 BW0.0 BI0.0 STEP\n", "before BI0.0"),
    ("F0.0 BI0.0 STEP\n", "either one B or one BI and one BW"),
    ("F0.0 B0.0 BW0.0 STEP\n", "either one B or one BI and one BW"),
    ("F0.0 BI0.0 STEP BW0.0\n", "STEP after only 0 of its 1 backwards"),
])
def test_bad_split_backwards_are_named(text, message):
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(Schedule("bad", 1, 1, 1, lists(text)))


def test_split_and_whole_backwards_mix_under_both_transports():
    mixed = Schedule("mixed", 2, 2, 1, lists("F0.0 F0.1 B0.0 BI0.1 BW0.1 STEP\nF1.0 BI1.0 F1.1 B1.1 BW1.0 STEP"))
    validate_schedule(mixed, transports=ALL_TRANSPORTS)
    result = simulate(mixed, UNIT)
    assert result.makespan == 8


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_too_few_microbatches_name_the_flag_and_least_value(name):
    with pytest.raises(ConfigError, match=rf"--pipeline-schedule {name} needs at least m=4 .*m >= 4"):
        build_schedule(name, 4, 3)


@pytest.mark.parametrize("name, v", [("zb-h1", 1), ("zb-h2", 1), ("interleaved-zb", 2), ("interleaved-zb", 3)])
@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (4, 4), (4, 9), (4, 8)])
def test_planner_closed_forms_match_the_simulator(name, v, p, m):
    if microbatch_problem(name, p, m, v) is not None:
        return
    chunk = Fraction(1, v)
    simulated = simulate(build_schedule(name, p, m, v), CostModel(forward=chunk, backward=2 * chunk,
                                                                   input_backward=chunk, weight_backward=chunk))
    assert pipeline_time(name, [1] * p, [2] * p, m, v) == pytest.approx(float(simulated.makespan), rel=1e-12)
    assert [in_flight(name, p, m, v, rank) for rank in range(p)] == list(simulated.peak_activations)
    assert bubble_fraction(name, p, m, v) == Fraction(p - 1, v) / (3 * m)
