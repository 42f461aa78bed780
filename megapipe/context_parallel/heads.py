"""All-to-all between a sequence split over ranks and a head split (Ulysses, DeepSpeed's name).

Before: every rank of a group of ``size`` holds all heads of its own tokens, [b, heads, n, d]. After:
every rank holds heads/size heads (rank r the r-th slice) of all the group's tokens, in rank order,
[b, heads/size, size*n, d]. The two directions are each other's backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapipe.parallel import progress


def _to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    b, heads, n, d = x.shape
    send = x.reshape(b, size, heads // size, n, d).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    with progress.collective("the heads' all_to_all", group):
        dist.all_to_all_single(received, send, group=group)  # received[r]: rank r's tokens, my heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, heads // size, size * n, d)


def _to_sequence(y: torch.Tensor, group, size: int) -> torch.Tensor:
    b, heads, sn, d = y.shape
    n = sn // size
    send = y.reshape(b, heads, size, n, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    with progress.collective("the heads' all_to_all", group):
        dist.all_to_all_single(received, send, group=group)  # received[r]: my tokens, rank r's heads
    return received.transpose(0, 1).reshape(b, size * heads, n, d)


class _Exchange(torch.autograd.Function):
    """One direction forward, the other backward (each is the other's adjoint)."""

    @staticmethod
    def forward(ctx, x, group, size: int, there, back):
        ctx.group, ctx.size, ctx.back = group, size, back
        return there(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), ctx.group, ctx.size), None, None, None, None


def sequence_to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    return _Exchange.apply(x, group, size, _to_heads, _to_sequence)


def heads_to_sequence(y: torch.Tensor, group, size: int) -> torch.Tensor:
    return _Exchange.apply(y, group, size, _to_sequence, _to_heads)
