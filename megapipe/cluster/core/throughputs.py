"""The throughput matrix T: steps/s per (job type, scale factor) and worker type, alone and co-located.

Worker types named ``<type>_unconsolidated`` hold a multi-worker job's throughput when its workers
sit on different servers (seed 002 models placement sensitivity as such a second worker type).
Readers: the original system's JSON format, and megapipe's own planner predictions.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

from megapipe.errors import ConfigError

UNCONSOLIDATED = "_unconsolidated"
JobKey = tuple  # (job type, scale factor)


@dataclass
class ThroughputTable:
    """``isolated[worker][key]`` -> steps/s alone; ``pairs[worker][(key, other)]`` -> (steps/s, other's)."""

    isolated: dict = field(default_factory=dict)
    pairs: dict = field(default_factory=dict)

    @property
    def worker_types(self) -> list[str]:
        return sorted(self.isolated)

    def job_types(self) -> set[str]:
        return {key[0] for per_worker in self.isolated.values() for key in per_worker}

    def alone(self, job_type: str, scale_factor: int, worker_type: str) -> float:
        """Steps/s of the job alone; 0.0 where it cannot run (T = -inf in the chapter)."""
        value = self.isolated.get(worker_type, {}).get((job_type, scale_factor))
        return float(value) if value is not None and value > 0 else 0.0

    def colocated(self, key: JobKey, other: JobKey, worker_type: str) -> tuple[float, float]:
        """Steps/s of both jobs sharing each accelerator; (0, 0) where they cannot share."""
        value = self.pairs.get(worker_type, {}).get((key, other))
        if value is None:
            return 0.0, 0.0
        return float(value[0]), float(value[1])

    def has_unconsolidated(self, worker_type: str) -> bool:
        return worker_type + UNCONSOLIDATED in self.isolated

    def add_job_type(self, job_type: str, scale_factor: int, steps_per_second: dict[str, float]) -> None:
        """Add a row (e.g. a megapipe job predicted by the planner); no co-location entries."""
        for worker_type, value in steps_per_second.items():
            self.isolated.setdefault(worker_type, {})[(job_type, scale_factor)] = float(value)

    @staticmethod
    def load(path: str | Path) -> "ThroughputTable":
        """Read the original system's JSON: worker -> "('type', scale)" -> {"null": x, other: [a, b]}."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigError(f"--throughputs {path} cannot be read as JSON ({error}); pass a Gavel throughputs file.")
        table = ThroughputTable()
        for worker_type, entries in raw.items():
            isolated, pairs = table.isolated.setdefault(worker_type, {}), table.pairs.setdefault(worker_type, {})
            for key_text, entry in entries.items():
                key = _parse_key(key_text, path)
                isolated[key] = float(entry["null"])
                for other_text, values in entry.items():
                    if other_text != "null":
                        pairs[(key, _parse_key(other_text, path))] = (float(values[0]), float(values[1]))
        return table


def _parse_key(text: str, path) -> JobKey:
    try:
        job_type, scale_factor = ast.literal_eval(text)
        return str(job_type), int(scale_factor)
    except (ValueError, SyntaxError, TypeError):
        raise ConfigError(f"--throughputs {path}: job key {text!r} is not \"('<job type>', <scale factor>)\"; fix the file.")


def planner_steps_per_second(profile, clusters: dict, request) -> dict[str, float]:
    """Predicted steps/s of a megapipe model on each accelerator type, from the planner.

    ``clusters`` maps a worker type to a planner ``Cluster`` describing that accelerator; the best
    layout's samples/s divided by the global batch is one training step per second. This gives
    megapipe jobs a row of T without a separate profiling campaign.
    """
    from megapipe.planner.plan import plan

    return {
        worker_type: plan(profile, cluster, request).best.samples_per_second / request.global_batch_size
        for worker_type, cluster in clusters.items()
    }
