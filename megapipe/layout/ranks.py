"""Which global ranks form each parallel group, for given degrees: pure arithmetic, no processes.

Ranks are laid out tensor-innermost, then context, then data, then pipeline (Megatron's
tp-cp-dp-pp): ``rank = t_idx + t * (c_idx + c * (d_idx + d * p_idx))``, so the t ranks of a tensor
group are neighbours (one node), the context ranks of a sequence come next, and pipeline stages span
nodes. Every formula over this order (groups, coordinates, which node a rank sits on) is written
here; the experts' groups re-fold each stage's t x c x d ranks (``experts.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Optional

from megapipe.errors import ConfigError
from megapipe.layout.context_comm import check_comm_type
from megapipe.layout.degrees import Degrees
from megapipe.layout.experts import ExpertFold

AXES = ("tensor", "context", "data", "pipeline")  # innermost first


class Coords(NamedTuple):
    """A rank's indices; (tensor, data, pipeline) come first, as before context parallelism existed."""

    tensor: int
    data: int
    pipeline: int
    context: int = 0


@dataclass(frozen=True)
class RankLayout:
    """Which global ranks form each group for given parallel degrees."""

    tensor: int
    pipeline: int
    data: int
    expert: int = 1
    expert_tensor: Optional[int] = None  # None: the tensor degree (Megatron's default)
    context: int = 1
    hierarchical: Optional[tuple[int, int]] = None  # a2a+p2p: (all-to-all size, ring size) of the context ranks

    @staticmethod
    def for_world(world_size: int, tensor: int = 1, pipeline: int = 1, data: Optional[int] = None,
                  expert: int = 1, expert_tensor: Optional[int] = None, context: int = 1,
                  hierarchical: Optional[tuple[int, ...]] = None) -> "RankLayout":
        """Validate degrees against the world size; ``data`` defaults to what is left."""
        for flag, value in (("--tensor-model-parallel-size", tensor), ("--pipeline-model-parallel-size", pipeline),
                            ("--context-parallel-size", context)):
            if value < 1:
                raise ConfigError(f"{flag} {value} must be at least 1.")
        model = tensor * context * pipeline
        cp_flag = f" x --context-parallel-size {context}" if context > 1 else ""
        if data is None:
            if world_size % model:
                raise ConfigError(
                    f"world size {world_size} is not divisible by --tensor-model-parallel-size {tensor}{cp_flag} "
                    f"x --pipeline-model-parallel-size {pipeline}; launch a multiple of {model} processes.")
            data = world_size // model
        if model * data != world_size:
            cp_term = f" x context {context}" if context > 1 else ""
            raise ConfigError(
                f"world size {world_size} does not equal tensor {tensor}{cp_term} x pipeline {pipeline} x data {data} "
                f"(= {model * data}); change the parallel sizes or the number of processes.")
        if hierarchical is not None:
            check_comm_type(context, "a2a+p2p", hierarchical)
        layout = RankLayout(tensor, pipeline, data, expert, expert_tensor, context,
                            None if hierarchical is None else tuple(hierarchical))
        layout.fold  # checks the experts' degrees
        return layout

    @property
    def fold(self) -> ExpertFold:
        """How each stage's ranks form the experts' groups."""
        return ExpertFold.checked(self.expert, self.expert_tensor or self.tensor, self.tensor, self.data, self.context)

    @property
    def pipeline_size(self) -> int:
        """Ranks per pipeline group (the name ``PlanLayout`` answers too)."""
        return self.pipeline

    @property
    def data_size(self) -> int:
        """Slices a global batch is cut into: one per parallel pipeline."""
        return self.data

    @property
    def stage_replicas(self) -> None:
        """Every stage has ``data`` replicas in parallel pipelines (a stage plan's ``PlanLayout`` may say otherwise)."""
        return None

    @property
    def world_size(self) -> int:
        return self.tensor * self.context * self.data * self.pipeline

    def degrees(self, virtual: int = 1) -> Degrees:
        return Degrees(self.tensor, self.pipeline, (self.data,) * self.pipeline, virtual, context=self.context,
                       expert=self.expert)

    def rank(self, t: int, d: int, p: int, c: int = 0) -> int:
        return t + self.tensor * (c + self.context * (d + self.data * p))

    def loss_rank(self, last: int = -1) -> int:
        """The rank that logs the losses: tensor and context index 0 of replica 0 of the pipeline index
        ``last`` holding the last stage (-1, or 0 under the V placement)."""
        return self.rank(0, 0, last % self.pipeline)

    def coords(self, rank: int) -> Coords:
        """(tensor, data, pipeline, context) indices of a global rank."""
        t, rest = rank % self.tensor, rank // self.tensor
        c, rest = rest % self.context, rest // self.context
        return Coords(t, rest % self.data, rest // self.data, c)

    def _groups(self, *varying: str) -> list[list[int]]:
        """Ranks that differ only in the ``varying`` axes, one group per value of the others; groups
        and their members in ascending order of the outer axes first."""
        sizes = dict(zip(AXES, (self.tensor, self.context, self.data, self.pipeline)))
        stride = dict(zip(AXES, (self.rank(1, 0, 0), self.rank(0, 0, 0, 1), self.rank(0, 1, 0), self.rank(0, 0, 1))))

        def offsets(axes: list[str]) -> list[int]:
            return [sum(i * stride[a] for a, i in zip(axes, index))
                    for index in itertools.product(*(range(sizes[a]) for a in axes))]

        moving = offsets([axis for axis in reversed(AXES) if axis in varying])
        return [[first + step for step in moving] for first in offsets([a for a in reversed(AXES) if a not in varying])]

    def tensor_groups(self) -> list[list[int]]:
        return self._groups("tensor")

    def context_groups(self) -> list[list[int]]:
        """The c ranks that split each sequence, in context-index order (rank k holds chunks k and 2c-1-k)."""
        return self._groups("context")

    def data_groups(self) -> list[list[int]]:
        """Replicas of the same (t, c, p) position: they read different samples."""
        return self._groups("data")

    def data_context_groups(self) -> list[list[int]]:
        """The d x c ranks of a (t, p) position: dense gradients are averaged, and sharded, over them."""
        return self._groups("context", "data")

    def context_a2a_groups(self) -> list[list[int]]:
        return context_a2a_groups(self.context_groups(), self.hierarchical)

    def context_ring_groups(self) -> list[list[int]]:
        return context_ring_groups(self.context_groups(), self.hierarchical)

    def pipeline_groups(self) -> list[list[int]]:
        return self._groups("pipeline")

    def model_parallel_groups(self) -> list[list[int]]:
        """All t x p ranks that together hold one model replica (for one context index)."""
        return self._groups("tensor", "pipeline")

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


def context_a2a_groups(context_groups: list[list[int]], hierarchical: Optional[tuple[int, ...]]) -> list[list[int]]:
    """a2a+p2p: each context group cut into runs of the all-to-all size of consecutive context ranks."""
    if hierarchical is None:
        return []
    size = hierarchical[0]
    return [group[i:i + size] for group in context_groups for i in range(0, len(group), size)]


def context_ring_groups(context_groups: list[list[int]], hierarchical: Optional[tuple[int, ...]]) -> list[list[int]]:
    """a2a+p2p: the ranks at the same position of every all-to-all group of a context group."""
    if hierarchical is None:
        return []
    size = hierarchical[0]
    return [group[i::size] for group in context_groups for i in range(size)]
