"""Runs an overlapped pair's forward and backward together (``--overlap-moe-expert-parallel-comm``).

The backward runs on a thread of its own, the forward on the caller's, each on CUDA under the stream
``streams.PassStreams`` gives it (two different ones); a ``PairGate`` interleaves them by the IR's plan (``schedules/overlap.py``), so one
microbatch's expert all-to-all is in flight while the other computes. Each pass computes exactly
what it computes alone, in the same order, so the results are those of running them one after the
other, bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, ContextManager, Optional

from megapipe.parallel import exposure
from megapipe.parallel.comm_overlap import PairGate
from megapipe.schedules.overlap import PAIR, Segment

Record = Optional[Callable[[bool, Segment, float, float], None]]


def run_pair(forward: Callable[[], object], backward: Callable[[], object], record: Record = None,
             forward_stream: Callable[[], ContextManager] = contextlib.nullcontext,
             backward_stream: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
    """Run both passes, each inside its stream context; ``record(backward, segment, start, end)`` sees each
    all-to-all's time."""
    gate = PairGate(PAIR, record)
    failures: list[BaseException] = []

    def run_backward() -> None:
        try:
            with backward_stream():
                gate.run(True, backward)
        except BaseException as error:  # handed to the caller's thread
            failures.append(error)
        finally:
            exposure.thread_ends()

    thread = threading.Thread(target=run_backward, name="overlapped backward", daemon=True)
    exposure.thread_starts(thread)
    thread.start()
    try:
        with forward_stream():
            gate.run(False, forward)
    finally:
        with exposure.idle():
            thread.join()
    if failures:
        raise failures[0]
