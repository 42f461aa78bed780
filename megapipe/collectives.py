"""The all-reduce every module uses: a no-op for a group of one.

``ParallelState.single()`` stores ``None`` for every group, and ``None`` means "the whole
world" to ``torch.distributed``; skipping groups of one keeps single-process runs free of
collectives and keeps a one-member group from ever reaching the default group by mistake.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Members of ``group``; ``None`` (what ``ParallelState.single()`` holds) counts as one."""
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(tensor: torch.Tensor, group, size: Optional[int] = None, op=dist.ReduceOp.SUM,
               async_op: bool = False):
    """Reduce ``tensor`` in place over ``group`` (of ``size`` members, asked when not given);
    returns the work handle when ``async_op``."""
    if (group_size(group) if size is None else size) == 1:
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], group, group_size: int) -> None:
    """Sum a list of same-dtype tensors over ``group`` with one collective (flatten, reduce, copy back)."""
    if group_size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for tensor, reduced in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(reduced.view_as(tensor))
