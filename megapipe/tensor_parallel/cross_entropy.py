"""Cross-entropy over logits split along the vocabulary, without gathering them.

Each tensor rank holds logits for its slice of the (padded) vocabulary. Three all-reduces
over the tensor group give the global max, the target's logit and the partition function;
the backward is softmax minus one-hot on the local slice (seed 002 4.2.3, Megatron's
``vocab_parallel_cross_entropy``). The elementwise steps between the collectives come from
``megapipe.fusions.cross_entropy``, so the fusion backend can compile each into one kernel.

Fused (``cross_entropy_loss_fusion``, on unless ``--no-cross-entropy-loss-fusion``), forward reads
the logits once for each row's max, sum of exponentials and target logit
(``megapipe.fusions.fused_cross_entropy``: Triton on CUDA, chunks of rows elsewhere), two all-reduces
(MAX, then one SUM of the rescaled sums and the target logits) finish the loss, and only the logits
and four fp32 numbers per row are kept; backward reads the logits once more and writes the gradient
in their dtype. No fp32 [tokens, V/t] tensor exists.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapipe.fusions import cross_entropy as parts
from megapipe.fusions import fused_cross_entropy as fused_parts
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


def _memory_order(logits: torch.Tensor) -> list[int]:
    """The leading dimensions of ``logits`` from the largest stride down: taken in that order, the rows of
    a transposed tensor (``[s, b, V]`` viewed as ``[b, s, V]``) flatten without a copy."""
    return sorted(range(logits.dim() - 1), key=lambda dim: -logits.stride(dim))


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, overwrite_logits):
        order = _memory_order(logits)
        ordered = logits.permute(*order, -1)
        rows = ordered.reshape(-1, logits.shape[-1])
        if rows.stride(-1) != 1:  # the kernels walk each row with unit stride
            rows, overwrite_logits = rows.contiguous(), True  # a copy of our own
        flat_target = target.permute(*order).reshape(-1).contiguous()
        stats = fused_parts.row_stats(rows, flat_target, vocab_start)
        logits_max = stats[0].clone()
        all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        stats[1].mul_(torch.exp(stats[0] - logits_max))  # this slice's sum relative to the global max
        all_reduce(stats[1:], group)  # sums of exponentials and target logits in one collective
        sum_exp, predicted = stats[1], stats[2]
        ctx.save_for_backward(rows, flat_target, logits_max, sum_exp)
        ctx.vocab_start, ctx.overwrite, ctx.shape = vocab_start, overwrite_logits, ordered.shape
        ctx.order, ctx.inverse = order, [order.index(dim) for dim in range(len(order))]
        return (sum_exp.log() - (predicted - logits_max)).view(ordered.shape[:-1]).permute(*ctx.inverse)

    @staticmethod
    def backward(ctx, grad_loss):
        rows, target, logits_max, sum_exp = ctx.saved_tensors
        out = rows if ctx.overwrite else torch.empty_like(rows)
        fused_parts.softmax_gradient(rows, target, ctx.vocab_start, logits_max, sum_exp,
                                     grad_loss.permute(*ctx.order).reshape(-1).float().contiguous(), out)
        if ctx.overwrite:  # a later backward that saved these logits fails loudly instead of reading gradients
            torch.autograd.graph.increment_version(rows)
        return out.view(ctx.shape).permute(*ctx.inverse, -1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int,
                                 fused: bool = True, overwrite_logits: bool = False) -> torch.Tensor:
    """Per-token loss (fp32) for logits ``[..., V/t]`` holding vocabulary ids ``[vocab_start, vocab_start+V/t)``.

    ``fused`` is ``ModelConfig.cross_entropy_loss_fusion`` (module docstring). ``overwrite_logits`` lets
    the fused backward write the gradient over the logits instead of into a new tensor: for callers
    that never read the logits after the loss, such as the models' heads (the logits' memory is reused).
    """
    if fused:
        return _FusedVocabParallelCrossEntropy.apply(logits, target, group, vocab_start, overwrite_logits)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
