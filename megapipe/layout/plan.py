"""Ranks and process groups for a stage plan whose stages may be replicated.

Workers are numbered stage by stage: replica r of stage s is worker ``sum(R[:s]) + r``. Each
worker is t consecutive ranks (tensor-innermost, as in ``RankLayout``): rank = worker * t +
tensor index. An equally replicated plan (R copies of every stage) therefore gets exactly
the ranks and groups of ``RankLayout(t, p, R)``: R parallel pipelines. Any other plan runs
1F1B-RR, which sends microbatch i to replica i % R of each stage, so its pipeline group holds
every worker (one per tensor index) and the schedule has one action list per worker.

Groups: tensor (a worker's t ranks), data (the replicas of a stage: their gradients are
averaged before each update), pipeline (as above), model_parallel (the ranks of one pipeline;
with unequal replication, all ranks), embedding (first and last stage of each pipeline).
A stage's ranks are consecutive (its replicas' workers, tensor-innermost), so the experts' groups
fold each stage's t x R ranks as ``RankLayout`` folds its stages' (``experts.py``): a plan assigns
layers to stages, and the experts of a stage's MoE layers are split over that stage's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megapipe.layout.degrees import Degrees
from megapipe.layout.experts import ExpertFold
from megapipe.layout.stage_plan import StagePlan
from megapipe.layout.placement import first_worker


@dataclass(frozen=True)
class PlanLayout:
    plan: StagePlan
    tensor: int = 1
    expert: int = 1
    expert_tensor: Optional[int] = None  # None: t

    @property
    def world_size(self) -> int:
        return self.plan.workers * self.tensor

    @property
    def pipeline_size(self) -> int:
        """Ranks per pipeline group: one per stage, or every worker when replication is unequal (1F1B-RR)."""
        return self.plan.num_stages if self.plan.equal_replication is not None else self.plan.workers

    @property
    def data_size(self) -> int:
        """Slices a global batch is cut into: one per parallel pipeline. Under 1F1B-RR every worker
        sees the whole batch and the schedule routes microbatch i to replica i % R of each stage."""
        return self.plan.equal_replication or 1

    @property
    def stage_replicas(self) -> Optional[tuple[int, ...]]:
        """Workers per stage when the pipeline group holds replicated stages, else None."""
        return None if self.plan.equal_replication is not None else self.plan.replicas

    def degrees(self, virtual: int = 1) -> Degrees:
        """p counts the plan's stages (not the ranks of its pipeline group) and d their replicas."""
        return Degrees(self.tensor, self.plan.num_stages, self.plan.replicas, virtual, expert=self.expert)

    def loss_rank(self, last: int = -1) -> int:
        """The rank that logs the losses: tensor index 0 of the first replica of the last stage (a stage plan
        is looped, so ``last``, which ``RankLayout.loss_rank`` takes for the V placement, changes nothing)."""
        return self.rank(self.worker(self.plan.num_stages - 1, 0), 0)

    def worker(self, stage: int, replica: int) -> int:
        return first_worker(self.plan.replicas, stage) + replica

    def rank(self, worker: int, tensor_index: int) -> int:
        return worker * self.tensor + tensor_index

    def _pipelines(self) -> list[list[int]]:
        """Workers of each pipeline: one per replica index when replication is equal, else all."""
        copies = self.plan.equal_replication
        if copies is None:
            return [list(range(self.plan.workers))]
        return [[self.worker(s, r) for s in range(self.plan.num_stages)] for r in range(copies)]

    def tensor_groups(self) -> list[list[int]]:
        return [[self.rank(w, t) for t in range(self.tensor)] for w in range(self.plan.workers)]

    def data_groups(self) -> list[list[int]]:
        return [[self.rank(self.worker(s, r), t) for r in range(count)]
                for s, count in enumerate(self.plan.replicas) for t in range(self.tensor)]

    def pipeline_groups(self) -> list[list[int]]:
        return [[self.rank(w, t) for w in workers] for workers in self._pipelines() for t in range(self.tensor)]

    def model_parallel_groups(self) -> list[list[int]]:
        return [[self.rank(w, t) for w in workers for t in range(self.tensor)] for workers in self._pipelines()]

    def embedding_groups(self, last: int = -1) -> list[list[int]]:
        return [sorted({group[0], group[last]}) for group in self.pipeline_groups()]

    # a stage plan holds no context parallelism: each rank holds whole sequences, its data group is
    # its data-x-context group
    context = 1
    hierarchical = None

    def context_groups(self) -> list[list[int]]:
        return [[rank] for rank in range(self.world_size)]

    def data_context_groups(self) -> list[list[int]]:
        return self.data_groups()

    def context_a2a_groups(self) -> list[list[int]]:
        return []

    def context_ring_groups(self) -> list[list[int]]:
        return []

    def folds(self) -> list[tuple[int, ExpertFold]]:
        """Each stage's first rank and how its ranks form the experts' groups (checks the degrees)."""
        etp = self.expert_tensor or self.tensor
        return [(self.rank(self.worker(s, 0), 0), ExpertFold.checked(self.expert, etp, self.tensor, count))
                for s, count in enumerate(self.plan.replicas)]

    def expert_groups(self) -> list[list[int]]:
        return [g for first, fold in self.folds() for g in fold.expert_groups(first)]

    def expert_tensor_groups(self) -> list[list[int]]:
        return [g for first, fold in self.folds() for g in fold.expert_tensor_groups(first)]

    def expert_data_groups(self) -> list[list[int]]:
        return [g for first, fold in self.folds() for g in fold.expert_data_groups(first)]
