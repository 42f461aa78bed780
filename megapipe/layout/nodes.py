"""How a layout sits on the nodes of a multi-node launch, checked before any process group exists.

torchrun gives every node the same number of processes (``LOCAL_WORLD_SIZE``) and numbers ranks
node by node, and megapipe orders ranks tensor-innermost (t, then c, then d, then p). So a tensor-parallel
group stays inside a node exactly when t divides the processes per node; otherwise its
all-reduces, two per layer and pass, cross the slow inter-node network, which is legal but
rarely wanted, and megapipe says so once. A node count whose world size the layout cannot
divide is refused naming the node count to use.
"""

from __future__ import annotations

from typing import Optional

from megapipe.errors import ConfigError


def check_nodes(world_size: int, ranks_per_node: Optional[int], tensor: int, pipeline: int,
                context: int = 1) -> Optional[str]:
    """Raise ConfigError when ``world_size`` (nodes x ``ranks_per_node``) cannot hold t x c x p; return a
    one-sentence warning when tensor-parallel groups would span nodes, else None."""
    if not ranks_per_node or world_size % ranks_per_node or world_size == ranks_per_node:
        return None  # one node, or not launched node by node
    nodes, model = world_size // ranks_per_node, tensor * context * pipeline
    if world_size % model:
        fits = next(n for n in range(nodes + 1, nodes + model + 1) if n * ranks_per_node % model == 0)
        raise ConfigError(f"{nodes} nodes x {ranks_per_node} processes = {world_size} ranks is not divisible by "
                          f"--tensor-model-parallel-size {tensor} x "
                          + (f"--context-parallel-size {context} x " if context > 1 else "")
                          + f"--pipeline-model-parallel-size {pipeline} "
                          f"(= {model}); launch {fits} nodes, or change the parallel sizes.")
    if ranks_per_node % tensor:
        return (f"warning: --tensor-model-parallel-size {tensor} does not divide the {ranks_per_node} processes per "
                f"node, so tensor-parallel groups span nodes and their all-reduces cross the inter-node network; "
                f"use a divisor of {ranks_per_node} and put the rest in pipeline or data parallelism.")
    return None


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node (torchrun's ``--node-rank``) a rank runs on: torchrun numbers ranks node by node."""
    return rank // ranks_per_node
