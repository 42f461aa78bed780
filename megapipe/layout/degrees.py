"""The parallel degrees of a run, written the one way every report shows them.

Megatron's rank order names them t (tensor), c (context), e (expert), p (pipeline stages), v
(model chunks per pipeline rank) and d (data-parallel replicas). Context parallelism (c) splits
each sequence over c ranks of one replica; a stage plan has none (c = 1). Expert parallelism (e)
splits only the MoE layers' experts, over ranks the dense layers use as data-parallel or context
ranks (``experts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Degrees:
    tensor: int
    pipeline: int
    data: tuple[int, ...]  # replicas of each stage: all equal, except under a --pipeline-stages plan
    virtual: int = 1
    context: int = 1
    expert: int = 1

    def text(self) -> str:
        """``t 2, c 1, e 1, p 2, v 1, d 2``; unequal replicas per stage read ``d 2,1 per stage``."""
        data = str(self.data[0]) if len(set(self.data)) == 1 else ",".join(map(str, self.data)) + " per stage"
        return (f"t {self.tensor}, c {self.context}, e {self.expert}, p {self.pipeline}, v {self.virtual}, "
                f"d {data}")
