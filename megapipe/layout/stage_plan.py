"""A stage plan: which layers each pipeline stage holds and how many workers replicate it.

PipeDream's partitioner produces one (seed 002 section 2.3: a partition of the layers plus a
replication factor per stage, e.g. the "2-1" and "15-1" configurations). Written either as
``--pipeline-stages 0:12x2,12:24x1`` (layers [start, end) times replicas; ``x1`` may be left
out) or as a JSON file, which is what the planner writes::

    {"stages": [{"layers": [0, 12], "replicas": 2}, {"layers": [12, 24], "replicas": 1}]}

``read_stage_plan`` accepts either; ``StagePlan.validate`` checks it against the model's
layers and the world size. Every mistake is one sentence naming the flag and the fix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megapipe.errors import ConfigError

FLAG = "--pipeline-stages"
_ENTRY = re.compile(r"(\d+):(\d+)(?:x(\d+))?")


@dataclass(frozen=True)
class PlannedStage:
    layer_start: int
    layer_end: int
    replicas: int = 1


@dataclass(frozen=True)
class StagePlan:
    stages: tuple[PlannedStage, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(stage.replicas for stage in self.stages)

    @property
    def workers(self) -> int:
        return sum(self.replicas)

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [(stage.layer_start, stage.layer_end) for stage in self.stages]

    @property
    def equal_replication(self) -> Optional[int]:
        """The replication of every stage when they are all equal (parallel pipelines), else None."""
        return self.replicas[0] if len(set(self.replicas)) == 1 else None

    def to_json(self) -> dict:
        return {"stages": [{"layers": [s.layer_start, s.layer_end], "replicas": s.replicas} for s in self.stages]}

    def to_text(self) -> str:
        return ",".join(f"{s.layer_start}:{s.layer_end}x{s.replicas}" for s in self.stages)

    @classmethod
    def from_json(cls, data, source: str = FLAG) -> "StagePlan":
        try:
            stages = tuple(PlannedStage(int(entry["layers"][0]), int(entry["layers"][1]), int(entry.get("replicas", 1)))
                           for entry in data["stages"])
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise ConfigError(f"{source} is not a stage plan ({error!r}); write "
                              '{"stages": [{"layers": [0, 12], "replicas": 2}, ...]}.') from None
        return cls._checked(stages, source)

    @classmethod
    def parse(cls, text: str) -> "StagePlan":
        stages = []
        for entry in text.split(","):
            match = _ENTRY.fullmatch(entry.strip())
            if match is None:
                raise ConfigError(f"{FLAG} entry {entry.strip()!r} is not start:end or start:endxR; write e.g. "
                                  f"{FLAG} 0:12x2,12:24x1.")
            start, end, replicas = match.groups()
            stages.append(PlannedStage(int(start), int(end), int(replicas or 1)))
        return cls._checked(tuple(stages), FLAG)

    @classmethod
    def _checked(cls, stages: tuple[PlannedStage, ...], source: str) -> "StagePlan":
        if not stages:
            raise ConfigError(f"{source} names no stages; give at least one, e.g. 0:24x1.")
        for stage in stages:
            if stage.replicas < 1:
                raise ConfigError(f"{source} gives layers {stage.layer_start}:{stage.layer_end} {stage.replicas} "
                                  "replicas; every stage needs at least 1.")
            if stage.layer_end <= stage.layer_start:
                raise ConfigError(f"{source} stage {stage.layer_start}:{stage.layer_end} holds no layers; write "
                                  "start:end with start < end.")
        return cls(stages)

    def validate(self, num_layers: int, world_size: Optional[int] = None, tensor: int = 1, context: int = 1) -> None:
        """The stages must cover layers 0 .. num_layers - 1 in order, each exactly once, and the
        replicas times the tensor and context sizes must equal the world size."""
        expected = 0
        for stage in self.stages:
            if stage.layer_start > expected:
                raise ConfigError(f"{FLAG} leaves layers {expected}..{stage.layer_start - 1} unassigned; every "
                                  "layer needs exactly one stage, with stages in layer order.")
            if stage.layer_start < expected:
                raise ConfigError(f"{FLAG} gives layers {stage.layer_start}..{expected - 1} to two stages; every "
                                  "layer needs exactly one stage, with stages in layer order.")
            expected = stage.layer_end
        if expected != num_layers:
            what = (f"leaves layers {expected}..{num_layers - 1} unassigned" if expected < num_layers else
                    f"names layers up to {expected - 1}, but --num-layers is {num_layers}")
            raise ConfigError(f"{FLAG} {what}; the last stage must end at layer {num_layers}.")
        if world_size is not None and self.workers * tensor * context != world_size:
            cp = f" x --context-parallel-size {context}" if context > 1 else ""
            raise ConfigError(f"{FLAG} replicas add up to {self.workers} workers x --tensor-model-parallel-size "
                              f"{tensor}{cp} = {self.workers * tensor * context} processes, but the world has "
                              f"{world_size}; change the replicas or the number of processes.")


def layers_per_stage(num_layers: int, num_stages: int) -> int:
    """Layers of each stage when ``num_layers`` are split evenly over ``num_stages`` (virtual) stages:
    Megatron's split, which gives the remainder to no one (the flags' checks refuse one)."""
    return num_layers // num_stages


def equal_split(num_layers: int, num_stages: int, replicas: int = 1) -> StagePlan:
    """The stage plan every run without ``--pipeline-stages`` uses: equal stages, each replicated
    ``replicas`` times (data parallelism); stage s holds layers [s * n, (s + 1) * n)."""
    per = layers_per_stage(num_layers, num_stages)
    return StagePlan(tuple(PlannedStage(s * per, (s + 1) * per, replicas) for s in range(num_stages)))


def read_stage_plan(value: str) -> StagePlan:
    """A plan from the flag's value: a JSON file's path, or the comma-separated form."""
    path = Path(value)
    if value.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"{FLAG} file {value} does not exist; check the path.")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{FLAG} file {value} is not valid JSON ({error}); write it as the planner does.") \
                from None
        return StagePlan.from_json(data, f"{FLAG} file {value}")
    return StagePlan.parse(value)
