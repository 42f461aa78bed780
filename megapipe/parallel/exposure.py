"""Exposed communication: the wall-clock time in which this rank computes nothing because every thread
that computes for it waits on communication, by kind (tensor, data, pipeline, expert, context).

Communication that runs while compute goes on costs nothing; only what compute does not cover lengthens
a step. On the CPU with gloo the compute is the host's own, so a span in which each computing thread is
blocked, in a collective, a wait for an asynchronous one or a pipeline message, is exposed, and nothing
else is. One thread computes for a rank, except in an overlapped pair of passes
(``pipeline/pairs.py``), whose second thread counts while it runs; a pass waiting for its turn in the pair
(``comm_overlap.PairGate``) or for the other pass to end is ``idle``: blocked, but on no communication. An
exposed span is charged to the communication waited on longest (with one thread: the only wait there is).

``waiting(kind)`` is entered by ``progress.collective`` around every blocking collective and every wait
for an asynchronous one or a message; ``totals()`` is read by the trainer between steps. On a GPU the
host does not wait for the device's collectives, so within ``on_device(device)`` each wait is instead
bracketed by CUDA events on the waiting thread's stream and the stalls are read from the device
(``device_exposure.py``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Optional

import torch

from megapipe.parallel.device_exposure import Spans

KINDS = ("tensor", "context", "expert", "pipeline", "data")

_lock = threading.Lock()
_participants = 1  # threads computing for this rank now
_blocked = 0  # of them, blocked on communication or on their turn
_kinds: list[str] = []  # the kinds of the communication waits going on
_since: Optional[float] = None  # when the last of them blocked, while all are
_seconds: dict[str, float] = {}
_computing = {threading.main_thread()}
_nesting = threading.local()
_device: Optional[Spans] = None  # within ``on_device`` on CUDA: the stalls, as events


def totals() -> dict[str, float]:
    """Exposed seconds so far, per kind (a copy; within ``on_device``, read from the device)."""
    if _device is not None:
        stalls = _device.seconds()
        with _lock:
            for kind, seconds in stalls.items():
                _seconds[kind] = _seconds.get(kind, 0.0) + seconds
    with _lock:
        return dict(_seconds)


@contextlib.contextmanager
def on_device(device: torch.device, spans: Optional[Spans] = None) -> Iterator[None]:
    """Within the block, on CUDA (or given ``spans``), count the device's stalls instead of the host's waits."""
    global _device
    if spans is None and device.type != "cuda":
        yield
        return
    _device = spans or Spans(lambda: torch.cuda.Event(enable_timing=True),
                             lambda: torch.cuda.current_stream().cuda_stream)
    try:
        yield
    finally:
        totals()
        _device = None


def _span_ends() -> None:
    """Charge the exposed span going on, if any, to the communication waited on longest."""
    global _since
    if _since is not None and _kinds:
        _seconds[_kinds[0]] = _seconds.get(_kinds[0], 0.0) + time.monotonic() - _since
    _since = None


def _span_may_start() -> None:
    global _since
    if _blocked == _participants and _kinds:
        _since = time.monotonic()


@contextlib.contextmanager
def _blocked_on(kind: Optional[str]):
    global _blocked
    # a helper thread's waits hold up no compute; a wait inside a wait blocks its thread once
    if threading.current_thread() not in _computing or getattr(_nesting, "blocked", False):
        yield
        return
    if _device is not None:  # idle waits hold up no stream
        yield from _stalled(kind)
        return
    _nesting.blocked = True
    with _lock:
        _span_ends()
        _blocked += 1
        if kind is not None:
            _kinds.append(kind)
        _span_may_start()
    try:
        yield
    finally:
        _nesting.blocked = False
        with _lock:
            _span_ends()
            _blocked -= 1
            if kind is not None:
                _kinds.remove(kind)


def _stalled(kind: Optional[str]):
    """``_blocked_on`` within ``on_device``: a wait on communication is one stall bracketed by events."""
    if kind is None:
        yield
        return
    _nesting.blocked = True
    started = _device.begin(kind)
    try:
        yield
    finally:
        _nesting.blocked = False
        _device.end(started)


def waiting(kind: str):
    """Context: the calling thread waits on communication of ``kind``."""
    return _blocked_on(kind)


def idle():
    """Context: the calling thread waits, on no communication, for another computing thread (a pair's turn,
    the end of the pair's other pass)."""
    return _blocked_on(None)


def thread_starts(thread: threading.Thread) -> None:
    """``thread`` is about to compute for this rank too (an overlapped pair's backward)."""
    global _participants
    with _lock:
        _span_ends()
        _participants += 1
        _computing.add(thread)
    if _device is not None:
        _device.pair_starts()


def thread_ends() -> None:
    """Called by that thread as it ends."""
    global _participants
    with _lock:
        _participants -= 1
        _computing.discard(threading.current_thread())
        _span_may_start()
    if _device is not None:
        _device.pair_ends()
