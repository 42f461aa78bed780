"""Forward passes only, for evaluation: chunk by chunk, every microbatch through each chunk.

Not a training schedule (it has no B and no STEP, so the registry and the validator's
completeness rules do not apply); the communication pass places its messages as for any
other list.
"""

from __future__ import annotations

from megapipe.pipeline.actions import Action, ActionKind, Schedule
from megapipe.pipeline.communication import add_communication


def forward_only_schedule(p: int, m: int, v: int = 1) -> Schedule:
    """Rank r runs F of its virtual stages r, r + p, ... for microbatches 0..m-1, chunk-major."""
    lists = [[Action(ActionKind.F, chunk * p + rank, i) for chunk in range(v) for i in range(m)]
             for rank in range(p)]
    return add_communication(Schedule("forward-only", p, m, v, lists))
