"""Ring attention (``--cp-comm-type p2p``): keys and values travel around the ring of context ranks
while each rank attends its queries to the block it holds.

Forward, step t of c: the block held (member ``index - t``'s keys, values and key labels) is posted to
the next rank and the previous rank's is posted to arrive, then this block's attention runs and is
merged by its log-sum-exp into fp32 accumulators, then the transfer is waited: the transfer overlaps
the compute. Backward: the ring again, each block's gradients computed from the whole attention's
output and log-sum-exp; the dk, dv accumulators travel with their blocks one step behind (the
previous step's, updated, go out while this step computes) and a last transfer brings each home.
Positions are not sent: which member's tokens a rank holds at step t is known on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megapipe.context_parallel.blocks import Block, accumulators, block_backward, block_forward
from megapipe.context_parallel.plan import Ranges
from megapipe.context_parallel.transfer import Ring


def _block(ring: Ring, tokens: Callable[[int], Ranges], causal: bool, q_labels, held_labels, step: int,
           documents) -> Block:
    return Block(tokens(ring.index), tokens(ring.member(step)), causal, q_labels, held_labels, documents)


class RingAttention(torch.autograd.Function):
    """``tokens(member)``: the positions ring member ``member`` holds, in its storage order; ``documents``: the
    whole sequence's document ids on the host (``Block``), instead of labels."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, tokens, causal: bool, scale: float, q_labels: torch.Tensor | None,
                k_labels: torch.Tensor | None, documents: torch.Tensor | None = None):
        out, lse = accumulators(q)
        held = [k, v] + ([] if k_labels is None else [k_labels])
        for step in range(ring.size):
            transfer = ring.post(held, "forward", step) if step < ring.size - 1 else None
            block = _block(ring, tokens, causal, q_labels, held[2] if len(held) > 2 else None, step, documents)
            with ring.computing("forward", step):
                block_forward(q, held[0], held[1], block, scale, out, lse)
            if transfer is not None:
                held = transfer.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.tokens, ctx.causal, ctx.scale, ctx.labels = ring, tokens, causal, scale, (q_labels, k_labels)
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, (q_labels, k_labels) = ctx.ring, ctx.labels
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        held = [k, v] + ([] if k_labels is None else [k_labels])
        grads = None  # the (dk, dv) accumulators of the block held at the previous step
        for step in range(ring.size):
            sending = (held if step < ring.size - 1 else []) + (list(grads) if grads is not None else [])
            transfer = ring.post(sending, "backward", step) if sending else None
            block = _block(ring, ctx.tokens, ctx.causal, q_labels, held[2] if len(held) > 2 else None, step,
                           ctx.documents)
            dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
            with ring.computing("backward", step):
                block_backward(dout, q, held[0], held[1], out, lse, block, ctx.scale, dq, dk, dv)
            received = transfer.wait() if transfer is not None else []
            if step < ring.size - 1:
                held, received = received[:len(held)], received[len(held):]
            if received:  # this block's accumulators, as the previous rank left them
                dk, dv = dk + received[0], dv + received[1]
            grads = (dk, dv)
        if ring.size > 1:
            grads = ring.post(list(grads), "backward", ring.size).wait()
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None, None, None, None
