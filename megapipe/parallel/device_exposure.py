"""Exposed communication on a GPU, from CUDA events: how long the compute streams stall on communication.

On a GPU the host does not wait for the device's collectives: it queues the collective on NCCL's
stream and makes the computing stream wait for it. So the span that matters is on the device: an
event recorded on the computing stream just before a collective is issued (or an asynchronous one
waited for) completes when the stream reaches that point, and one recorded just after completes
when the stream may go on, once the collective is done. The time between them is the stream's stall,
none of it covered by that stream's compute.

Outside an overlapped pair one stream computes for the rank, so each stall is exposed. Inside a pair
(``pipeline/pairs.py``: two passes on two streams, ``pipeline/streams.py``) a stall of one stream is
exposed only where the other stream stalls too; the piece is charged to the wait that began first,
as the host's count does. A pass's stalls after the other pass has ended but before the pair
has are not counted (the pair's gate keeps the two passes' ends close together).

``Spans.begin``/``end`` bracket one wait on the calling thread's current stream; ``seconds()`` waits
for the device, reads the events and returns the exposed seconds per kind since the last read.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Span:
    """One stall: ``window`` the pair it was in (None outside one), ``stream`` the stream's id."""
    window: Optional[int]
    stream: int
    kind: str
    start: float
    end: float


def exposed(spans: list[Span]) -> dict[str, float]:
    """Exposed seconds per kind of ``spans`` (times on one device clock)."""
    totals: dict[str, float] = {}
    for span in spans:
        if span.window is None:
            totals[span.kind] = totals.get(span.kind, 0.0) + span.end - span.start
    windows: dict[int, list[Span]] = {}
    for span in spans:
        if span.window is not None:
            windows.setdefault(span.window, []).append(span)
    for pair in windows.values():
        for kind, seconds in _both_stalled(pair).items():
            totals[kind] = totals.get(kind, 0.0) + seconds
    return totals


def _both_stalled(spans: list[Span]) -> dict[str, float]:
    """Within one pair: the time in which both streams stall, charged to the earlier-begun of the two stalls."""
    streams = sorted({span.stream for span in spans})
    if len(streams) < 2:
        return {}
    first = [s for s in spans if s.stream == streams[0]]
    second = [s for s in spans if s.stream == streams[1]]
    totals: dict[str, float] = {}
    for a in first:
        for b in second:
            overlap = min(a.end, b.end) - max(a.start, b.start)
            if overlap > 0:
                kind = a.kind if a.start <= b.start else b.kind
                totals[kind] = totals.get(kind, 0.0) + overlap
    return totals


class Spans:
    """The stalls recorded since the last read, as events on the device (``events``: a factory of timed
    events with ``record()``, ``elapsed_time(other)`` in ms and ``synchronize()``; ``stream()``: the calling
    thread's current stream's id)."""

    def __init__(self, events: Callable[[], object], stream: Callable[[], int]):
        self._events, self._stream = events, stream
        self._lock = threading.Lock()
        self._open: list[tuple[Optional[int], int, str, object, object]] = []
        self._window: Optional[int] = None
        self._windows = 0
        self._reference = self._recorded()

    def _recorded(self):
        event = self._events()
        event.record()
        return event

    def begin(self, kind: str) -> tuple:
        return self._window, self._stream(), kind, self._recorded()

    def end(self, started: tuple) -> None:
        window, stream, kind, start = started
        with self._lock:
            self._open.append((window, stream, kind, start, self._recorded()))

    def pair_starts(self) -> None:
        with self._lock:
            self._window, self._windows = self._windows, self._windows + 1

    def pair_ends(self) -> None:
        with self._lock:
            self._window = None

    def seconds(self) -> dict[str, float]:
        """Exposed seconds per kind since the last call (waits for the device to reach the last event)."""
        with self._lock:
            recorded, self._open = self._open, []
        self._recorded().synchronize()
        for *_, end in recorded:  # the main stream's last event covers a side stream's only once they rejoined
            end.synchronize()
        at = self._reference.elapsed_time
        spans = [Span(window, stream, kind, at(start) / 1e3, at(end) / 1e3)
                 for window, stream, kind, start, end in recorded]
        return exposed(spans)
