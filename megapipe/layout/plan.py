"""Ranks and process groups for a stage plan whose stages may be replicated.

Workers are numbered stage by stage: replica r of stage s is worker ``sum(R[:s]) + r``. Each
worker is t x c consecutive ranks (tensor-innermost, then context, as in ``RankLayout``): rank =
(worker * c + context index) * t + tensor index. An equally replicated plan (R copies of every
stage) therefore gets exactly the ranks and groups of ``RankLayout(t, p, R, context=c)``: R parallel
pipelines. Any other plan runs 1F1B-RR, which sends microbatch i to replica i % R of each stage, so
its pipeline group holds every worker (one per tensor and context index) and the schedule has one
action list per worker.

Groups: tensor (t ranks of a worker), context (c ranks of a worker: they split each sequence),
data (the replicas of a stage: their gradients are averaged before each update, with the context
ranks' under data_context), pipeline (as above), model_parallel (the tensor ranks of one pipeline;
with unequal replication, of all workers), embedding (first and last stage of each pipeline).
A stage's ranks are consecutive (its replicas' workers), so the experts' groups fold each stage's
t x c x R ranks as ``RankLayout`` folds its stages' (``experts.py``): a plan assigns layers to
stages, and the experts of a stage's MoE layers are split over that stage's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megapipe.layout.degrees import Degrees
from megapipe.layout.experts import ExpertFold
from megapipe.layout.placement import first_worker
from megapipe.layout.ranks import context_a2a_groups, context_ring_groups
from megapipe.layout.stage_plan import StagePlan


@dataclass(frozen=True)
class PlanLayout:
    plan: StagePlan
    tensor: int = 1
    expert: int = 1
    expert_tensor: Optional[int] = None  # None: t
    context: int = 1
    hierarchical: Optional[tuple[int, ...]] = None  # a2a+p2p: the all-to-all and ring sizes

    @property
    def world_size(self) -> int:
        return self.plan.workers * self.tensor * self.context

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
        return Degrees(self.tensor, self.plan.num_stages, self.plan.replicas, virtual, context=self.context,
                       expert=self.expert)

    def loss_rank(self, last: int = -1) -> int:
        """The rank that logs the losses: tensor and context index 0 of the first replica of the last stage (a
        stage plan is looped, so ``last``, which ``RankLayout.loss_rank`` takes for the V placement, changes
        nothing)."""
        return self.rank(self.worker(self.plan.num_stages - 1, 0), 0)

    def worker(self, stage: int, replica: int) -> int:
        return first_worker(self.plan.replicas, stage) + replica

    def rank(self, worker: int, tensor_index: int, context_index: int = 0) -> int:
        return (worker * self.context + context_index) * self.tensor + tensor_index

    def _positions(self) -> list[tuple[int, int]]:
        """(tensor, context) indices inside a worker, context outermost."""
        return [(t, c) for c in range(self.context) for t in range(self.tensor)]

    def _pipelines(self) -> list[list[int]]:
        """Workers of each pipeline: one per replica index when replication is equal, else all."""
        copies = self.plan.equal_replication
        if copies is None:
            return [list(range(self.plan.workers))]
        return [[self.worker(s, r) for s in range(self.plan.num_stages)] for r in range(copies)]

    def tensor_groups(self) -> list[list[int]]:
        return [[self.rank(w, t, c) for t in range(self.tensor)] for w in range(self.plan.workers)
                for c in range(self.context)]

    def context_groups(self) -> list[list[int]]:
        """The c ranks of a worker that split each sequence, in context-index order."""
        return [[self.rank(w, t, c) for c in range(self.context)] for w in range(self.plan.workers)
                for t in range(self.tensor)]

    def data_groups(self) -> list[list[int]]:
        return [[self.rank(self.worker(s, r), t, c) for r in range(count)]
                for s, count in enumerate(self.plan.replicas) for t, c in self._positions()]

    def data_context_groups(self) -> list[list[int]]:
        """The replicas x c ranks of a stage at one tensor index: dense gradients are averaged over them."""
        return [[self.rank(self.worker(s, r), t, c) for r in range(count) for c in range(self.context)]
                for s, count in enumerate(self.plan.replicas) for t in range(self.tensor)]

    def context_a2a_groups(self) -> list[list[int]]:
        return context_a2a_groups(self.context_groups(), self.hierarchical)

    def context_ring_groups(self) -> list[list[int]]:
        return context_ring_groups(self.context_groups(), self.hierarchical)

    def pipeline_groups(self) -> list[list[int]]:
        return [[self.rank(w, t, c) for w in workers] for workers in self._pipelines() for t, c in self._positions()]

    def model_parallel_groups(self) -> list[list[int]]:
        """The tensor ranks of one pipeline's workers, for one context index."""
        return [[self.rank(w, t, c) for w in workers for t in range(self.tensor)] for workers in self._pipelines()
                for c in range(self.context)]

    def embedding_groups(self, last: int = -1) -> list[list[int]]:
        return [sorted({group[0], group[last]}) for group in self.pipeline_groups()]

    def folds(self) -> list[tuple[int, ExpertFold]]:
        """Each stage's first rank and how its ranks form the experts' groups (checks the degrees)."""
        etp = self.expert_tensor or self.tensor
        return [(self.rank(self.worker(s, 0), 0), ExpertFold.checked(self.expert, etp, self.tensor, count,
                                                                     self.context))
                for s, count in enumerate(self.plan.replicas)]

    def expert_groups(self) -> list[list[int]]:
        return [g for first, fold in self.folds() for g in fold.expert_groups(first)]

    def expert_tensor_groups(self) -> list[list[int]]:
        return [g for first, fold in self.folds() for g in fold.expert_tensor_groups(first)]

    def expert_data_groups(self) -> list[list[int]]:
        return [g for first, fold in self.folds() for g in fold.expert_data_groups(first)]
