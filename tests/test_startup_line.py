"""The start-up line names every parallel degree, the schedule, the sharding level, the precision and
the fusion backend, counting a stage plan's stages (not its workers); every node that does not print
it says which rank and node do (``megapipe.training.startup``)."""

from __future__ import annotations

import pytest

from megapipe.layout.plan import PlanLayout
from megapipe.layout.placement import Placement
from megapipe.layout.ranks import RankLayout
from megapipe.layout.stage_plan import StagePlan
from megapipe.parallel.state import ParallelState
from megapipe.training.startup import startup_line, where_losses_are_logged

pytestmark = pytest.mark.unit


def state_of(layout, rank: int, stage_replicas=None, placement=Placement.LOOPED) -> ParallelState:
    """The ParallelState ``rank`` gets under ``layout``, without process groups (only their members)."""
    members = {}
    for role, groups in (("tensor", layout.tensor_groups()), ("data", layout.data_groups()),
                         ("pipeline", layout.pipeline_groups())):
        members[role] = next(group for group in groups if rank in group)
    return ParallelState(layout, rank, members=members, stage_replicas=stage_replicas, placement=placement)


def line_of(ps: ParallelState) -> str:
    return startup_line("gpt", ps, "1f1b", 8, 2, "optim", "bfloat16", "eager (why)", 261, "mock data")


def test_the_line_names_every_degree_the_schedule_sharding_precision_and_backend():
    layout = RankLayout(tensor=2, pipeline=2, data=2)
    ps = state_of(layout, layout.loss_rank())
    assert line_of(ps) == ("> GPT training on 8 ranks: t 2, c 1, e 1, p 2, v 1, d 2 | logged by rank 4: tensor 0/2, "
                           "stage 1/2, data 0/2 | schedule 1f1b with 8 microbatches of 2 | data-parallel sharding "
                           "optim | precision bfloat16 | fusion backend eager (why) | vocabulary 261 | mock data | "
                           "1 communicator per rank")  # the state of this test builds no groups


def test_a_two_stage_plan_counts_two_stages_not_its_three_workers():
    layout = PlanLayout(StagePlan.parse("0:2x2,2:4x1"))
    ps = state_of(layout, 2, stage_replicas=layout.stage_replicas)
    assert ps.rank == ps.loss_rank == 2
    assert "t 1, c 1, e 1, p 2, v 1, d 2,1 per stage | logged by rank 2: tensor 0/1, stage 1/2, data 0/1 |" \
        in line_of(ps)


def test_the_loss_rank_is_the_one_holding_the_last_stage():
    layout = RankLayout(tensor=2, pipeline=3, data=2)
    for placement, stage in ((Placement.LOOPED, 2), (Placement.V, 0)):
        holders = [r for r in range(layout.world_size)
                   if (ps := state_of(layout, r, placement=placement)).is_last_stage and ps.tp_rank == ps.dp_rank == 0]
        assert holders == [state_of(layout, 0, placement=placement).loss_rank] == [layout.rank(0, 0, stage)]


def test_every_other_node_says_which_rank_and_node_print_the_losses():
    layout = RankLayout(tensor=1, pipeline=2, data=4)  # 2 nodes of 4: the last stage is node 1
    said = {rank: where_losses_are_logged(state_of(layout, rank), rank % 4, 4) for rank in range(8)}
    assert said[0] == ("> node 0 (ranks 0-3) prints nothing more: rank 4, which holds the loss, prints the start-up "
                       "line and the losses on node 1 (torchrun --node-rank 1); that node's terminal or job log shows "
                       "the run.")
    assert all(line is None for rank, line in said.items() if rank != 0)
    assert where_losses_are_logged(state_of(layout, 0), 0, None) is None  # one process, or not torchrun
