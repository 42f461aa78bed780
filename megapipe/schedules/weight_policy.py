"""How a schedule keeps weight versions: one (flushes), one per in-flight input (PipeDream's
stashing) or two (2BW's double buffering). Pure Python: the schedule descriptors name a policy
and the runtime's version store (``pipeline/weights.py``) enforces it.

Version k of a stage is its weights after k updates. The policies, the most versions each
allows, and who uses them:

* ``single`` -- one version, never copied: the flush schedules (GPipe, 1F1B, interleaved, ...).
* ``stash`` -- any number: PipeDream's weight stashing, a version per in-flight microbatch
  (p - s on stage s of a straight pipeline), more with vertical sync.
* ``double_buffer`` -- at most two: PipeDream-2BW.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional


class WeightPolicy(str, Enum):
    SINGLE = "single"
    STASH = "stash"
    DOUBLE_BUFFER = "double_buffer"

    @property
    def most_versions(self) -> Optional[int]:
        return {"single": 1, "stash": None, "double_buffer": 2}[self.value]

    def versions(self, p: int, rank: int) -> int:
        """Copies of the weights rank ``rank`` of a straight pipeline of p ranks keeps (seed 002 Table 7.1):
        one per in-flight input with stashing (1F1B keeps p - rank in flight there), two with 2BW, else one."""
        if self is WeightPolicy.STASH:
            return p - rank
        return self.most_versions
