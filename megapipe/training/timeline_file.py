"""``--record-timeline PATH``: the run's pipeline actions, as ``tools/plot_schedule.py --timeline`` reads them.

Every rank's executor records when each of its compute actions ran (``Timeline``, on one clock
shared by all ranks); the pipeline that holds the logging rank gathers its parts there, which
merges and saves them: one row per pipeline rank, as the schedule's pictures have (the other
pipelines, replicas or tensor ranks of this one, ran the same schedule).
"""

from __future__ import annotations

import torch.distributed as dist

from megapipe.parallel.state import ParallelState
from megapipe.schedules.analysis.timeline import Timeline


def save_run_timeline(timeline: Timeline, ps: ParallelState, path: str) -> None:
    """Gather the parts of the logging rank's pipeline there and save them (collective over that pipeline)."""
    if ps.pp_group is None or not dist.is_initialized():
        timeline.save(path)
        return
    members = ps.members["pipeline"]
    if ps.loss_rank not in members:
        return
    parts = [None] * len(members) if ps.rank == ps.loss_rank else None
    dist.gather_object(timeline.to_dict(), parts, dst=ps.loss_rank, group=ps.pp_group)
    if parts is not None:
        Timeline.merge(Timeline.from_dict(part) for part in parts).save(path)
