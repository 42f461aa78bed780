"""Zero-bubble schedules ZB-H1, ZB-H2 and interleaved zero bubble (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024).

Each backward is split into BI (input gradient, on the critical path: the previous stage
waits for it) and BW (weight gradients, needed only by the STEP), and the BWs fill the idle
time that 1F1B leaves.

ZB-H1: 1F1B's order with B replaced by BI, and rank r delaying each BW by r microbatches
(the delayed BWs run in the cool-down, where 1F1B idles). With F = BI = BW every rank idles
p - 1 time units instead of 1F1B's 3 (p - 1), and no rank holds more than p microbatches'
activations, 1F1B's peak (on its first rank).

ZB-H2: the paper's greedy with a memory limit of 2p - 1 microbatches per rank: at every
moment a free rank runs a BI whose gradient has arrived, else a forward while it holds fewer
than 2p - 1 - r microbatches before their BI and fewer than 2p - 1 before their BW, else its
oldest pending BW. With F = BI = BW = 1 and m >= 2p - 1 no rank idles between its first and
its last action (the pipeline is a parallelogram; the offsets at both ends remain, p - 1
units per rank).

Interleaved zero bubble (``interleaved-zb``, the order of PyTorch's ScheduleInterleavedZeroBubble,
over v >= 2 looped chunks per rank): ZB-H1's rule on the interleaved order.
Microbatches go through the chunks in rounds of ``k = m / max(1, m // p)`` (p when p divides m):
a rank's j-th forward is chunk ``(j // k) % v``, its j-th input gradient chunk
``v - 1 - (j // k) % v``, each stage taking its microbatches in order. Rank r runs
``(v - 1) k + p - 1 - r`` warm-up forwards, then one forward and one BI at a time, and runs
the BW of its oldest BI from its (r + 1)-th BI on, the rest at the end.
"""

from __future__ import annotations

from fractions import Fraction

from megapipe.errors import ConfigError
from megapipe.schedules.actions import Action, ActionKind
from megapipe.schedules.catalog.descriptor import (ClosedForms, ScheduleDescriptor, Sizes, zero_bubble_bubble,
                                                       zero_bubble_time)


def _check_microbatches(name: str, p: int, m: int) -> None:
    if m < p:
        raise ConfigError(f"--pipeline-schedule {name} needs at least m={p} microbatches (one per pipeline rank), "
                          f"got m={m}; raise --global-batch-size or lower --micro-batch-size so that m >= {p}.")


def zb_h1(p: int, m: int) -> list[list[Action]]:
    _check_microbatches("zb-h1", p, m)
    return [_delayed_weights(rank, p - rank - 1, [(rank, i) for i in range(m)], [(rank, i) for i in range(m)])
            for rank in range(p)]


def interleaved_zb(p: int, m: int, v: int) -> list[list[Action]]:
    if v < 2:
        raise ConfigError(f"--pipeline-schedule interleaved-zb needs at least v=2 model chunks per rank, got v={v}; "
                          "set --num-layers-per-virtual-pipeline-stage so that v >= 2 (zb-h1 is its one-chunk form).")
    rounds = max(1, m // p)
    if m % rounds:
        least = next(n for n in range(m + 1, 2 * m) if n % max(1, n // p) == 0)
        raise ConfigError(f"--pipeline-schedule interleaved-zb runs m={m} microbatches in {rounds} rounds of equal "
                          f"size, which {m} does not allow; raise --global-batch-size so that m={least}.")
    per_round = m // rounds
    lists = []
    for rank in range(p):
        chunks = [(j // per_round) % v for j in range(m * v)]
        forwards = _in_stage_order(rank, p, chunks)
        input_grads = _in_stage_order(rank, p, [v - 1 - chunk for chunk in chunks])
        lists.append(_delayed_weights(rank, min((v - 1) * per_round + p - 1 - rank, m * v), forwards, input_grads))
    return lists


def _in_stage_order(rank: int, p: int, chunks: list[int]) -> list[tuple[int, int]]:
    """(stage, microbatch) of each pass of ``rank``, given its chunks in order; a stage takes its microbatches in order."""
    taken: dict[int, int] = {}
    passes = []
    for chunk in chunks:
        passes.append((chunk * p + rank, taken.get(chunk, 0)))
        taken[chunk] = taken.get(chunk, 0) + 1
    return passes


def _delayed_weights(rank: int, warmup: int, forwards: list[tuple[int, int]],
                     input_grads: list[tuple[int, int]]) -> list[Action]:
    """ZB-H1's rule: ``warmup`` forwards, then one forward and one BI at a time, then the BIs
    left; each BW runs once ``rank`` newer BIs have run, the rest at the end."""
    actions = [Action(ActionKind.F, *stage_microbatch) for stage_microbatch in forwards[:warmup]]
    pending: list[tuple[int, int]] = []

    def backward(stage_microbatch: tuple[int, int]) -> None:
        actions.append(Action(ActionKind.BI, *stage_microbatch))
        pending.append(stage_microbatch)
        if len(pending) > rank:
            actions.append(Action(ActionKind.BW, *pending.pop(0)))

    for forward, input_grad in zip(forwards[warmup:], input_grads):
        actions.append(Action(ActionKind.F, *forward))
        backward(input_grad)
    for input_grad in input_grads[len(forwards) - warmup:]:
        backward(input_grad)
    return actions + [Action(ActionKind.BW, *left) for left in pending] + [Action(ActionKind.STEP)]


def zb_h2(p: int, m: int) -> list[list[Action]]:
    _check_microbatches("zb-h2", p, m)
    return greedy_zero_bubble(p, m, before_input_grad=[2 * p - 1 - r for r in range(p)],
                              before_weight_grads=[2 * p - 1] * p)


def greedy_zero_bubble(p: int, m: int, before_input_grad: list[int], before_weight_grads: list[int]) -> list[list[Action]]:
    """Lists from the greedy of the module docstring, in unit time steps (F = BI = BW = 1).

    ``before_input_grad[r]`` and ``before_weight_grads[r]`` bound the microbatches rank r holds
    forwarded but not yet through BI, and not yet through BW.
    """
    forwards, input_grads = [0] * p, [0] * p
    pending: list[list[int]] = [[] for _ in range(p)]
    forward_end: dict[tuple[int, int], int] = {}
    input_grad_end: dict[tuple[int, int], int] = {}
    lists: list[list[Action]] = [[] for _ in range(p)]
    free_at = [0] * p
    time = 0
    while any(forwards[r] < m or input_grads[r] < m or pending[r] for r in range(p)):
        for rank in range(p):
            if free_at[rank] > time:
                continue
            i, j = input_grads[rank], forwards[rank]
            grad_ready = (forward_end if rank == p - 1 else input_grad_end).get(
                (rank if rank == p - 1 else rank + 1, i), time + 1) <= time
            input_ready = rank == 0 or forward_end.get((rank - 1, j), time + 1) <= time
            held = j - (i - len(pending[rank]))
            if i < j and grad_ready:
                action = Action(ActionKind.BI, rank, i)
                input_grads[rank] += 1
                pending[rank].append(i)
                input_grad_end[(rank, i)] = time + 1
            elif (j < m and input_ready and j - i < before_input_grad[rank]
                  and held < before_weight_grads[rank]):
                action = Action(ActionKind.F, rank, j)
                forwards[rank] += 1
                forward_end[(rank, j)] = time + 1
            elif pending[rank]:
                action = Action(ActionKind.BW, rank, pending[rank].pop(0))
            else:
                continue
            lists[rank].append(action)
            free_at[rank] = time + 1
        time += 1
    return [actions + [Action(ActionKind.STEP)] for actions in lists]


# Closed forms (split backward, weight gradients half the backward): ZB-H1 and ZB-H2 hold p and
# min(2p - 1, m) microbatches on every rank and take m max_r (t_f + t_b)_r plus the forwards of
# all ranks but the slowest: p - 1 forwards for equal ranks (exact there, as
# tests/test_zero_bubble_schedules.py simulates); interleaved zero bubble the same with the
# forwards' share divided by v, holding 1F1B's p when p divides m (its rounds of p microbatches:
# (v - 1) p + p chunk-microbatches), which is where it is planned (it takes more sizes, unplanned).

def _holds_p(p: int, m: int, v: int, rank: int) -> Fraction:
    return Fraction(p)  # the delayed weight gradients fill what 1F1B frees


def _zb_h2_in_flight(p: int, m: int, v: int, rank: int) -> Fraction:
    return Fraction(min(2 * p - 1, m))


def _rounds(p: int, m: int, v: int) -> int:
    return max(1, m // p)


def _multiple_of_p(p: int, m: int, v: int) -> int:
    return p


_AT_LEAST_P = Sizes(least_microbatches=lambda p, v: p)

ZB_H1 = ScheduleDescriptor(
    "zb-h1", zb_h1, "1F1B's order with split backwards, each BW on rank r delayed by r microbatches",
    sizes=_AT_LEAST_P, split_backward=True,
    costs=ClosedForms(in_flight=_holds_p, bubble=zero_bubble_bubble, batch_time=zero_bubble_time))
ZB_H2 = ScheduleDescriptor(
    "zb-h2", zb_h2, "greedy: BI first, then F under a limit of 2p-1 held microbatches, then BW",
    sizes=_AT_LEAST_P, split_backward=True,
    costs=ClosedForms(in_flight=_zb_h2_in_flight, bubble=zero_bubble_bubble, batch_time=zero_bubble_time))
INTERLEAVED_ZB = ScheduleDescriptor(
    "interleaved-zb", interleaved_zb, "ZB-H1's rule on the interleaved order, in rounds of about p microbatches",
    sizes=Sizes(least_chunks=2, most_chunks=None, microbatch_step=_rounds), split_backward=True,
    costs=ClosedForms(in_flight=_holds_p, bubble=zero_bubble_bubble, batch_time=zero_bubble_time,
                      sizes=Sizes(least_chunks=2, most_chunks=None, least_pipeline=2,
                                  least_microbatches=lambda p, v: p, microbatch_step=_multiple_of_p)))
