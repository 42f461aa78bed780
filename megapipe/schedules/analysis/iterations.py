"""Iterations of a flush schedule back to back: what the synchronisation at each step costs.

A synchronous optimizer step all-reduces the gradient norm and overflow flag over every stage,
so no rank starts iteration k + 1 before every rank has finished iteration k's backwards: the
replay puts a barrier at each iteration boundary (``replay``'s barriers, a collective on a
communicator of its own). Under optimizer post-validation (``optim/post_validation.py``) there
is none, and each rank runs on into its next iteration as soon as its list and its inputs allow.
What post-validation still waits for is checked on the replay instead of modelled: the partial
state rank r receives at its step from rank r - 1 (a wait whenever rank r - 1 ends an iteration
later than rank r), and with tied embeddings the gradient sum of the first and last stage (a
wait of the earlier of their ranks for the later; none under the V placement, where one rank
holds both). ``chain_wait`` and ``tied_embedding_wait`` are the
longest of those waits; when they are not 0 the iteration time without barriers is a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from numbers import Real

from megapipe.schedules.analysis.simulate import CostModel
from megapipe.schedules.actions import ActionKind, Schedule
from megapipe.schedules.replay import replay


@dataclass(frozen=True)
class Iterations:
    """``iterations`` batches of a schedule replayed back to back."""

    makespan: Real
    ends: tuple[tuple[Real, ...], ...]  # [iteration][rank]: when the rank's last compute of it ended
    chain_wait: Real  # longest wait of a rank for the partial state of the rank before it (post-validation)
    tied_embedding_wait: Real  # longest wait of the first or last stage for the other's embedding gradient


def unrolled(schedule: Schedule, iterations: int) -> Schedule:
    """The compute of ``iterations`` batches of a flush schedule in one list per rank, iteration k's
    microbatches numbered k m .. k m + m - 1; the steps are left out (they cost nothing here)."""
    m = schedule.m
    lists = []
    for actions in schedule.compute_only().actions:
        body = [action for action in actions if action.kind is not ActionKind.STEP]
        lists.append([replace(a, microbatch=a.microbatch + k * m) for k in range(iterations) for a in body])
    return replace(schedule.compute_only(), name=f"{schedule.name} x{iterations}", actions=lists, batches=iterations)


def replay_iterations(schedule: Schedule, costs: CostModel, iterations: int, synchronized: bool) -> Iterations:
    """Replay ``iterations`` batches with (``synchronized``) or without a barrier at each step."""
    lists = unrolled(schedule, iterations)
    per_iteration = [len(actions) // iterations for actions in lists.actions]
    barriers = [[n * k for k in range(1, iterations)] for n in per_iteration] if synchronized else None
    steps = replay(lists, costs.compute_time, costs.transfer_time, barriers=barriers, pair=costs.pair_time)
    ends = [[0] * schedule.p for _ in range(iterations)]
    for step in steps:
        k = step.index // per_iteration[step.rank]
        ends[k][step.rank] = max(ends[k][step.rank], step.end)
    p = schedule.p
    chain = max((row[r - 1] - row[r] for row in ends for r in range(1, p)), default=0)
    first, last = schedule.rank_of_stage(0), schedule.rank_of_stage(schedule.num_stages - 1)
    tied = max(abs(row[last] - row[first]) for row in ends)  # 0 when one rank holds both (V placement)
    return Iterations(max(step.end for step in steps), tuple(map(tuple, ends)), max(chain, 0), tied)


def steady_iteration_time(schedule: Schedule, costs: CostModel, synchronized: bool, iterations: int = 4) -> Real:
    """Time one more iteration adds once the pipeline runs iteration after iteration."""
    return (replay_iterations(schedule, costs, iterations, synchronized).makespan
            - replay_iterations(schedule, costs, iterations - 1, synchronized).makespan)
