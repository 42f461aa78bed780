"""PipeDream-Flush (1F1B): warm-up forwards, one-forward-one-backward, cool-down, flush.

Rank r first runs p - r - 1 warm-up forwards, so the last rank starts backwards at once;
then it alternates one forward and one backward; then it drains the remaining backwards and
steps (seed 002 section 3.2.2 and Fig 4.4 top). Same bubble as GPipe, but at most p - r
microbatches are in flight on rank r instead of m.
"""

from __future__ import annotations

from fractions import Fraction

from megapipe.errors import ConfigError
from megapipe.schedules.actions import Action, ActionKind
from megapipe.schedules.catalog.descriptor import (ClosedForms, ScheduleDescriptor, Sizes, alternating_time,
                                                       flush_bubble)


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    if m < p:
        raise ConfigError(
            f"--global-batch-size / (--micro-batch-size x data-parallel size) gives m={m} microbatches, fewer than "
            f"--pipeline-model-parallel-size {p}; raise the global batch size or lower the micro batch size so "
            f"m >= {p}, or use --pipeline-schedule gpipe.")
    return [_rank_actions(rank, p, m) for rank in range(p)]


def _rank_actions(rank: int, p: int, m: int) -> list[Action]:
    warmup = p - rank - 1
    actions = [Action(ActionKind.F, rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action(ActionKind.F, rank, warmup + i), Action(ActionKind.B, rank, i)]
    actions += [Action(ActionKind.B, rank, i) for i in range(m - warmup, m)]
    return actions + [Action(ActionKind.STEP)]


def _in_flight(p: int, m: int, v: int, rank: int) -> Fraction:
    """p - rank before the first backward (its warm-up plus one), fewer if the batch is smaller;
    seed 002 Table 7.1's (1, p) on the first rank."""
    return Fraction(min(p - rank, m))


# The batch time with t = t_f + t_b per rank is exact when the middle ranks are equal and the last
# rank's step is not shorter than the first's, as when the head outweighs the embedding; otherwise
# within two steps (tests/test_planner_schedule_costs.py).
DESCRIPTOR = ScheduleDescriptor(
    "1f1b", one_f_one_b, "warm-up, one forward one backward, cool-down (PipeDream-Flush)",
    sizes=Sizes(least_microbatches=lambda p, v: p),
    costs=ClosedForms(in_flight=_in_flight, bubble=flush_bubble, batch_time=alternating_time))
