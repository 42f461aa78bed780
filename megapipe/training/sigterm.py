"""When SIGTERM first reached this process, noted from the entry point's first line on.

A preempting scheduler (Slurm: ``--signal``, KillWait, GraceTime) sends SIGTERM and, a grace
period later, SIGKILL. The entry points install a ``SigtermNotice`` before importing torch, so
a SIGTERM during start-up is noted instead of killing the process, and the training loop
(``exits.ExitConditions``) learns it and when it came: the grace period counts from the first
SIGTERM, and a second one changes nothing. No torch here: it is imported after.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional


class SigtermNotice:
    """Installed as the SIGTERM handler: ``first`` is the monotonic time of the first SIGTERM, ``count``
    how many arrived."""

    def __init__(self):
        self.first: Optional[float] = None
        self.count = 0

    def install(self) -> "SigtermNotice":
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def uninstall(self) -> None:
        """Give SIGTERM back to its default action (it ends the process), and deliver one that came meanwhile."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.count:
            os.kill(os.getpid(), signal.SIGTERM)

    def _handle(self, signum, frame) -> None:
        if self.first is None:
            self.first = time.monotonic()
        self.count += 1
