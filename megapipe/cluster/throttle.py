"""A CPU quota without cgroups: suspend and resume a process group with a duty cycle.

``python -m megapipe.cluster.throttle PGID FRACTION`` lets the group run ``FRACTION`` of every
``PERIOD`` seconds (SIGCONT, then SIGSTOP for the rest) until the group is gone, and resumes it
for good when told to stop (SIGTERM). It runs in its own session, so a worker agent that dies
leaves no job suspended forever: the throttle goes on until the job ends.
"""

from __future__ import annotations

import os
import signal
import sys
import time

PERIOD = 0.1


def throttle(pgid: int, fraction: float) -> None:
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
