"""The contract between the scheduler service and whatever runs a job's ranks.

The service decides, per round, which hosts and how many devices of which type each job gets
(``Launch``); a backend starts the job's ranks there (one torchrun node rank per host), reports
its exit code when it ends, and stops it when its lease is not renewed. The local worker agents
and the Slurm backend both implement ``Backend``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol


@dataclass(frozen=True)
class HostSlots:
    host: str            # worker host name (as the agent or Slurm node declares it)
    worker_type: str     # accelerator type, e.g. "fast", "slow", "v100"
    devices: int         # devices given to this job on that host


@dataclass(frozen=True)
class Launch:
    job_id: int
    command: list[str]   # the job's megapipe command line, e.g. ["pretrain_gpt.py", "--train-iters", "40", ...]
    hosts: tuple[HostSlots, ...]
    env: dict[str, str]  # extra environment (lease address, etc.)
    log_path: str        # file the job's output is appended to, over all its allocations


class Backend(Protocol):
    """Starts and stops the ranks of one job's allocation for one lease."""
    def start(self, launch: Launch) -> None: ...      # launch torchrun on every host (one node rank per host)
    def poll(self, job_id: int) -> Optional[int]: ... # None while running, else the exit code
    def stop(self, job_id: int, grace_seconds: float) -> None: ...  # SIGTERM (the training loop saves and exits), then SIGKILL
