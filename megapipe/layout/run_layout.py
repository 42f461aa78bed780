"""The one place a run's degrees become its layout: an equal split's ``RankLayout`` or a stage plan's
``PlanLayout``, both checked against the world size, with one interface (groups, sizes, the loss rank), so
what builds process groups never asks which it holds."""

from __future__ import annotations

from typing import Optional, Union

from megapipe.layout.context_comm import check_comm_type
from megapipe.layout.plan import PlanLayout
from megapipe.layout.ranks import RankLayout
from megapipe.layout.stage_plan import StagePlan

Layout = Union[RankLayout, PlanLayout]


def run_layout(world_size: int, tensor: int = 1, pipeline: int = 1, data: Optional[int] = None, expert: int = 1,
               expert_tensor: Optional[int] = None, context: int = 1, comm_type: str = "p2p",
               hierarchical: Optional[tuple[int, ...]] = None, plan: Optional[StagePlan] = None) -> Layout:
    """Where each of ``world_size`` ranks sits; with ``plan``, its stages and replicas give p and d."""
    check_comm_type(context, comm_type, hierarchical)
    hierarchical = None if hierarchical is None else tuple(hierarchical)
    if plan is None:
        return RankLayout.for_world(world_size, tensor, pipeline, data, expert, expert_tensor, context, hierarchical)
    plan.validate(plan.stages[-1].layer_end, world_size, tensor, context)  # its layers are the model's: checked there
    layout = PlanLayout(plan, tensor, expert, expert_tensor, context, hierarchical)
    layout.folds()  # checks the experts' degrees against each stage's ranks
    return layout
