"""A training job as the scheduler sees it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Job:
    job_id: int
    job_type: str
    total_steps: int
    scale_factor: int = 1  # workers (accelerators) the job uses at once
    priority_weight: float = 1.0
    slo: float | None = None  # seconds after arrival by which it should finish; None for none
    arrival_time: float = 0.0  # seconds
    command: str = ""
    working_directory: str = ""
    num_steps_arg: str = ""
    needs_data_dir: bool = False
    entity: str = ""  # owner, for hierarchical policies

    @property
    def key(self) -> tuple[str, int]:
        """Row key of the throughput table."""
        return self.job_type, self.scale_factor
