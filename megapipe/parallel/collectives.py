"""The collectives every module uses: the all-reduce (a no-op for a group of one) and the
single-tensor reduce-scatter and all-gather.

``ParallelState.single()`` stores ``None`` for every group, and ``None`` means "the whole
world" to ``torch.distributed``; skipping groups of one keeps single-process runs free of
collectives and keeps a one-member group from ever reaching the default group by mistake.

The single-tensor reduce-scatter and all-gather are named ``reduce_scatter_single`` and
``all_gather_single`` from torch 2.13 on; torch 2.11 (the GPU machines' stack) has the same
operations, with the same arguments, as ``reduce_scatter_tensor`` and ``all_gather_into_tensor``.
This module is the one place that knows.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megapipe.parallel import progress


def group_size(group) -> int:
    """Members of ``group``; ``None`` (what ``ParallelState.single()`` holds) counts as one."""
    return 1 if group is None else dist.get_world_size(group)


_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _tracked(name: str, run, group, async_op: bool):
    """``run(async_op)``, noted in this rank's progress (``progress.py``): a blocking collective while it
    runs, an asynchronous one as issued."""
    if async_op:
        progress.issued(group)
        return run(True)
    with progress.collective(name, group):
        return run(False)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """Sum ``input`` over ``group`` and keep this rank's slice (``output``: 1/size of it, along
    dimension 0); returns the work handle when ``async_op``."""
    return _tracked("reduce_scatter", lambda a: _reduce_scatter(output, input, group=group, async_op=a), group,
                    async_op)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's ``input`` along dimension 0 into ``output``, in rank order;
    returns the work handle when ``async_op``."""
    return _tracked("all_gather", lambda a: _all_gather(output, input, group=group, async_op=a), group, async_op)


def all_reduce(tensor: torch.Tensor, group, size: Optional[int] = None, op=dist.ReduceOp.SUM,
               async_op: bool = False):
    """Reduce ``tensor`` in place over ``group`` (of ``size`` members, asked when not given);
    returns the work handle when ``async_op``."""
    if (group_size(group) if size is None else size) == 1:
        return None
    return _tracked("all_reduce", lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), group, async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], group, group_size: int) -> None:
    """Sum a list of same-dtype tensors over ``group`` with one collective (flatten, reduce, copy back)."""
    if group_size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    with progress.collective("all_reduce", group):
        dist.all_reduce(flat, group=group)
    for tensor, reduced in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(reduced.view_as(tensor))
