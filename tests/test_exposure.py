"""Exposed communication (``parallel/exposure.py``): only spans in which every computing thread is blocked
count, charged to the communication waited on longest; a helper thread's waits and a pass waiting for its
turn are not communication. The clock is the test's (``time.monotonic`` replaced), and the threads take
turns through events, so every span has a known length."""

import threading

import pytest

from megapipe.parallel import exposure

pytestmark = pytest.mark.unit


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(exposure.time, "monotonic", lambda: now[0])
    return now


def _added(before: dict, after: dict) -> dict:
    return {kind: after[kind] - before.get(kind, 0.0) for kind in after if after[kind] != before.get(kind, 0.0)}


def test_one_thread_exposes_exactly_its_waits(clock):
    before = exposure.totals()
    clock[0] += 5  # computing
    with exposure.waiting("tensor"):
        clock[0] += 2
    clock[0] += 7
    with exposure.waiting("data"):
        clock[0] += 0.25
        with exposure.waiting("tensor"):  # a wait inside a wait: the thread was blocked already
            clock[0] += 0.25
    assert _added(before, exposure.totals()) == {"tensor": 2.0, "data": 0.5}


def test_a_helper_threads_waits_expose_nothing(clock):
    before = exposure.totals()

    def helper():
        with exposure.waiting("data"):
            clock[0] += 3

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    assert exposure.totals() == before


def test_with_two_computing_threads_only_the_spans_both_wait_count(clock):
    """The second thread waits on an expert exchange while the first computes (hidden), then the first
    waits on a tensor collective too (exposed, charged to the expert exchange, waited on longest), then
    the second's exchange completes and it computes while the first still waits (hidden again)."""
    before = exposure.totals()
    waiting, first_waits, done, finish = (threading.Event() for _ in range(4))

    def second():
        try:
            with exposure.waiting("expert"):
                waiting.set()
                first_waits.wait()
            done.set()
            finish.wait()  # computing, as far as the count knows
        finally:
            exposure.thread_ends()

    thread = threading.Thread(target=second)
    exposure.thread_starts(thread)
    thread.start()
    waiting.wait()
    clock[0] += 4  # the first computes while the second's exchange travels
    with exposure.waiting("tensor"):
        clock[0] += 1.5  # both wait
        first_waits.set()
        done.wait()  # the second's exchange is over, it computes
        clock[0] += 3
    finish.set()
    with exposure.idle():  # the first waits for the second to end: it computes nothing, nor does the second
        thread.join()
    assert _added(before, exposure.totals()) == {"expert": 1.5}


def test_a_pass_waiting_for_its_turn_is_not_communication(clock):
    before = exposure.totals()
    blocked, release = threading.Event(), threading.Event()

    def second():
        try:
            with exposure.idle():
                blocked.set()
                release.wait()
        finally:
            exposure.thread_ends()

    thread = threading.Thread(target=second)
    exposure.thread_starts(thread)
    thread.start()
    blocked.wait()
    clock[0] += 2  # the first computes while the second waits for its turn
    with exposure.waiting("pipeline"):
        clock[0] += 1  # nobody computes: the message wait is exposed
    release.set()
    thread.join()
    assert _added(before, exposure.totals()) == {"pipeline": 1.0}
