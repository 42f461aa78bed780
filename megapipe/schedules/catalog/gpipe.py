"""GPipe: every rank runs all m forwards, then all m backwards, then steps (seed 002 Fig 4.3).

Bubble (p-1)/m of the ideal time; activations of all m microbatches are held at once.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

from megapipe.schedules.actions import Action, ActionKind
from megapipe.schedules.catalog.descriptor import ClosedForms, ScheduleDescriptor, flush_bubble, phase_time


def gpipe(p: int, m: int) -> list[list[Action]]:
    return [[Action(ActionKind.F, rank, i) for i in range(m)]
            + [Action(ActionKind.B, rank, i) for i in range(m)]
            + [Action(ActionKind.STEP)]
            for rank in range(p)]


def _in_flight(p: int, m: int, v: int, rank: int) -> Fraction:
    return Fraction(m)  # seed 002 Table 7.1: (1, m), every microbatch held at once


def _batch_time(forward: Sequence[float], backward: Sequence[float], m: int, v: int) -> float:
    """All forwards, then all backwards: two flow shops, exact for ranks of any speed."""
    return phase_time(forward, m, v) + phase_time(backward, m, v)


DESCRIPTOR = ScheduleDescriptor(
    "gpipe", gpipe, "all forwards, then all backwards (GPipe)", alternates=False,
    costs=ClosedForms(in_flight=_in_flight, bubble=flush_bubble, batch_time=_batch_time))
