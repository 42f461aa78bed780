"""An optional record of when ring attention posted and finished each transfer and ran each block's
compute, so a benchmark can show the transfers overlapping the compute. Host clock times: on CPU
(gloo) they are the times; on an accelerator a block's compute is only queued at these times."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    phase: str   # "forward" or "backward"
    step: int    # ring step, 0 .. size-1 (the backward's last transfer, returning gradients, is step size)
    kind: str    # "transfer" (posted .. waited) or "compute"
    start: float
    end: float


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def add(self, phase: str, step: int, kind: str, start: float) -> None:
        self.events.append(Event(phase, step, kind, start, self.now()))

    def overlapped(self, phase: str) -> list[bool]:
        """Per step with a transfer: whether that step's compute ran while the transfer was in flight
        (posted before the compute began, waited after it ended)."""
        compute = {e.step: e for e in self.events if e.phase == phase and e.kind == "compute"}
        return [t.start <= compute[t.step].start and compute[t.step].end <= t.end
                for t in self.events if t.phase == phase and t.kind == "transfer" and t.step in compute]
