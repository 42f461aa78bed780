"""Attention of queries against keys and values this rank holds whole: c = 1, and the all-gather and
all-to-all comm types after their exchange. One block, through the fused kernels, as an autograd
function whose backward is the kernels' backward."""

from __future__ import annotations

import torch

from megapipe.context_parallel.blocks import Block, accumulators, block_backward, block_forward


class LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block: Block, scale: float):
        out, lse = accumulators(q)
        block_forward(q, k, v, block, scale, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block, ctx.scale = block, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        block_backward(dout.contiguous(), q, k, v, out, lse, ctx.block, ctx.scale, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
