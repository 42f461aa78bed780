"""Zero-bubble schedules ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

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
"""

from __future__ import annotations

from megapipe.errors import ConfigError
from megapipe.pipeline.ir.actions import Action, ActionKind


def _check_microbatches(name: str, p: int, m: int) -> None:
    if m < p:
        raise ConfigError(f"--pipeline-schedule {name} needs at least m={p} microbatches (one per pipeline rank), "
                          f"got m={m}; raise --global-batch-size or lower --micro-batch-size so that m >= {p}.")


def zb_h1(p: int, m: int) -> list[list[Action]]:
    _check_microbatches("zb-h1", p, m)
    return [_delayed_weights(rank, p, m) for rank in range(p)]


def _delayed_weights(rank: int, p: int, m: int) -> list[Action]:
    warmup = p - rank - 1
    actions = [Action(ActionKind.F, rank, i) for i in range(warmup)]
    pending: list[int] = []

    def backward(i: int) -> None:
        actions.append(Action(ActionKind.BI, rank, i))
        pending.append(i)
        if len(pending) > rank:
            actions.append(Action(ActionKind.BW, rank, pending.pop(0)))

    for i in range(m - warmup):
        actions.append(Action(ActionKind.F, rank, warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    return actions + [Action(ActionKind.BW, rank, i) for i in pending] + [Action(ActionKind.STEP)]


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
