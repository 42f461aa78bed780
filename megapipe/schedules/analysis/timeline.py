"""A record of when each action ran on each rank: made by the simulator and by the real executor.

The executor calls ``timeline.record(rank, action, start, end)`` (seconds, one clock shared by
all ranks, e.g. ``time.time()`` after a barrier); ranks gather their ``to_dict()`` and
``Timeline.merge`` them. The simulator records in its own time unit. Compute actions
(F, B, STEP) are the busy time of a rank; sends and receives are recorded from posting to
arrival and overlap compute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from numbers import Rational, Real
from typing import Iterable, Optional

from megapipe.schedules.actions import Action, parse_action

_FORMAT = "megapipe-timeline"


@dataclass(frozen=True)
class Event:
    """``phase``: a part of the action's time spent in communication it runs itself (an expert all-to-all,
    ``dispatch`` or ``combine``, recorded under ``--overlap-moe-expert-parallel-comm``); None for the whole action."""

    rank: int
    action: Action
    start: Real
    end: Real
    phase: Optional[str] = None

    @property
    def is_compute(self) -> bool:
        return self.phase is None and not self.action.kind.is_communication


class Timeline:
    """Events per rank plus optional metadata (e.g. schedule name, p, m, v) for plots."""

    def __init__(self, events: Iterable[Event] = (), meta: Optional[dict] = None):
        self._events = list(events)
        self.meta = dict(meta or {})

    def __eq__(self, other) -> bool:
        return isinstance(other, Timeline) and (self._events, self.meta) == (other._events, other.meta)

    def record(self, rank: int, action: Action, start: Real, end: Real, phase: Optional[str] = None) -> None:
        self._events.append(Event(rank, action, start, end, phase))

    @property
    def events(self) -> list[Event]:
        return list(self._events)

    @property
    def ranks(self) -> list[int]:
        return sorted({event.rank for event in self._events})

    def busy_time(self) -> dict[int, Real]:
        """Per rank, the time during which it ran compute actions: the union of their spans (the two passes of
        an overlapped pair run at once under ``--overlap-moe-expert-parallel-comm``)."""
        busy = {rank: 0 for rank in self.ranks}
        reached = {}  # per rank, the end of the compute seen so far (events taken by start)
        for event in sorted((e for e in self._events if e.is_compute), key=lambda e: (e.rank, e.start)):
            start = max(event.start, reached.get(event.rank, event.start))
            if event.end > start:
                busy[event.rank] += event.end - start
                reached[event.rank] = event.end
        return busy

    def idle_fraction(self, window: Optional[tuple[Real, Real]] = None) -> dict[int, Real]:
        """Per rank, the share of a time window not spent in compute.

        The window defaults to each rank's own span, from its first compute start to its last
        compute end (robust to clock offsets between processes); the simulator passes the
        whole run (0, makespan) so the mean over ranks is the pipeline bubble fraction.
        """
        fractions = {}
        busy = self.busy_time()
        for rank in self.ranks:
            if window is None:
                compute = [e for e in self._events if e.rank == rank and e.is_compute]
                begin, end = min(e.start for e in compute), max(e.end for e in compute)
            else:
                begin, end = window
            span = end - begin
            fractions[rank] = ratio(span - busy[rank], span)
        return fractions

    def hidden_phases(self) -> tuple[float, float]:
        """(seconds of communication phases during which another action of the same rank computed, seconds of
        all phases): how much of the expert all-to-alls an overlapped pair hid. A computing action's time is
        its span less its own phases."""
        phases = [e for e in self._events if e.phase is not None]
        hidden = 0.0
        for phase in phases:
            for other in self._events:
                if other.rank != phase.rank or not other.is_compute or other.action == phase.action:
                    continue
                own = [p for p in phases if p.action == other.action and p.rank == other.rank]
                hidden += max(0.0, _meet(phase, other) - sum(_meet(phase, p) for p in own))
        return hidden, float(sum(p.end - p.start for p in phases))

    def to_dict(self) -> dict:
        return {"format": _FORMAT, "meta": self.meta,
                "events": [[e.rank, str(e.action), float(e.start), float(e.end)] + ([e.phase] if e.phase else [])
                           for e in self._events]}

    @classmethod
    def from_dict(cls, data: dict) -> "Timeline":
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a {_FORMAT} file; write it with Timeline.save")
        return cls((Event(rank, parse_action(text), start, end, *phase) for rank, text, start, end, *phase
                    in data["events"]), data.get("meta"))

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path) -> "Timeline":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def merge(cls, parts: Iterable["Timeline"]) -> "Timeline":
        """One timeline from per-rank parts gathered from several processes (same clock assumed)."""
        merged = cls()
        for part in parts:
            for key, value in part.meta.items():
                if merged.meta.setdefault(key, value) != value:
                    raise ValueError(f"cannot merge timelines whose {key} differs ({merged.meta[key]} vs {value})")
            merged._events.extend(part._events)
        return merged

    def to_chrome_trace(self, path, microseconds_per_unit: float = 1e6) -> None:
        """Write a Chrome/Perfetto trace: one process track per rank, compute and communication
        on two threads of it; times are multiplied by ``microseconds_per_unit`` (1e6: seconds)."""
        trace = []
        for rank in self.ranks:
            trace.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
            trace.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
            for tid, name in ((0, "compute"), (1, "communication")):
                trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
        for e in self._events:
            name = str(e.action) if e.phase is None else f"{e.action} {e.phase}"
            trace.append({"ph": "X", "name": name, "cat": e.action.kind.value, "pid": e.rank,
                          "tid": 0 if e.is_compute else 1, "ts": float(e.start) * microseconds_per_unit,
                          "dur": float(e.end - e.start) * microseconds_per_unit})
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms", "otherData": self.meta}, f)


def _meet(a: Event, b: Event) -> float:
    """How long two events ran at once."""
    return float(max(0, min(a.end, b.end) - max(a.start, b.start)))


def ratio(numerator: Real, denominator: Real) -> Real:
    """numerator / denominator, exact (a Fraction) when both are integers or Fractions."""
    if isinstance(numerator, Rational) and isinstance(denominator, Rational):
        return Fraction(numerator) / Fraction(denominator)
    return numerator / denominator
