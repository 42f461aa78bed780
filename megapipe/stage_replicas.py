"""Where the replicas of each stage sit: workers are numbered stage by stage.

Replica r of stage s (stages replicated ``replicas[s]`` times, as PipeDream's "2-1" plan) is
worker ``sum(replicas[:s]) + r``. The schedule IR, the parallel state and the plan's rank layout
all answer "which worker runs what" with these two functions.
"""

from __future__ import annotations


def first_worker(replicas: tuple[int, ...], stage: int) -> int:
    """The worker of replica 0 of ``stage``."""
    return sum(replicas[:stage])


def stage_of_worker(replicas: tuple[int, ...], worker: int) -> int:
    """The stage ``worker`` holds a replica of."""
    first = 0
    for stage, count in enumerate(replicas):
        if worker < first + count:
            return stage
        first += count
    raise ValueError(f"worker {worker} is outside the stage replicas {list(replicas)}")
