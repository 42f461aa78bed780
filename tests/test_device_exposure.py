"""Exposed communication read from device events (``parallel/device_exposure.py``): the arithmetic against
a brute-force count over every unit of time, and the wiring of ``exposure.on_device`` with stand-in
events on a clock the test moves (no GPU has recorded real ones yet)."""

import random

import pytest
import torch

from megapipe.parallel import exposure
from megapipe.parallel.device_exposure import Span, Spans, exposed

pytestmark = pytest.mark.unit
KINDS = ("tensor", "expert", "data")


def _brute_force(spans: list[Span], horizon: int) -> dict[str, float]:
    """Each unit of time [t, t + 1) (endpoints are integers): outside pairs every stall counts; inside a pair
    only where both streams stall, charged to the stall that began first."""
    totals: dict[str, float] = {}
    for t in range(horizon):
        middle = t + 0.5
        active = [s for s in spans if s.start < middle < s.end]
        for span in active:
            if span.window is None:
                totals[span.kind] = totals.get(span.kind, 0.0) + 1
        for window in {s.window for s in active if s.window is not None}:
            here = [s for s in active if s.window == window]
            if len({s.stream for s in here}) == 2:
                first = min(here, key=lambda s: s.start)
                totals[first.kind] = totals.get(first.kind, 0.0) + 1
    return totals


def _random_spans(rng: random.Random) -> list[Span]:
    """A timeline of one stream alone, then pairs of two streams, each stream's stalls apart from each other."""
    spans, t = [], 0
    for window in (None, 0, None, 1, 2):
        streams = (7,) if window is None else (7, 9)
        end = t
        for stream in streams:
            at = t
            for _ in range(rng.randint(0, 4)):
                at += rng.randint(0, 3)
                length = rng.randint(1, 5)
                spans.append(Span(window, stream, rng.choice(KINDS), at, at + length))
                at += length
            end = max(end, at)
        t = end + 1
    return spans


def test_exposed_seconds_equal_a_brute_force_count():
    rng = random.Random(4)
    for _ in range(300):
        spans = _random_spans(rng)
        want = _brute_force(spans, 200)
        got = {kind: seconds for kind, seconds in exposed(spans).items() if seconds}
        assert got == want, spans


class Clock:
    """Stand-in CUDA events: ``record`` reads the test's clock; times in ms as ``torch.cuda.Event`` gives them."""

    def __init__(self):
        self.now, self.stream = 0.0, 1

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.at = clock.now

            def elapsed_time(self, other):
                return (other.at - self.at) * 1e3

            def synchronize(self):
                pass

        return Event()


def test_on_device_counts_the_stalls_of_a_stream_and_ignores_idle_and_nested_waits():
    clock = Clock()
    before = exposure.totals()
    with exposure.on_device(torch.device("cpu"), Spans(clock.event, lambda: clock.stream)):
        with exposure.waiting("tensor"):
            clock.now += 2.0
            with exposure.waiting("data"):  # a wait inside a wait stalls the stream once
                clock.now += 1.0
        clock.now += 5.0  # computing
        with exposure.idle():  # waiting for the other pass of a pair: no communication
            clock.now += 4.0
        with exposure.waiting("expert"):
            clock.now += 0.5
        during = exposure.totals()
    gained = {kind: during.get(kind, 0.0) - before.get(kind, 0.0) for kind in KINDS}
    assert gained == {"tensor": 3.0, "expert": 0.5, "data": 0.0}
    assert exposure.totals() == during  # outside the block nothing more is read


def test_a_pair_counts_only_where_both_streams_stall():
    clock = Clock()
    spans = Spans(clock.event, lambda: clock.stream)
    spans.pair_starts()
    clock.stream = 1
    forward = spans.begin("expert")  # the forward's stream stalls over [0, 4)
    clock.now = 1.0
    clock.stream = 2
    backward = spans.begin("tensor")  # the backward's over [1, 3): both stall for 2 s, the forward's began first
    clock.now = 3.0
    spans.end(backward)
    clock.now = 4.0
    clock.stream = 1
    spans.end(forward)
    spans.pair_ends()
    clock.now = 6.0
    alone = spans.begin("data")
    clock.now = 6.5
    spans.end(alone)
    assert spans.seconds() == {"expert": 2.0, "data": 0.5}
    assert spans.seconds() == {}  # each stall is read once
