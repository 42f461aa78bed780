"""What a run says when it starts: one line naming everything that shapes it, and on every other
node a line saying where that line and the losses are printed.

Only the rank that holds the losses logs (``ParallelState.loss_rank``, on the last stage, so
usually on the last node); torchrun shows each node only its own workers' output, so without the
second line the first node's terminal stays empty for the whole run.
"""

from __future__ import annotations

from typing import Optional

from megapipe.layout.nodes import node_of
from megapipe.parallel.state import ParallelState


def startup_line(kind: str, ps: ParallelState, schedule: str, microbatches: int, micro_batch_size: int,
                 sharding: str, precision: str, fusion_backend: str, vocabulary: int, data: str) -> str:
    """``> GPT training on 4 ranks: t 1, c 1, e 1, p 2, v 1, d 2 | logged by rank 1: ... | schedule ...``:
    every parallel degree, the schedule, the data-parallel sharding level, the precision, the
    fused-kernel backend, the data, and how many communicators (process groups) the rank holds."""
    ranks = f"{ps.world_size} rank{'' if ps.world_size == 1 else 's'}"
    communicators = ps.communicators()
    return (f"> {kind.upper()} training on {ranks}: {ps.degrees.text()} | logged by {ps.describe()} | "
            f"schedule {schedule} with {microbatches} microbatches of {micro_batch_size} | data-parallel sharding "
            f"{sharding} | precision {precision} | fusion backend {fusion_backend} | vocabulary {vocabulary} | {data} | "
            f"{communicators} communicator{'' if communicators == 1 else 's'} per rank")


def where_losses_are_logged(ps: ParallelState, local_rank: int, ranks_per_node: Optional[int]) -> Optional[str]:
    """The line the first process of a node that does not hold the logging rank prints, else None."""
    if not ranks_per_node or local_rank != 0:
        return None
    here, there = node_of(ps.rank, ranks_per_node), node_of(ps.loss_rank, ranks_per_node)
    if here == there:
        return None
    return (f"> node {here} (ranks {here * ranks_per_node}-{(here + 1) * ranks_per_node - 1}) prints nothing more: "
            f"rank {ps.loss_rank}, which holds the loss, prints the start-up line and the losses on node {there} "
            f"(torchrun --node-rank {there}); that node's terminal or job log shows the run.")
