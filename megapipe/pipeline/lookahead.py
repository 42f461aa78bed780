"""What a rank's weight stores must know about the actions it will run next.

A forward may run on the live parameters only if its stage does not update before the
microbatch's backward; an update must stash the live version if a later forward of the stage
names it. Both are read from the rank's coming actions: the rest of the current call's
segment, then the next calls' segments (assuming the run goes on; if it drains instead, the
backwards and updates come in the same order and only forwards are missing, so the first
answer still holds and the second is undone by ``WeightVersionStore.forget_future``).
"""

from __future__ import annotations

from typing import Iterator, Optional

from megapipe.schedules.actions import Action, ActionKind


class Lookahead:
    """Scans ``program``'s segments of ``rank`` from a position on (a few segments are cached)."""

    def __init__(self, program, rank: int):
        self.program, self.rank = program, rank
        self.calls_ahead = program.horizon  # more calls than a microbatch stays in flight
        self._cache: dict[int, tuple[Action, ...]] = {}

    def segment(self, call: int) -> tuple[Action, ...]:
        if call not in self._cache:
            self._cache = {c: a for c, a in self._cache.items() if c >= call - 1}
            self._cache[call] = self.program.segment(self.rank, call)
        return self._cache[call]

    def _after(self, call: int, index: int) -> Iterator[Action]:
        """The actions after position ``index`` of call ``call``, over the next few calls."""
        yield from self.segment(call)[index + 1:]
        for later in range(call + 1, call + 1 + self.calls_ahead):
            yield from self.segment(later)

    def updates_before_backward(self, call: int, index: int, stage: int, microbatch: int) -> bool:
        """Whether ``stage`` updates between position ``index`` of call ``call`` and its B of ``microbatch``."""
        for action in self._after(call, index):
            if action.stage != stage:
                continue
            if action.kind is ActionKind.B and action.microbatch == microbatch:
                return False
            if action.kind is ActionKind.UPDATE:
                return True
        raise RuntimeError(f"no B{stage}.{microbatch} within {self.calls_ahead} calls of its forward")

    def next_forward_version(self, call: int, index: int, stage: int) -> Optional[int]:
        """The version the next forward of ``stage`` after that position names."""
        for action in self._after(call, index):
            if action.kind is ActionKind.F and action.stage == stage:
                return action.version
        raise RuntimeError(f"no forward of stage {stage} within {self.calls_ahead} calls")
