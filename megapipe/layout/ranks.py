"""Which global ranks form each parallel group, for given degrees: pure arithmetic, no processes.

Ranks are laid out tensor-innermost: ``rank = t_idx + t * (d_idx + d * p_idx)``, so the t ranks
of a tensor group are neighbours (one node) and pipeline stages span nodes (Megatron's order).
Every formula over this order (groups, coordinates, which node a rank sits on) is written here;
the experts' groups re-fold each stage's ranks (``experts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megapipe.errors import ConfigError
from megapipe.layout.degrees import Degrees
from megapipe.layout.experts import ExpertFold


@dataclass(frozen=True)
class RankLayout:
    """Which global ranks form each group for given parallel degrees."""

    tensor: int
    pipeline: int
    data: int
    expert: int = 1
    expert_tensor: Optional[int] = None  # None: the tensor degree (Megatron's default)

    @staticmethod
    def for_world(world_size: int, tensor: int = 1, pipeline: int = 1, data: Optional[int] = None,
                  expert: int = 1, expert_tensor: Optional[int] = None) -> "RankLayout":
        """Validate degrees against the world size; ``data`` defaults to what is left."""
        for name, flag, value in (("tensor", "--tensor-model-parallel-size", tensor),
                                  ("pipeline", "--pipeline-model-parallel-size", pipeline)):
            if value < 1:
                raise ConfigError(f"{flag} {value} must be at least 1.")
        if data is None:
            if world_size % (tensor * pipeline):
                raise ConfigError(
                    f"world size {world_size} is not divisible by --tensor-model-parallel-size {tensor} "
                    f"x --pipeline-model-parallel-size {pipeline}; launch a multiple of {tensor * pipeline} processes.")
            data = world_size // (tensor * pipeline)
        if tensor * pipeline * data != world_size:
            raise ConfigError(
                f"world size {world_size} does not equal tensor {tensor} x pipeline {pipeline} x data {data} "
                f"(= {tensor * pipeline * data}); change the parallel sizes or the number of processes.")
        ExpertFold.checked(expert, expert_tensor or tensor, tensor, data)
        return RankLayout(tensor, pipeline, data, expert, expert_tensor)

    @property
    def fold(self) -> ExpertFold:
        """How each stage's ranks form the experts' groups."""
        return ExpertFold.checked(self.expert, self.expert_tensor or self.tensor, self.tensor, self.data)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data

    def degrees(self, virtual: int = 1) -> Degrees:
        return Degrees(self.tensor, self.pipeline, (self.data,) * self.pipeline, virtual, expert=self.expert)

    def rank(self, t: int, d: int, p: int) -> int:
        return t + self.tensor * (d + self.data * p)

    def loss_rank(self, last: int = -1) -> int:
        """The rank that logs the losses: tensor index 0 of replica 0 of the pipeline index ``last``
        holding the last stage (-1, or 0 under the V placement)."""
        return self.rank(0, 0, last % self.pipeline)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tensor index, data index, pipeline index) of a global rank."""
        t = rank % self.tensor
        d = (rank // self.tensor) % self.data
        p = rank // (self.tensor * self.data)
        return t, d, p

    def tensor_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for t in range(self.tensor)]
                for p in range(self.pipeline) for d in range(self.data)]

    def data_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for d in range(self.data)]
                for p in range(self.pipeline) for t in range(self.tensor)]

    def pipeline_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for p in range(self.pipeline)]
                for d in range(self.data) for t in range(self.tensor)]

    def model_parallel_groups(self) -> list[list[int]]:
        """All t x p ranks that together hold one model replica."""
        return [[self.rank(t, d, p) for p in range(self.pipeline) for t in range(self.tensor)]
                for d in range(self.data)]

    def embedding_groups(self, last: int = -1) -> list[list[int]]:
        """First and last stage of each pipeline (``last``: the pipeline index holding the last stage):
        they share the tied word embedding."""
        return [sorted({g[0], g[last]}) for g in self.pipeline_groups()]

    def _stage_firsts(self) -> list[int]:
        return [self.rank(0, 0, p) for p in range(self.pipeline)]

    def expert_groups(self) -> list[list[int]]:
        return [g for first in self._stage_firsts() for g in self.fold.expert_groups(first)]

    def expert_tensor_groups(self) -> list[list[int]]:
        return [g for first in self._stage_firsts() for g in self.fold.expert_tensor_groups(first)]

    def expert_data_groups(self) -> list[list[int]]:
        return [g for first in self._stage_firsts() for g in self.fold.expert_data_groups(first)]
