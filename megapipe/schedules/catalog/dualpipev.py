"""DualPipeV (DeepSeek's DualPipe "cut in half" onto the V placement): rank r holds stages r
(chunk 0) and 2p-1-r (chunk 1), and in its steady state runs one microbatch's forward
*overlapped* with another's backward on the other chunk (the ``&B`` pairs of the IR).

Rank r's order, in DualPipe's eight steps: (1) 2(p - r - 1) forwards of chunk 0; (2) r + 1
pairs F0, F1; (3) p - r - 1 triples BI1, the oldest pending BW, F1; (4) m - 2p + r + 1 rounds of
F0 & B1 then F1 & B0 (the last rank runs its very first F0 and B1 apart); (5) p - r - 1 rounds of
B1 then F1 & B0; (6) r + 1 pairs B1, B0, switching to split backwards (BI, BW queued) halfway;
(7) p - r - 1 rounds of the oldest BW then BI0; (8) the BWs left. In the overlapped rounds the
backwards are whole (B): the overlap, not the split, fills those slots.

Its bubble (DualPipe's README, with p counted in ranks of the V): each rank idles at most
(p - 1)(F&B + B - 3W), F&B being the time of an overlapped pair; with F = BI = BW = 1 per stage,
free messages and no gain from overlapping (F&B = F + B) every rank idles 2(p - 1), against
1F1B's 6(p - 1) on the same work. It needs m >= 2p - 1, the microbatches step 1 and 2 start on
rank 0, and holds 2p + 1 chunk activations at its peak (p + 1/2 ranks' worth).

How the overlap runs: the simulator charges each pair ``CostModel.overlap`` of its two times
(or, hiding expert all-to-alls, ``CostModel.pair_time``) and the pair starts when both have their
inputs (both receives are posted before the forward); the executor runs the forward, then the
backward, as torch's ``OVERLAP_F_B`` does by default, and with ``--overlap-moe-expert-parallel-comm``
both together, one microbatch's expert all-to-all beside the other's compute (``ir/overlap.py``,
``pipeline/pairs.py``).
"""

from __future__ import annotations

from collections import Counter, deque
from fractions import Fraction
from typing import Sequence

from megapipe.schedules.actions import Action, ActionKind
from megapipe.schedules.catalog.descriptor import ClosedForms, ScheduleDescriptor, v_sizes
from megapipe.schedules.catalog.zbv import check_v_microbatches, least_microbatches
from megapipe.layout.placement import Placement, check_placement, stages_of_rank


def dualpipev(p: int, m: int, v: int) -> list[list[Action]]:
    check_placement(Placement.V, v, "dualpipev")
    check_v_microbatches("dualpipev", p, m, least_microbatches(p, v))
    return [_rank_actions(rank, p, m) for rank in range(p)]


def _rank_actions(rank: int, p: int, m: int) -> list[Action]:
    down, up = stages_of_rank(Placement.V, p, 2, rank)
    actions: list[Action] = []
    forwards, backwards = Counter(), Counter()
    weights: deque[Action] = deque()

    def forward(stage: int) -> None:
        actions.append(Action(ActionKind.F, stage, forwards[stage]))
        forwards[stage] += 1

    def backward(stage: int, split: bool = False, overlapped: bool = False) -> None:
        microbatch = backwards[stage]
        backwards[stage] += 1
        actions.append(Action(ActionKind.BI if split else ActionKind.B, stage, microbatch, overlapped=overlapped))
        if split:
            weights.append(Action(ActionKind.BW, stage, microbatch))

    def oldest_weights() -> None:
        if weights:
            actions.append(weights.popleft())

    for _ in range(2 * (p - rank - 1)):
        forward(down)
    for _ in range(rank + 1):
        forward(down)
        forward(up)
    for _ in range(p - rank - 1):
        backward(up, split=True)
        oldest_weights()
        forward(up)
    for round_ in range(m - 2 * p + rank + 1):
        forward(down)
        backward(up, overlapped=not (round_ == 0 and rank == p - 1))
        forward(up)
        backward(down, overlapped=True)
    for _ in range(p - rank - 1):
        backward(up)
        forward(up)
        backward(down, overlapped=True)
    split = False
    for step in range(rank + 1):
        split = split or (step == (rank + 1) // 2 and rank % 2 == 1)
        backward(up, split=split)
        split = split or (step == (rank + 1) // 2 and rank % 2 == 0)
        backward(down, split=split)
    for _ in range(p - rank - 1):
        oldest_weights()
        backward(down, split=True)
    while weights:
        oldest_weights()
    return actions + [Action(ActionKind.STEP)]


# Closed forms with the pairs run one pass after the other, as megapipe's executor runs them
# (exact for equal ranks, tests/test_planner_schedule_costs.py): it holds p + 1/2 ranks' worth
# (p on rank 0 at m = 2p - 1, where rank 0 runs no overlapped round, so one chunk fewer) and
# takes ZB-H1's time: the weight gradients fill the rest of fill and drain.

def _in_flight(p: int, m: int, v: int, rank: int) -> Fraction:
    return Fraction(2 * p + (0 if rank == 0 and m == 2 * p - 1 else 1), 2)


def _bubble(p: int, m: int, v: int) -> Fraction:
    return Fraction(p - 1, 3 * m)  # ZB-H1's idle


def _batch_time(forward: Sequence[float], backward: Sequence[float], m: int, v: int) -> float:
    both = [f + b for f, b in zip(forward, backward)]
    return m * max(both) + sum(forward) - max(forward)


DESCRIPTOR = ScheduleDescriptor(
    "dualpipev", dualpipev, "DeepSeek's DualPipe cut in half onto the V; F & B pairs in its steady state",
    placement=Placement.V, sizes=v_sizes(least_microbatches), split_backward=True,
    costs=ClosedForms(in_flight=_in_flight, bubble=_bubble, batch_time=_batch_time))
