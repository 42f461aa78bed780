"""Choosing a parallel layout: profiles, PipeDream's partitioner, and the 2BW/PTD-P planner.

``profile`` (the JSON format), ``profiler`` (measure one), ``analytic`` (closed-form GPTs),
``cluster`` and ``presets`` (machines), ``partition`` (PipeDream's hierarchical dynamic program)
and ``pipedream`` (fed from a profile), ``schedule_costs`` and ``cost_model`` (THROUGHPUT and
MEMORY), ``plan`` (Algorithm 1), ``launch`` (plan files and torchrun commands), ``plot``.
"""

from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import PlanCostModel, Estimate, Candidate, Training
from megapipe.planner.partition import Level, Partition, PartitionProblem, StageMemory, partition
from megapipe.planner.plan import PlanRequest, PlanResult, plan
from megapipe.planner.profile import ModelProfile, ModelShape

__all__ = ["Cluster", "PlanCostModel", "Estimate", "Candidate", "Level", "ModelProfile", "ModelShape", "Partition",
           "PartitionProblem", "PlanRequest", "PlanResult", "StageMemory", "Training", "partition", "plan"]
