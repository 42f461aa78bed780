"""Cross-entropy over logits split along the vocabulary, without gathering them.

Each tensor rank holds logits for its slice of the (padded) vocabulary. Three all-reduces
over the tensor group give the global max, the target's logit and the partition function;
the backward is softmax minus one-hot on the local slice (seed 002 4.2.3, Megatron's
``vocab_parallel_cross_entropy``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapipe.tensor_parallel.mappings import group_size


def _all_reduce(x: torch.Tensor, op, group) -> None:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        ctx.dtype = logits.dtype
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)
        shifted = logits - logits_max.unsqueeze(-1)

        per_rank = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + per_rank)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
    """Per-token loss (fp32) for logits ``[..., V/t]`` holding vocabulary ids ``[vocab_start, vocab_start+V/t)``."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
