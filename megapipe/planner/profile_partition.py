"""PipeDream's partitioner fed from a profile and a cluster.

The partition units are the transformer blocks, with the embedding's costs added to the first
and the head's to the last, so that every stage is a layer range the model builder accepts.
The topology has a level of ``gpus_per_node`` devices on the intra-node links and, with
several nodes, a level of ``nodes`` on the inter-node links. Weights are synchronised as
gradients (``grad_bytes_per_param``); a device holds, per in-flight input, a weight version in
the profile's dtype and the layers' stash, and once the gradients and optimizer state. The
copy of a tied output embedding that a last stage keeps is not counted.
"""

from __future__ import annotations

import numpy as np

from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import Training
from megapipe.planner.partition import Level, Partition, PartitionProblem, StageMemory, partition
from megapipe.planner.profile import ModelProfile


def fold_ends(values: np.ndarray) -> np.ndarray:
    """Per-block values with the embedding's added to the first block and the head's to the last."""
    blocks = np.array(values[1:-1], dtype=float)
    blocks[0] += values[0]
    blocks[-1] += values[-1]
    return blocks


def topology(cluster: Cluster) -> list[Level]:
    """Devices within a node, then nodes; a device's inter-node bandwidth is its share of a shared node
    uplink when every device of the node sends at once (the partitioner's stages all run at once)."""
    levels = [Level(cluster.gpus_per_node, cluster.intra_node_bandwidth)]
    if cluster.nodes > 1:
        per_device = cluster.inter_node_bandwidth
        if cluster.node_uplink_bandwidth is not None:
            per_device = min(per_device, cluster.node_uplink_bandwidth / cluster.gpus_per_node)
        levels.append(Level(cluster.nodes, per_device))
    return levels


def partition_profile(profile: ModelProfile, cluster: Cluster, micro_batch_size: int, training: Training,
                      limit_memory: bool = True) -> Partition:
    costs = profile.costs(float(micro_batch_size))
    compute = fold_ends((costs.forward + costs.backward) / cluster.compute_speed)
    params = fold_ends(costs.params)
    memory = None
    if limit_memory:
        state = training.grad_bytes_per_param + training.optimizer_bytes(profile.element_bytes)
        memory = StageMemory(params * profile.element_bytes, params * state, fold_ends(costs.stash_bytes),
                             cluster.usable_memory)
    problem = PartitionProblem(compute, costs.output_bytes[1:-1], params * training.grad_bytes_per_param,
                               topology(cluster), memory)
    return partition(problem)
