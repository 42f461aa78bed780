"""Process groups for tensor (t), context (c), pipeline (p), data (d) and expert (e) parallelism, built once.

The groups come from a layout's arithmetic (``megapipe.layout``: ``RankLayout`` for degrees,
``PlanLayout`` for a stage plan with replicated stages); ``ParallelState`` holds the groups and
answers every rank/stage query the rest of the code needs. Library code receives a ``ParallelState``; there are no module globals.
The experts' groups (expert, expert-tensor, expert-data) re-fold each stage's ranks
(``megapipe.layout.experts``); a group of one rank among them, or among the context groups, is
``None``, created by no one. Dense gradients are averaged, and optimizer state sharded, over the
data-x-context group (``dp_cp_group``): the context ranks of a replica hold the same parameters and
each computes a share of the same gradient; batches are sliced over the data group alone, since
the context ranks of a replica read the same samples.

Sizes and indices come from the member lists of the groups, so a state built from another
layout (a stage plan with replicated stages) or a view of
one stage (``stage_view``) answers the same queries.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Optional

import contextlib

import torch
import torch.distributed as dist

from megapipe.errors import ConfigError
from megapipe.layout.ranks import RankLayout
from megapipe.layout.run_layout import Layout, run_layout
from megapipe.layout.stage_plan import StagePlan
from megapipe.layout.placement import Placement, stages_of_rank
from megapipe.layout.placement import stage_of_worker
from megapipe.parallel.context import ContextGroups
from megapipe.parallel.progress import name_group
from megapipe.parallel.random import RNGTracker, seed_parallel_rng

# Process groups already created in this process, by (world group, role, ranks, timeout). Every
# gloo or NCCL group holds threads and buffers until the process ends; a process that builds many
# states (tests, the resharding tool) reuses the groups of a layout it built before instead of
# piling up new ones. All ranks build the same layouts in the same order, so they all find or all
# create. The role is part of the key: the pipeline's messages keep a communicator of their own
# even where another group has the same ranks, so no collective queues behind them.
_GROUPS: dict = {}


def _group(role: str, ranks: list[int], timeout: Optional[datetime.timedelta]):
    key = (dist.group.WORLD, role, tuple(ranks), timeout)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks, timeout=timeout)
        name_group(_GROUPS[key], f"the {role.replace('_', '-')} group (ranks {', '.join(map(str, ranks))})",
                   _KINDS.get(role, "other"))
    return _GROUPS[key]


# a group with the ranks of a dense group is that group: an expert group when e = 1 or etp = t, the
# data-x-context group when c = 1 (the experts' data group is one of the two)
_SHARED_ROLES = {"expert_tensor": "tensor", "expert_data": "data", "data_context": "data"}
# what the communication of each role's group is, in the exposed-communication counts (``exposure.py``)
_KINDS = {"tensor": "tensor", "context": "context", "context_a2a": "context", "context_ring": "context",
          "data": "data", "expert": "expert", "pipeline": "pipeline"}
# groups of one rank among these are None: nothing to communicate, no communicator made
_OPTIONAL = ("expert", "expert_tensor", "expert_data", "context", "context_a2a", "context_ring")


def forget_groups() -> None:
    """Drop this module's references to the groups it built (after they were destroyed), so that
    their backends, and gloo's worker threads, are freed now rather than at interpreter exit."""
    _GROUPS.clear()


@dataclass
class ParallelState:
    """The process groups and rank queries of one process.

    Build with :meth:`initialize` after ``torch.distributed`` is up, or :meth:`single` for a
    plain one-process run (all groups ``None``, every size 1), which needs no process group.
    """

    layout: Layout
    rank: int
    virtual_pipeline: int = 1
    groups: dict = field(default_factory=dict)
    members: dict = field(default_factory=dict)
    rng_tracker: Optional["RNGTracker"] = None  # set by seed(); per-tensor-rank dropout stream
    # Workers per stage when the pipeline group holds replicated stages (1F1B-RR); None: one per stage.
    stage_replicas: Optional[tuple[int, ...]] = None
    placement: Placement = Placement.LOOPED  # where the virtual stages live (layout/placement.py)
    cp_comm_type: str = "p2p"  # how context-parallel attention exchanges keys and values (layout/context_comm.py)

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def single(virtual_pipeline: int = 1) -> "ParallelState":
        layout = RankLayout(1, 1, 1)
        members = {name: [0] for name in ("tensor", "pipeline", "data", "model_parallel", "embedding", "expert",
                                          "expert_tensor", "expert_data")}
        return ParallelState(layout, 0, virtual_pipeline, {name: None for name in members}, members)

    @staticmethod
    def initialize(tensor: int = 1, pipeline: int = 1, data: Optional[int] = None,
                   virtual_pipeline: int = 1, timeout: Optional[datetime.timedelta] = None,
                   placement: Placement = Placement.LOOPED, expert: int = 1,
                   expert_tensor: Optional[int] = None, context: int = 1, cp_comm_type: str = "p2p",
                   hierarchical_context: Optional[tuple[int, ...]] = None,
                   plan: Optional[StagePlan] = None) -> "ParallelState":
        """Create every group of these degrees (with ``plan``, of its stages and replicas) over the whole world;
        all ranks must call this in the same order (collective). A training run resolves its layout once
        (``RunPlan.layout``) and calls ``build``; this is the shorthand for tests and tools."""
        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialized; call megapipe.parallel.launch.init_distributed() "
                              "first or launch with torchrun.")
        layout = run_layout(dist.get_world_size(), tensor, pipeline, data, expert, expert_tensor, context,
                            cp_comm_type, hierarchical_context, plan)
        if virtual_pipeline < 1:
            raise ConfigError(f"virtual pipeline size {virtual_pipeline} must be at least 1.")
        if virtual_pipeline > 1 and pipeline == 1:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1.")
        return ParallelState.build(layout, virtual_pipeline, timeout=timeout, placement=placement,
                                   cp_comm_type=cp_comm_type)

    @staticmethod
    def build(layout: Layout, virtual_pipeline: int = 1, timeout: Optional[datetime.timedelta] = None,
              placement: Placement = Placement.LOOPED, cp_comm_type: str = "p2p") -> "ParallelState":
        """This process's state under ``layout`` (``megapipe.layout.run_layout``): creates every group the
        layout lists, in the same order on all ranks (collective)."""
        if layout.world_size != dist.get_world_size():
            raise ConfigError(f"the run was planned for {layout.world_size} processes but {dist.get_world_size()} "
                              "started; launch as many as the parallel sizes multiply to.")
        rank = dist.get_rank()
        state = ParallelState(layout, rank, virtual_pipeline, stage_replicas=layout.stage_replicas,
                              placement=Placement(placement), cp_comm_type=cp_comm_type)
        state.groups["embedding"], state.members["embedding"] = None, []  # middle stages hold no embedding
        all_groups = {
            "tensor": layout.tensor_groups(),
            "context": layout.context_groups(),
            "data": layout.data_groups(),
            "data_context": layout.data_context_groups(),
            "context_a2a": layout.context_a2a_groups(),
            "context_ring": layout.context_ring_groups(),
            "pipeline": layout.pipeline_groups(),
            "model_parallel": layout.model_parallel_groups(),
            "embedding": layout.embedding_groups(state.last_stage_pp_rank),
            "expert": layout.expert_groups(),
            "expert_tensor": layout.expert_tensor_groups(),
            "expert_data": layout.expert_data_groups(),
        }
        for name, groups in all_groups.items():
            for ranks in groups:
                if name in _OPTIONAL and len(ranks) == 1:
                    group = None
                else:
                    group = _group(_SHARED_ROLES.get(name, name), ranks, timeout)
                if rank in ranks:
                    state.groups[name] = group
                    state.members[name] = list(ranks)
        return state

    def communicators(self) -> int:
        """The process groups this rank belongs to, the world's included: each holds a communicator (on NCCL,
        device memory too). Roles with the same ranks share one (``_SHARED_ROLES``); a role of one rank
        that needs no communication has none (``_OPTIONAL``)."""
        return 1 + len({id(group) for group in self.groups.values() if group is not None})

    def stage_view(self) -> "ParallelState":
        """This rank's stage seen as a whole model: the same tensor and data groups, no pipeline.

        An optimizer built on it reduces gradient norms and overflow flags over the stage's
        tensor group only, so a stage can update on its own (asynchronous schedules) without
        meeting the other stages in a collective, which would be a flush.
        """
        groups = dict(self.groups, pipeline=None, model_parallel=self.tp_group, embedding=None)
        members = dict(self.members, pipeline=[self.rank], model_parallel=list(self.members["tensor"]), embedding=[])
        return ParallelState(self.layout, self.rank, 1, groups, members, self.rng_tracker,
                             cp_comm_type=self.cp_comm_type)

    def pipeline_side_group(self, role: str, timeout: Optional[datetime.timedelta] = None):
        """A group of this rank's pipeline ranks with a communicator of its own, named by ``role``,
        for small messages that must neither queue behind the pipeline's nor hold them up
        (collective: every rank creates every pipeline group's twin, in the same order)."""
        mine = None
        for ranks in self.layout.pipeline_groups():
            group = _group(role, ranks, timeout)
            if self.rank in ranks:
                mine = group
        return mine

    # ---- sizes and indices: one axis table (``AXES``) gives every ``<axis>_size``, ``_rank`` and ``_group`` ------
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def axis_members(self, axis: "Axis") -> list[int]:
        """The ranks of this rank's group along ``axis``; a state built by hand (offline, tests) without that
        group reads its fallback axis's, or holds the axis alone."""
        if axis.group in self.members:
            return self.members[axis.group]
        return self.members[axis.fallback] if axis.fallback else [self.rank]

    def axis_group(self, axis: "Axis"):
        """The process group of ``axis`` (None: a group of one rank, or none built)."""
        return self.groups.get(axis.group, self.groups.get(axis.fallback) if axis.fallback else None)

    @property
    def batch_slice(self) -> tuple[int, int]:
        """(index, count): which of the equal slices of every global batch this rank trains on.

        Its data-parallel rank among its stage's replicas; under 1F1B-RR (unequal replication)
        every rank sees the whole batch, since the schedule itself routes the microbatches.
        """
        return (0, 1) if self.stage_replicas is not None else (self.dp_rank, self.dp_size)

    @property
    def context_groups(self) -> ContextGroups:
        """What context-parallel attention receives: this rank's context group, and under a2a+p2p its
        all-to-all and ring sub-groups."""
        return ContextGroups(self.cp_group, tuple(self.members.get("context", [self.rank])), self.cp_rank,
                             self.cp_comm_type, self.groups.get("context_a2a"),
                             tuple(self.members.get("context_a2a", ())), self.groups.get("context_ring"),
                             tuple(self.members.get("context_ring", ())))

    @property
    def mp_group(self):
        return self.groups["model_parallel"]

    @property
    def embedding_group(self):
        return self.groups["embedding"]

    # ---- pipeline queries -------------------------------------------------------------------
    @property
    def pipeline_stage(self) -> int:
        """The stage this rank runs (its pipeline rank unless stages are replicated)."""
        if self.stage_replicas is None:
            return self.pp_rank
        return stage_of_worker(self.stage_replicas, self.pp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_stage == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last stage (the loss): the last rank, or rank 0 under the V placement."""
        if self.stage_replicas is not None:
            return self.pipeline_stage == self.num_stages - 1
        return self.pp_rank == self.last_stage_pp_rank % self.pp_size

    @property
    def last_stage_pp_rank(self) -> int:
        """The pipeline index of the rank holding the last stage: the last rank (-1), or the first under V."""
        return 0 if self.placement is Placement.V else -1

    def chunk_stages(self) -> list[int]:
        """The stages this rank's model chunks hold, in chunk order: its virtual stages, or its one stage of a
        plan whose stages are replicated unequally."""
        if self.stage_replicas is not None:
            return [self.pipeline_stage]
        return stages_of_rank(self.placement, self.pp_size, self.virtual_pipeline, self.pp_rank)

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the process at pipeline index ``pp_rank`` in this process's pipeline."""
        return self.members["pipeline"][pp_rank]

    @property
    def next_rank(self) -> int:
        """Global rank of the next stage (wraps around, as interleaved schedules need)."""
        return self.stage_rank((self.pp_rank + 1) % self.pp_size)

    @property
    def prev_rank(self) -> int:
        return self.stage_rank((self.pp_rank - 1) % self.pp_size)

    @property
    def in_embedding_group(self) -> bool:
        return self.rank in self.members["embedding"]

    # ---- randomness ------------------------------------------------------------------------
    def seed(self, seed: int, device: torch.device) -> None:
        """Seed dropout streams: shared across tensor ranks by default, per tensor rank in forks."""
        self.rng_tracker = seed_parallel_rng(seed, self.tp_rank, self.pp_rank, device)

    def tensor_parallel_rng(self):
        """Context for dropout whose mask must differ across tensor ranks. With one tensor rank there is no
        other mask to differ from, so code torch.compile traces (whose graphs cannot swap generator states)
        draws from the default generator instead."""
        if self.rng_tracker is None or (self.tp_size == 1 and torch.compiler.is_compiling()):
            return contextlib.nullcontext()
        return self.rng_tracker.fork()

    @property
    def num_stages(self) -> int:
        """Pipeline stages: the pipeline ranks, unless stages are replicated within the pipeline group."""
        return self.pp_size if self.stage_replicas is None else len(self.stage_replicas)

    @property
    def virtual_stages(self) -> int:
        """Model chunks over the whole pipeline: its stages times the chunks each rank holds."""
        return self.num_stages * self.virtual_pipeline

    @property
    def loss_rank(self) -> int:
        """The one global rank that holds, prints and records the losses (its layout's arithmetic)."""
        return self.layout.loss_rank(self.last_stage_pp_rank)

    @property
    def degrees(self):
        """The run's parallel degrees (``megapipe.layout.degrees``), as its layout gives them."""
        return self.layout.degrees(self.virtual_pipeline)

    def describe(self) -> str:
        """This rank's place, each index of its count: ``rank 2: tensor 0/1, stage 1/2, data 0/1``."""
        text = (f"rank {self.rank}: tensor {self.tp_rank}/{self.tp_size}, "
                f"stage {self.pipeline_stage}/{self.num_stages}, data {self.dp_rank}/{self.dp_size}")
        if self.cp_size > 1:
            text += f", context {self.cp_rank}/{self.cp_size}"
        return text if self.ep_size == 1 else f"{text}, expert {self.ep_rank}/{self.ep_size}"


@dataclass(frozen=True)
class Axis:
    """One parallel dimension: its group's name in ``ParallelState.groups`` and ``members``, and the axis whose
    group stands in where a state has none of its own (an expert group of a state without experts is the
    dense one; None: the rank alone)."""

    group: str
    fallback: Optional[str] = None


# prefix of ParallelState's <prefix>_size, <prefix>_rank and <prefix>_group -> the axis it reads
AXES = {
    "tp": Axis("tensor"),
    "pp": Axis("pipeline"),
    "dp": Axis("data"),
    "cp": Axis("context"),
    "dp_cp": Axis("data_context", "data"),  # dense gradients are averaged, optimizer state sharded, over d x c
    "ep": Axis("expert"),
    "etp": Axis("expert_tensor", "tensor"),  # each expert's ffn split over --expert-tensor-parallel-size ranks
    "expert_dp": Axis("expert_data", "data"),
}


def _add_axis_queries() -> None:
    for prefix, axis in AXES.items():
        setattr(ParallelState, f"{prefix}_size", property(lambda self, a=axis: len(self.axis_members(a)),
                                                          doc=f"Ranks in this rank's {axis.group} group."))
        setattr(ParallelState, f"{prefix}_rank", property(lambda self, a=axis: self.axis_members(a).index(self.rank),
                                                          doc=f"This rank's index in its {axis.group} group."))
        setattr(ParallelState, f"{prefix}_group", property(lambda self, a=axis: self.axis_group(a),
                                                           doc=f"This rank's {axis.group} process group."))


_add_axis_queries()
