"""The router's auxiliary losses and how their gradients join the main loss's.

``switch_aux_loss`` is Switch/GShard's load-balancing loss in Megatron-LM's normalisation,
E / (k T^2) * sum_e P_e c_e (P_e: the router probabilities of expert e summed over the T tokens,
c_e: the tokens routed to it), which is 1 when the routing is perfectly even; transformers'
``load_balancing_loss_func`` of one layer is k times this (it does not divide by k).
``seq_aux_loss`` is the same per sequence, averaged (DeepSeek-V2/V3). ``z_loss`` is ST-MoE's
mean squared log-sum-exp of the logits.

The losses never enter the value the last stage returns (an MoE layer may sit on any pipeline
stage). ``attach`` ties a loss to an activation of its layer: the forward returns the activation
unchanged and the backward adds d(loss) = the main loss's gradient scale to the loss's graph, so the
loss is differentiated exactly as if it had been added to every microbatch's loss. The scale is
what the main loss's backward starts from (loss scale / microbatches per step), which the engine
sets before each batch with ``set_aux_loss_scale``; a model outside the engine uses 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


def switch_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int,
                    context: Optional[ContextSplit] = None) -> torch.Tensor:
    """``scores`` [T, E] (softmax over all experts, or normalised sigmoid), ``routing_map`` [T, E] bool."""
    tokens, experts = scores.shape
    counts = routing_map.sum(dim=0).to(scores.dtype)
    size = 1 if context is None else context.sum_counts(counts)
    return (scores.sum(dim=0) * counts).sum() * (experts / (topk * tokens * tokens * size))


def seq_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int, seq_length: int,
                 context: Optional[ContextSplit] = None) -> torch.Tensor:
    """The balancing loss of each sequence, averaged; tokens are ordered [s, b] (``s`` outer)."""
    experts = scores.shape[1]
    per_sequence_probs = scores.view(seq_length, -1, experts).sum(dim=0)  # [b, E]
    per_sequence_counts = routing_map.view(seq_length, -1, experts).sum(dim=0).to(scores.dtype)
    size = 1 if context is None else context.sum_counts(per_sequence_counts)
    losses = (per_sequence_probs * per_sequence_counts).sum(dim=-1) * (experts /
                                                                        (topk * seq_length * seq_length * size))
    return losses.mean()


@dataclass(frozen=True)
class ContextSplit:
    """The c context ranks that each route s/c tokens of every sequence (context parallelism).

    The balancing losses weigh each expert's probabilities by the tokens routed to it over the whole
    sequence: ``sum_counts`` sums this rank's counts over the group in place. A rank's loss is then c times
    its tokens' share of the whole sequence's loss (the ``/ (T_local x T)`` of its normalisation), so
    the mean over the context ranks, which gradient averaging over d x c takes, is the whole loss, and
    so are its gradients: the single process's. The z loss is a mean over tokens, whose mean over
    ranks holding equally many is already the whole one.
    """

    group: Any
    ranks: int

    def sum_counts(self, counts: torch.Tensor) -> int:
        """Sum ``counts`` over the context ranks (in place); returns c."""
        if self.ranks > 1:
            dist.all_reduce(counts, group=self.group)
        return self.ranks


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1).square().mean()


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, loss, scale):
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad):
        scale = 1.0 if ctx.scale is None else ctx.scale
        return grad, torch.ones(ctx.loss_shape, device=grad.device) * scale, None


def attach(activation: torch.Tensor, loss: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``activation``, whose backward also differentiates ``loss`` with gradient ``scale`` (None: 1)."""
    return _Attach.apply(activation, loss, scale)


def set_aux_loss_scale(module: torch.nn.Module, scale: Optional[torch.Tensor]) -> None:
    """Give every MoE router in ``module`` the main loss's gradient scale (a 0-dim tensor, or None for 1)."""
    for sub in module.modules():
        if hasattr(sub, "aux_loss_scale"):
            sub.aux_loss_scale = scale


def main_loss_gradient_scale(scale_loss, loss_divisor: int, device) -> torch.Tensor:
    """What the main loss's backward starts from: ``scale_loss`` (the loss scale) of 1 over ``loss_divisor``
    (the microbatches one step sums)."""
    return scale_loss(torch.ones((), device=device)) / loss_divisor
