"""The rules of asynchronous schedules: UPDATE actions and the weight versions F and B name.

A schedule is asynchronous when it updates its stages with UPDATE actions (PipeDream, 2BW)
instead of one STEP after a flush. Checked per rank and per stage it holds:

* every ``B s.j`` is applied by the first later ``UPDATE s.i`` with i >= j: no B runs after an
  UPDATE that should have applied it, none is left unapplied, and labels increase;
* the replicas of a stage run the same UPDATEs in the same order (each is a collective);
* ``F s.i`` and ``B s.i`` name the same version, which exists when F runs (at most the number
  of the stage's UPDATEs before it), and a stage's forwards never go back to an older version
  than an earlier forward used, so a version no later forward names can be freed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from megapipe.schedules.actions import ActionKind, Schedule

Fail = Callable[..., None]


def is_asynchronous(schedule: Schedule) -> bool:
    return any(a.kind is ActionKind.UPDATE for rank_actions in schedule.actions for a in rank_actions)


def check_updates_and_versions(schedule: Schedule, fail: Fail) -> None:
    """Call ``fail(schedule, rank, index, sentence)`` for the first rule a rank breaks."""
    labels_by_rank = [_check_rank(schedule, rank, fail) for rank in range(schedule.p)]
    for stage in range(schedule.num_stages):
        holders = schedule.ranks_of_stage(stage)
        first = labels_by_rank[holders[0]][stage]
        for rank in holders[1:]:
            if labels_by_rank[rank][stage] != first:
                fail(schedule, None, None, f"the replicas of stage {stage} (ranks {holders}) run different UPDATEs "
                                           f"({first} on rank {holders[0]}, {labels_by_rank[rank][stage]} on rank "
                                           f"{rank}); every replica must run the same UPDATEs in the same order.")


def _check_rank(schedule: Schedule, rank: int, fail: Fail) -> dict[int, list[int]]:
    labels: defaultdict[int, list[int]] = defaultdict(list)
    unapplied: defaultdict[int, set[int]] = defaultdict(set)
    forward_versions: dict[tuple[int, int], int] = {}
    latest_forward: dict[int, int] = {}
    for index, action in enumerate(schedule.actions[rank]):
        stage, microbatch, version = action.stage, action.microbatch, action.version
        if action.kind is ActionKind.UPDATE:
            if labels[stage] and microbatch <= labels[stage][-1]:
                fail(schedule, rank, index, f"rank {rank}: {action} follows UPDATE{stage}.{labels[stage][-1]}; the "
                                            "labels of a stage's UPDATEs must increase.")
            labels[stage].append(microbatch)
            unapplied[stage] = {j for j in unapplied[stage] if j > microbatch}
        elif action.kind is ActionKind.B:
            if labels[stage] and microbatch <= labels[stage][-1]:
                fail(schedule, rank, index, f"rank {rank} runs {action} after UPDATE{stage}.{labels[stage][-1]}, "
                                            "which should have applied its gradient; move the UPDATE after it.")
            if version != forward_versions.get((stage, microbatch)):
                fail(schedule, rank, index, f"rank {rank}: {action} names version {version} but its forward used "
                                            f"{forward_versions.get((stage, microbatch))}; both passes of a "
                                            "microbatch must use one weight version.")
            unapplied[stage].add(microbatch)
        elif action.kind is ActionKind.F:
            if version is None or version > len(labels[stage]):
                fail(schedule, rank, index, f"rank {rank}: {action} needs a weight version that exists, at most "
                                            f"{len(labels[stage])} (the UPDATEs of stage {stage} before it).")
            if version < latest_forward.get(stage, 0):
                fail(schedule, rank, index, f"rank {rank}: {action} goes back to version {version} after a forward "
                                            f"used {latest_forward[stage]}; forwards of a stage must not go back.")
            latest_forward[stage] = version
            forward_versions[(stage, microbatch)] = version
    for stage, left in unapplied.items():
        if left:
            fail(schedule, rank, None, f"rank {rank} never applies the gradient of B{stage}.{min(left)}; add an "
                                       f"UPDATE{stage}.i with i >= {min(left)} after it.")
    return labels
