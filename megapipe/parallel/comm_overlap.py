"""The gate that interleaves an overlapped pair's forward and backward, each on its own thread.

The executor runs the two passes of a pair (``schedules/overlap.py``) on two threads and gives
each this gate. A pass's communication marks its own segments: ``communicating(segment, backward)``
around an expert all-to-all ends the compute segment before it and starts the next one after it. The
gate is found by the pass's direction, not its thread: a process runs at most one forward and one
backward at a time, and on CUDA autograd runs a backward on a thread of its own. The gate
lets a pass run its k-th segment only in the slot the plan gives it, and moves to the next slot once
every pass in the current one has left it; so while one microbatch waits for its all-to-all the
other computes, and every rank issues its collectives in the same order (one pass computes at a
time, the other only waits for its exchange). Outside a pair ``communicating`` does nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Optional

from megapipe.parallel import exposure
from megapipe.schedules.overlap import PairPlan, Segment

_running: dict[bool, Optional["PairGate"]] = {False: None, True: None}  # per direction (backward?): its pair's gate


class PairGate:
    """Slots of one overlapped pair; ``record(backward, segment, start, end)`` (optional) sees each
    all-to-all's time on the host clock."""

    def __init__(self, plan: PairPlan, record: Optional[Callable[[bool, Segment, float, float], None]] = None):
        self.plan, self.record = plan, record
        self._cond = threading.Condition()
        self._segment = [0, 0]  # per pass (forward, backward): the segment it is in or waits for
        self._finished = [False, False]
        self._inside = [False, False]  # per pass: in an exchange now (nested ones count once)
        self._failed = False

    def _slot(self) -> int:
        """The slot running now: the earliest one a pass still has to run."""
        wanted = [self.plan.slot_of(bool(b), self._segment[b]) for b in (0, 1) if not self._finished[b]]
        return min(wanted, default=0)

    def _wait_turn(self, backward: bool) -> None:
        with exposure.idle(), self._cond:
            self._cond.wait_for(lambda: self._failed or self._slot() == self.plan.slot_of(backward,
                                                                                          self._segment[backward]))
            if self._failed:
                raise RuntimeError("the other pass of this overlapped pair failed")

    def _next(self, backward: bool) -> None:
        with self._cond:
            self._segment[backward] += 1
            self._cond.notify_all()

    def run(self, backward: bool, work: Callable[[], object]) -> object:
        """Run one pass of the pair on the calling thread, from its first segment to its end."""
        _running[backward] = self
        try:
            self._wait_turn(backward)
            return work()
        except BaseException:
            with self._cond:
                self._failed = True
                self._cond.notify_all()
            raise
        finally:
            _running[backward] = None
            with self._cond:
                self._finished[backward] = True
                self._cond.notify_all()

    @contextlib.contextmanager
    def exchange(self, backward: bool, segment: Segment):
        """Context around one all-to-all of a pass: it ends the compute segment before and starts the one after."""
        self._inside[backward] = True
        try:
            self._next(backward)  # the compute segment before the exchange ends
            self._wait_turn(backward)
            start = time.time()
            yield
            if self.record is not None:
                self.record(backward, segment, start, time.time())
            self._next(backward)
            self._wait_turn(backward)
        finally:
            self._inside[backward] = False


def communicating(segment: Segment, backward: bool):
    """Context around one expert all-to-all (``segment``: DISPATCH or COMBINE) of the forward or the backward
    now running; nested uses count once (a dispatch's count exchange and token exchange form one segment)."""
    gate = _running[backward]
    if gate is None or gate._inside[backward]:
        return contextlib.nullcontext()
    return gate.exchange(backward, segment)
