"""A CPU quota without cgroups: suspend and resume a process tree with a duty cycle, and lower its weight.

``python -m megapipe.cluster.worker.throttle PID FRACTION`` lets the process tree of ``PID`` (every
process group in it: torchrun starts each worker in a group of its own, ``process_tree.py``)
run ``FRACTION`` of every ``PERIOD`` seconds (SIGCONT, then SIGSTOP for the rest) until it is
gone, and resumes it for good when told to stop (SIGTERM). The duty cycle slows a job down on
idle cores; on cores that many processes share, the scheduler gives a resumed process back much
of what it missed, so each group's scheduling weight is lowered too (its niceness, and its session's autogroup on
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

from megapipe.cluster.worker.process_tree import process_groups, signal_groups

PERIOD = 0.1


def nice_for(fraction: float) -> int:
    """The niceness whose weight is about ``fraction`` of nice 0's (each step is a factor of 1.25)."""
    return min(19, round(math.log(1 / fraction) / math.log(1.25)))


def lower_weight(pgid: int, fraction: float) -> None:
    niceness = nice_for(fraction)
    os.setpriority(os.PRIO_PGRP, pgid, niceness)
    try:
        with open(f"/proc/{pgid}/autogroup", "w") as autogroup:  # each group's leader leads its session here
            autogroup.write(str(niceness))
    except OSError:
        pass  # no autogroups here: the niceness alone sets the weight


def throttle(pid: int, fraction: float) -> None:
    """Run ``pid``'s process tree (every process group of it) ``fraction`` of the time until it is gone."""
    lowered: set = set()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    groups = process_groups(pid)
    while groups and not stopping:
        for group in set(groups) - lowered:  # workers that started since the last period
            try:
                lower_weight(group, fraction)
            except ProcessLookupError:
                pass
            lowered.add(group)
        time.sleep(fraction * PERIOD)
        if stopping:
            break
        signal_groups(groups, signal.SIGSTOP)
        time.sleep((1 - fraction) * PERIOD)
        signal_groups(groups, signal.SIGCONT)
        groups = process_groups(pid)
    signal_groups(process_groups(pid), signal.SIGCONT)


if __name__ == "__main__":
    throttle(int(sys.argv[1]), float(sys.argv[2]))
