"""Cross-entropy over logits split along the vocabulary, without gathering them.

Each tensor rank holds logits for its slice of the (padded) vocabulary. Three all-reduces
over the tensor group give the global max, the target's logit and the partition function;
the backward is softmax minus one-hot on the local slice (seed 002 4.2.3, Megatron's
``vocab_parallel_cross_entropy``). The elementwise steps between the collectives come from
``megapipe.fusions.cross_entropy``, so the fusion backend can compile each into one kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapipe.fusions import cross_entropy as parts
from megapipe.parallel.collectives import all_reduce


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        ctx.dtype = logits.dtype
        logits_max = logits.max(dim=-1).values.float()  # exact in any dtype; no fp32 copy of the logits
        all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        shifted = parts.max_shifted_logits(logits, logits_max)
        index, in_shard = parts.shard_target(target, vocab_start, vocab_start + logits.shape[-1])
        predicted = parts.target_logit(shifted, index, in_shard)
        all_reduce(predicted, group)
        exp_logits, sum_exp = parts.exp_and_sum_(shifted)
        all_reduce(sum_exp, group)
        ctx.save_for_backward(parts.normalize_exp_(exp_logits, sum_exp), index, in_shard)
        return parts.loss_from_sums(sum_exp, predicted)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, in_shard = ctx.saved_tensors
        # the saved softmax becomes the gradient: a second backward through this graph is not supported
        return parts.softmax_minus_onehot_(softmax, index, in_shard, grad_loss).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
    """Per-token loss (fp32) for logits ``[..., V/t]`` holding vocabulary ids ``[vocab_start, vocab_start+V/t)``."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
