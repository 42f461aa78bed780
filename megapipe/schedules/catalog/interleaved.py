"""Interleaved 1F1B (seed 002 section 4.2.2, Fig 4.4 bottom), in Megatron-LM's order.

Each rank holds v chunks; virtual stage s = chunk * p + rank. Microbatches go through the
chunks in groups of p: a rank's k-th forward is microbatch ``(k // (p v)) p + k % p`` on
chunk ``(k % (p v)) // p``; its k-th backward is the same microbatch on the chunks in
reverse order. Rank r runs ``2 (p - r - 1) + (v - 1) p`` warm-up forwards (all of them
when m = p), then alternates one forward and one backward, then drains the backwards.
The bubble shrinks by v to (p-1)/(v m) of the ideal time, at the price of v times the
messages and ``p + (p-1)/v`` stages' worth of activations on the first rank.
"""

from __future__ import annotations

from fractions import Fraction

from megapipe.errors import ConfigError
from megapipe.schedules.actions import Action, ActionKind
from megapipe.schedules.catalog.descriptor import (ClosedForms, ScheduleDescriptor, Sizes, alternating_time,
                                                       flush_bubble)


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    if m % p:
        raise ConfigError(
            f"--pipeline-schedule interleaved needs the number of microbatches m={m} to be a multiple of "
            f"--pipeline-model-parallel-size {p}; change --global-batch-size or --micro-batch-size so that m is.")
    return [_rank_actions(rank, p, m, v) for rank in range(p)]


def _stage(rank: int, p: int, v: int, k: int, forward: bool) -> int:
    chunk = (k % (p * v)) // p
    return (chunk if forward else v - 1 - chunk) * p + rank


def _microbatch(p: int, v: int, k: int) -> int:
    return (k // (p * v)) * p + k % p


def _rank_actions(rank: int, p: int, m: int, v: int) -> list[Action]:
    total = m * v
    warmup = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p, total)

    def forward(k: int) -> Action:
        return Action(ActionKind.F, _stage(rank, p, v, k, True), _microbatch(p, v, k))

    def backward(k: int) -> Action:
        return Action(ActionKind.B, _stage(rank, p, v, k, False), _microbatch(p, v, k))

    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(warmup + k), backward(k)]
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions + [Action(ActionKind.STEP)]


def _in_flight(p: int, m: int, v: int, rank: int) -> Fraction:
    """(2 (p - rank - 1) + (v - 1) p + 1) / v stages' worth on rank r (all m when m = p), which
    seed 002 Table 7.1 rounds to p."""
    if m == p:
        return Fraction(m)
    return Fraction(min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v), v)


def _multiple_of_p(p: int, m: int, v: int) -> int:
    return p


# The batch time: 1F1B's with the fill and drain divided by v (exact for equal ranks; unequal
# chunks cause stalls it does not see). Planned with at least two chunks over at least two ranks
# (one chunk is 1F1B).
DESCRIPTOR = ScheduleDescriptor(
    "interleaved", interleaved, "Megatron's interleaved 1F1B over v chunks per rank",
    sizes=Sizes(most_chunks=None, least_microbatches=lambda p, v: p, microbatch_step=_multiple_of_p),
    costs=ClosedForms(in_flight=_in_flight, bubble=flush_bubble, batch_time=alternating_time,
                      sizes=Sizes(least_chunks=2, most_chunks=None, least_pipeline=2,
                                  least_microbatches=lambda p, v: p, microbatch_step=_multiple_of_p)))
