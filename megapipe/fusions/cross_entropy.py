"""The elementwise parts of vocab-parallel cross-entropy, as separately fusable functions.

Vocab-parallel cross-entropy (Megatron) splits the logits [..., V] into vocabulary shards
[..., V/t] over the tensor-parallel ranks. Per rank, between the collectives that the caller
(``megapipe.tensor_parallel.cross_entropy``) runs over the tensor group:

    logits_max = logits.max(-1)                              -> all-reduce MAX
    shifted    = max_shifted_logits(logits, logits_max)
    index, in_shard = shard_target(target, vocab_start, vocab_end)
    predicted  = target_logit(shifted, index, in_shard)      -> all-reduce SUM
    exp_logits, sum_exp = exp_and_sum_(shifted)              -> all-reduce SUM on sum_exp
    loss       = loss_from_sums(sum_exp, predicted)
    softmax    = normalize_exp_(exp_logits, sum_exp)         (saved for backward)
  backward:
    grad_logits = softmax_minus_onehot_(softmax, index, in_shard, grad_loss)

All results are fp32 (the logits may be bf16). Functions ending in ``_`` write over their
first argument, as Megatron does: the shifted logits become their exponentials, then the
softmax, then the gradient, so one [tokens, V/t] fp32 buffer serves forward and backward
(at GPT-2's vocabulary that buffer is the largest activation of the model). No collective
happens in here, so each function can be compiled into one kernel: under the torch.compile
backend they are.
"""

from __future__ import annotations

import functools

import torch

from megapipe.fusions.backend import active_backend
from megapipe.fusions.compiled import compiled


def _fusable(fn):
    """Run ``fn`` compiled when the backend compiles cross-entropy for its first tensor's device."""
    @functools.wraps(fn)
    def run(*args):
        family = active_backend().family("cross_entropy", args[0])
        return (compiled(fn) if family == "compile" else fn)(*args)

    return run


@_fusable
def max_shifted_logits(logits: torch.Tensor, logits_max: torch.Tensor) -> torch.Tensor:
    """``logits - max`` with the max taken over the whole vocabulary (all shards), in fp32."""
    return logits.float() - logits_max.float().unsqueeze(-1)


@_fusable
def shard_target(target: torch.Tensor, vocab_start: int, vocab_end: int):
    """(index of the target inside this shard, or 0; whether the target lies in [vocab_start, vocab_end))."""
    in_shard = (target >= vocab_start) & (target < vocab_end)
    return torch.where(in_shard, target - vocab_start, 0), in_shard


@_fusable
def target_logit(shifted: torch.Tensor, index: torch.Tensor, in_shard: torch.Tensor) -> torch.Tensor:
    """The shifted logit of the target on the shard that holds it, 0 on the others (sum them)."""
    picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return torch.where(in_shard, picked, 0.0)


@_fusable
def exp_and_sum_(shifted: torch.Tensor):
    """(exp of the shifted logits, written over them; their sum over this shard's vocabulary)."""
    exp_logits = shifted.exp_()
    return exp_logits, exp_logits.sum(-1)


@_fusable
def loss_from_sums(sum_exp: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``log(sum_j exp(z_j - max)) - (z_target - max)`` from the all-reduced sums."""
    return sum_exp.log() - predicted


@_fusable
def normalize_exp_(exp_logits: torch.Tensor, sum_exp: torch.Tensor) -> torch.Tensor:
    """This shard's slice of the softmax over the full vocabulary, written over ``exp_logits``."""
    return exp_logits.div_(sum_exp.unsqueeze(-1))


@_fusable
def softmax_minus_onehot_(softmax: torch.Tensor, index: torch.Tensor, in_shard: torch.Tensor,
                          grad_loss: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(logits) on this shard, ``(softmax - onehot(target)) * grad_loss``, written over ``softmax``."""
    softmax.scatter_add_(-1, index.unsqueeze(-1), -in_shard.unsqueeze(-1).to(softmax.dtype))
    return softmax.mul_(grad_loss.float().unsqueeze(-1))
