"""GPipe: every rank runs all m forwards, then all m backwards, then steps (seed 002 Fig 4.3).

Bubble (p-1)/m of the ideal time; activations of all m microbatches are held at once.
"""

from __future__ import annotations

from megapipe.pipeline.ir.actions import Action, ActionKind


def gpipe(p: int, m: int) -> list[list[Action]]:
    return [[Action(ActionKind.F, rank, i) for i in range(m)]
            + [Action(ActionKind.B, rank, i) for i in range(m)]
            + [Action(ActionKind.STEP)]
            for rank in range(p)]
