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

from typing import Optional

import torch


def switch_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """``scores`` [T, E] (softmax over all experts, or normalised sigmoid), ``routing_map`` [T, E] bool."""
    tokens, experts = scores.shape
    counts = routing_map.sum(dim=0).to(scores.dtype)
    return (scores.sum(dim=0) * counts).sum() * (experts / (topk * tokens * tokens))


def seq_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int, seq_length: int) -> torch.Tensor:
    """The balancing loss of each sequence, averaged; tokens are ordered [s, b] (``s`` outer)."""
    experts = scores.shape[1]
    per_sequence_probs = scores.view(seq_length, -1, experts).sum(dim=0)  # [b, E]
    per_sequence_counts = routing_map.view(seq_length, -1, experts).sum(dim=0).to(scores.dtype)
    losses = (per_sequence_probs * per_sequence_counts).sum(dim=-1) * (experts / (topk * seq_length * seq_length))
    return losses.mean()


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
