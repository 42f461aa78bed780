"""ZBV (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section on ZB-V): the split
backward on the V placement, rank r holding stages r (chunk 0) and 2p-1-r (chunk 1).

Rank r's order, in the paper's phases: 2(p - r) - 1 forwards of chunk 0; r pairs (F chunk 1,
F chunk 0); p - r triples (F, BI, BW of chunk 1), the first backwards arriving as the V turns;
then the steady state F0, BI0, BW0, F1, BI1, BW1 per microbatch until every forward ran; a
cool-down of r pairs (BI0, BI1) and p - r pairs (BI0, BW0); the remaining BWs last, chunk 1's
first. With F = BI = BW = 1 per stage and free messages no rank idles once it has started:
the batch takes 6m + p - 1, the least possible (the last rank starts after p - 1 forwards),
and no rank holds more than p microbatches' worth of one rank's activations (2p chunks of
half a rank each), 1F1B's peak. It needs m >= 2p - 1: the warm-up alone starts 2p - 1
forwards on rank 0.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

from megapipe.errors import ConfigError
from megapipe.schedules.actions import Action, ActionKind
from megapipe.schedules.catalog.descriptor import (ClosedForms, ScheduleDescriptor, v_sizes, zero_bubble_bubble,
                                                       zero_bubble_time)
from megapipe.layout.placement import Placement, check_placement, stages_of_rank


def zbv(p: int, m: int, v: int) -> list[list[Action]]:
    check_placement(Placement.V, v, "zbv")
    check_v_microbatches("zbv", p, m, least_microbatches(p, v))
    return [_rank_actions(rank, p, m) for rank in range(p)]


def least_microbatches(p: int, v: int) -> int:
    """ZBV's and DualPipeV's warm-up alone starts 2p - 1 forwards on rank 0."""
    return 2 * p - 1


def check_v_microbatches(name: str, p: int, m: int, least: int) -> None:
    """One sentence naming the flag and the least m a V schedule runs with."""
    if p < 2:
        raise ConfigError(f"--pipeline-schedule {name} needs --pipeline-model-parallel-size of at least 2 (a V "
                          f"over the ranks), got {p}.")
    if m < least:
        raise ConfigError(f"--pipeline-schedule {name} needs at least m={least} microbatches at p={p}, got m={m}; "
                          f"raise --global-batch-size or lower --micro-batch-size so that m >= {least}.")


def _rank_actions(rank: int, p: int, m: int) -> list[Action]:
    down, up = stages_of_rank(Placement.V, p, 2, rank)
    actions: list[Action] = []
    runs: Counter = Counter()

    def run(kind: ActionKind, stage: int) -> None:
        actions.append(Action(kind, stage, runs[(kind, stage)]))
        runs[(kind, stage)] += 1

    for _ in range(2 * (p - rank) - 1):
        run(ActionKind.F, down)
    for _ in range(rank):
        run(ActionKind.F, up)
        run(ActionKind.F, down)
    for _ in range(p - rank):
        for kind in (ActionKind.F, ActionKind.BI, ActionKind.BW):
            run(kind, up)
    while runs[(ActionKind.F, up)] < m:
        if runs[(ActionKind.F, down)] < m:
            run(ActionKind.F, down)
        run(ActionKind.BI, down)
        run(ActionKind.BW, down)
        for kind in (ActionKind.F, ActionKind.BI, ActionKind.BW):
            run(kind, up)
    for _ in range(rank):
        run(ActionKind.BI, down)
        run(ActionKind.BI, up)
    for _ in range(p - rank):
        run(ActionKind.BI, down)
        run(ActionKind.BW, down)
    for stage in (up, down):
        while runs[(ActionKind.BW, stage)] < m:
            run(ActionKind.BW, stage)
    return actions + [Action(ActionKind.STEP)]


def _in_flight(p: int, m: int, v: int, rank: int) -> Fraction:
    return Fraction(p)  # 2p chunks of half a rank each, 1F1B's first rank


# Interleaved zero bubble's time and bubble with v = 2 (exact for equal ranks,
# tests/test_planner_schedule_costs.py).
DESCRIPTOR = ScheduleDescriptor(
    "zbv", zbv, "ZB-V: split backwards on the V, no rank idle once it has started",
    placement=Placement.V, sizes=v_sizes(least_microbatches), split_backward=True,
    costs=ClosedForms(in_flight=_in_flight, bubble=zero_bubble_bubble, batch_time=zero_bubble_time))
