"""Iterations back to back on the replay: the end-of-iteration synchronisation and what removing it gains.

Unit costs (F = BI = BW = 1, free messages). With a barrier at every step each iteration takes
one batch's makespan, as ``simulate`` gives it. Without (optimizer post-validation), ZB-H2
(m >= 2p - 1) takes 3m per iteration: its ranks start and end one unit apart, so the next
iteration fills the p - 1 units each rank idles at the ends, and no rank waits for the
partial state of the rank before it (rank r - 1 ends first); with tied embeddings the first
stage would wait p - 1 for the last one's embedding gradient, all that was gained. 1F1B and
ZB-H1 gain nothing: their first rank ends last (1F1B) or with the others (ZB-H1), so its next
iteration, which every other rank waits for, cannot start earlier. ZBV (the V placement, two
chunks per rank, F = BI = BW = 1/2 per chunk) takes 3m per iteration instead of 3m + (p - 1)/2,
and there the tied embedding costs nothing: both its copies live on rank 0.
"""

from fractions import Fraction

import pytest

from megapipe.schedules.analysis.iterations import replay_iterations, steady_iteration_time, unrolled
from megapipe.schedules.analysis.simulate import CostModel, simulate
from megapipe.schedules.actions import ActionKind
from megapipe.schedules.catalog import build_schedule

pytestmark = pytest.mark.unit

UNIT = CostModel(forward=1, backward=2)  # BI = BW = 1


@pytest.mark.parametrize("p, m", [(2, 3), (2, 4), (4, 7), (4, 8), (4, 12)])
def test_zb_h2_takes_3m_per_iteration_without_the_step_synchronisation(p, m):
    schedule = build_schedule("zb-h2", p, m, 1)
    one_batch = simulate(schedule, UNIT).makespan
    assert one_batch == 3 * m + p - 1
    assert steady_iteration_time(schedule, UNIT, synchronized=True) == one_batch
    assert steady_iteration_time(schedule, UNIT, synchronized=False) == 3 * m
    free = replay_iterations(schedule, UNIT, 3, synchronized=False)
    assert free.makespan == 3 * 3 * m + p - 1
    assert free.chain_wait == 0
    assert free.tied_embedding_wait == p - 1


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_schedules_whose_first_rank_ends_no_earlier_gain_nothing(name):
    schedule = build_schedule(name, 4, 8, 1)
    one_batch = simulate(schedule, UNIT).makespan
    assert steady_iteration_time(schedule, UNIT, synchronized=True) == one_batch
    assert steady_iteration_time(schedule, UNIT, synchronized=False) == one_batch


def test_unrolled_lists_number_each_iterations_microbatches_apart():
    schedule = build_schedule("zb-h2", 2, 4, 1)
    lists = unrolled(schedule, 3)
    for rank, actions in enumerate(lists.actions):
        body = [a for a in schedule.compute_only().actions[rank] if a.kind is not ActionKind.STEP]
        assert len(actions) == 3 * len(body)
        assert [(a.kind, a.stage, a.microbatch - 8) for a in actions[2 * len(body):]] == \
            [(a.kind, a.stage, a.microbatch) for a in body]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 7), (4, 8)])
def test_zbv_takes_3m_per_iteration_and_its_tied_embedding_waits_for_nothing(p, m):
    schedule = build_schedule("zbv", p, m, 2)
    costs = CostModel.per_chunk(2)
    one_batch = simulate(schedule, costs).makespan
    assert one_batch == 3 * m + Fraction(p - 1, 2)
    assert steady_iteration_time(schedule, costs, synchronized=True) == one_batch
    assert steady_iteration_time(schedule, costs, synchronized=False) == 3 * m
    free = replay_iterations(schedule, costs, 3, synchronized=False)
    assert free.chain_wait == 0 and free.tied_embedding_wait == 0
