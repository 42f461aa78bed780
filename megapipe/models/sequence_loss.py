"""The loss of a whole sequence when context parallelism splits it over c ranks (Megatron's rule).

Each context rank holds 2 of the 2c chunks of every sequence. The masked mean over the whole
sequence is ``sum(loss x mask) / count`` with both sums over all c ranks; each rank's share is
its local sum over the whole count. Gradients are averaged over the d x c ranks, so each rank
differentiates c times its share: the average over c of c x share_i is the gradient of the
whole mean, exactly the single-process gradient. The value returned (what is logged) is the
whole sequence's mean on every context rank; only its gradient is the rank's share. One
all-reduce of two numbers per microbatch, on the device (no host synchronisation).

A loss only the first context rank can compute (BERT's sentence-order head reads the [CLS]
token, position 0, which only context rank 0 holds) is ``first_rank_loss``: its value comes from
rank 0, and only rank 0 differentiates it, times c.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapipe.parallel.state import ParallelState


def _value_with_gradient_of(value: torch.Tensor, differentiated: torch.Tensor) -> torch.Tensor:
    """A tensor equal to ``value`` whose gradient is ``differentiated``'s."""
    return differentiated + (value - differentiated).detach()


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (both [b, s/c]) over the whole sequence of every context rank."""
    mask = mask.float()
    local_sum = (values.float() * mask).sum()
    if ps.cp_size == 1:
        return local_sum / mask.sum().clamp(min=1.0)
    totals = torch.stack((local_sum.detach(), mask.sum()))
    dist.all_reduce(totals, group=ps.cp_group)
    count = totals[1].clamp(min=1.0)
    return _value_with_gradient_of(totals[0] / count, ps.cp_size * local_sum / count)


def first_rank_loss(loss: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """``loss`` as context rank 0 computed it, on every context rank; only rank 0's is differentiated (times c)."""
    if ps.cp_size == 1:
        return loss
    first = ps.cp_rank == 0
    value = loss.detach() * first
    dist.all_reduce(value, group=ps.cp_group)
    return _value_with_gradient_of(value, loss * (ps.cp_size if first else 0.0))
