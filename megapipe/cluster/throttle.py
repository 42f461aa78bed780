"""A CPU quota without cgroups: suspend and resume a process group with a duty cycle, and lower its weight.

``python -m megapipe.cluster.throttle PGID FRACTION`` lets the group run ``FRACTION`` of every
``PERIOD`` seconds (SIGCONT, then SIGSTOP for the rest) until the group is gone, and resumes it
for good when told to stop (SIGTERM). The duty cycle slows a job down on idle cores; on cores
that many processes share, the scheduler gives a resumed process back much of what it missed,
so the group's scheduling weight is lowered too (its niceness, and its session's autogroup on
Linux, to a weight of about FRACTION), which slows it as much there. It runs in its own session,
so a worker agent that dies leaves no job suspended forever: the throttle goes on until the job
ends.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time

PERIOD = 0.1


def nice_for(fraction: float) -> int:
    """The niceness whose weight is about ``fraction`` of nice 0's (each step is a factor of 1.25)."""
    return min(19, round(math.log(1 / fraction) / math.log(1.25)))


def lower_weight(pgid: int, fraction: float) -> None:
    niceness = nice_for(fraction)
    os.setpriority(os.PRIO_PGRP, pgid, niceness)
    try:
        with open(f"/proc/{pgid}/autogroup", "w") as autogroup:  # the job's session leader is the group leader
            autogroup.write(str(niceness))
    except OSError:
        pass  # no autogroups here: the niceness alone sets the weight


def throttle(pgid: int, fraction: float) -> None:
    try:
        lower_weight(pgid, fraction)
    except ProcessLookupError:
        return
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        while not stopping:
            time.sleep(fraction * PERIOD)
            if stopping:
                break
            os.killpg(pgid, signal.SIGSTOP)
            time.sleep((1 - fraction) * PERIOD)
            os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        return
    try:
        os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    throttle(int(sys.argv[1]), float(sys.argv[2]))
