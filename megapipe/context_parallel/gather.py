"""Gathering a sequence split over context ranks, in global position order, and its gradient's way back.

Each rank holds its tokens in local order (``layout/context.py``); after an all-gather over the
group the tokens sit in rank order, and one index puts them in position order, so that attention
over them needs the fewest kernel calls. The backward puts the gradient back in rank order and
reduce-scatters it (summing every rank's contribution to each token) in fp32.
"""

from __future__ import annotations

import torch

from megapipe.parallel.collectives import all_gather_into, reduce_scatter_into


def gathered(x: torch.Tensor, group, size: int, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order (no gradient)."""
    buffer = x.new_empty((size * x.size(0),) + tuple(x.shape[1:]))
    all_gather_into(buffer, x.contiguous(), group)
    return torch.cat(buffer.chunk(size), dim=dim)


class GatherSequence(torch.autograd.Function):
    """[..., n, d] per rank -> [..., size * n, d] in position order (``order``: rank-order index of
    each position), along dimension -2."""

    @staticmethod
    def forward(ctx, x, group, size: int, order: torch.Tensor):
        ctx.group, ctx.size, ctx.order = group, size, order
        return gathered(x, group, size, x.dim() - 2).index_select(-2, order)

    @staticmethod
    def backward(ctx, grad):
        in_rank_order = torch.empty_like(grad, dtype=torch.float32).index_copy_(-2, ctx.order, grad.float())
        pieces = torch.cat(in_rank_order.chunk(ctx.size, dim=-2))
        mine = pieces.new_empty((grad.size(0),) + pieces.shape[1:])
        reduce_scatter_into(mine, pieces, ctx.group)
        return mine.to(grad.dtype), None, None, None
