"""Forward passes only, for evaluation: chunk by chunk, every microbatch through each chunk.

Not a training schedule (it has no B and no STEP, so the registry and the validator's
completeness rules do not apply); the communication pass places its messages as for any
other list.
"""

from __future__ import annotations

from megapipe.schedules.actions import Action, ActionKind, Schedule
from megapipe.schedules.communication import add_communication
from megapipe.layout.placement import Placement


def forward_only_schedule(p: int, m: int, v: int = 1, replicas=None,
                          placement: Placement = Placement.LOOPED) -> Schedule:
    """Rank r runs F of its virtual stages (those ``placement`` gives it) for microbatches 0..m-1,
    chunk-major (with replicated stages, ``replicas`` per stage: the microbatches round robin gives it)."""
    empty = Schedule("forward-only", p, m, v, [[] for _ in range(p)], replicas=replicas, placement=placement)
    lists = [[Action(ActionKind.F, stage, i) for stage in empty.stages_on_rank(rank)
              for i in empty.microbatches_on(rank, stage)] for rank in range(p)]
    return add_communication(empty.with_actions(lists))
