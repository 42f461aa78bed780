"""The top-k router: scores every expert for every token in fp32 and picks k of them.

Score functions (Megatron-LM's): softmax after the top-k (the k chosen logits' softmax: Mixtral,
Qwen3-MoE), softmax before it (``pre_softmax``: the probabilities of all experts, not renormalised:
Qwen2-MoE, OLMoE), or sigmoid (renormalised over the k: DeepSeek-V3). Group-limited routing
(DeepSeek-V3) first keeps the ``group_topk`` groups whose best ``topk / group_topk`` scores sum
highest. An expert bias (auxiliary-loss-free balancing) shifts which experts are chosen but not the
weights their outputs get; it is a buffer, moved after each step (``expert_bias.py``).

The router adds its balancing and z losses to the gradient (``load_balancing.py``) and counts, on
the device, what the log line and the bias update read (``stats.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.moe import load_balancing
from megapipe.models.moe.capacity import apply_capacity
from megapipe.tensor_parallel.utils import init_normal_


@dataclass
class Routing:
    """One batch's routing: dense [T, E] weights (zero where a token does not go) and the boolean map."""

    probs: torch.Tensor
    routing_map: torch.Tensor


def _topk(scores: torch.Tensor, k: int, num_groups: Optional[int], group_topk: Optional[int]) -> torch.Tensor:
    """Indices [T, k] of the top-k scores, within the best ``group_topk`` groups when grouped."""
    if not group_topk:
        return torch.topk(scores, k, dim=-1).indices
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(k // group_topk, dim=-1).values.sum(dim=-1)
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_scores.topk(group_topk, -1).indices,
                                                                       True)
    allowed = chosen.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return torch.topk(scores.masked_fill(~allowed, float("-inf")), k, dim=-1).indices


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
                 num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                 expert_bias: Optional[torch.Tensor] = None) -> Routing:
    """The routing of fp32 ``logits`` [T, E] (see the module's docstring)."""
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
    elif pre_softmax:
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = logits
    selection = scores if expert_bias is None else scores + expert_bias
    indices = _topk(selection, topk, num_groups, group_topk)
    chosen = scores.gather(1, indices)
    if score_function == "sigmoid":
        weights = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else chosen
    elif pre_softmax:
        weights = chosen
    else:
        weights = torch.softmax(chosen, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, indices, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return Routing(probs, routing_map)


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The per-expert probabilities the balancing losses weigh: softmax over all experts, or normalised sigmoid."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


class TopKRouter(nn.Module):
    """``weight`` [E, h], replicated on every tensor rank; ``expert_bias`` [E] (fp32) with the expert bias."""

    def __init__(self, config: ModelConfig, name: str, seed: int, device=None):
        super().__init__()
        self.config = config
        e = config.num_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=config.params_dtype, device=device))
        init_normal_(self.weight, (e, config.hidden_size), config.init_method_std, seed, f"{name}.weight")
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32, device=device))
        else:
            self.expert_bias = None
        # counts of this step (the bias update) and of this log interval (stats.py), on the device
        self.register_buffer("step_tokens", torch.zeros(e, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("log_sums", torch.zeros(e + 4, dtype=torch.float32, device=device), persistent=False)
        self.aux_loss_scale = None  # the main loss's gradient scale (load_balancing.set_aux_loss_scale)

    def forward(self, tokens: torch.Tensor, seq_length: int,
                context: Optional[load_balancing.ContextSplit] = None) -> Routing:
        """Route ``tokens`` [T, h] (ordered [s, b]); in training, attach the balancing losses (over the whole
        sequence whose parts ``context``'s ranks hold, under context parallelism)."""
        c = self.config
        logits = F.linear(tokens.float(), self.weight.float())
        routing = topk_routing(logits, c.moe_router_topk, c.moe_router_score_function, c.moe_router_pre_softmax,
                               c.moe_router_num_groups, c.moe_router_group_topk, self.expert_bias)
        chosen = routing.routing_map
        if c.moe_expert_capacity_factor is not None:
            routing = Routing(*apply_capacity(routing.probs, routing.routing_map, c.moe_router_topk,
                                              c.moe_expert_capacity_factor, c.moe_token_drop_policy,
                                              c.moe_pad_expert_input_to_capacity))
        if self.training and torch.is_grad_enabled():  # not in evaluation, nor in a recomputation's first pass
            aux, z = self._losses(logits, chosen, seq_length, context)
            probs = routing.probs
            for loss, coeff in ((aux, c.moe_aux_loss_coeff), (z, c.moe_z_loss_coeff)):
                if loss is not None and coeff:
                    probs = load_balancing.attach(probs, loss * coeff, self.aux_loss_scale)
            routing = Routing(probs, routing.routing_map)
            self._count(chosen, routing.routing_map, aux, z)
        return routing

    def _losses(self, logits: torch.Tensor, chosen: torch.Tensor, seq_length: int, context):
        """(balancing loss or None, z loss or None), without their coefficients."""
        c = self.config
        aux = None
        if c.moe_router_load_balancing_type != "none":
            scores = scores_for_aux_loss(logits, c.moe_router_score_function)
            aux = (load_balancing.switch_aux_loss(scores, chosen, c.moe_router_topk, context)
                   if c.moe_router_load_balancing_type == "aux_loss" else
                   load_balancing.seq_aux_loss(scores, chosen, c.moe_router_topk, seq_length, context))
        z = load_balancing.z_loss(logits) if c.moe_z_loss_coeff else None
        return aux, z

    @torch.no_grad()
    def _count(self, chosen: torch.Tensor, kept: torch.Tensor, aux, z) -> None:
        """Accumulate tokens per expert, dropped assignments and the losses (stats.py reads ``log_sums``)."""
        per_expert = (chosen & kept).sum(dim=0).float()
        self.step_tokens += per_expert
        e = per_expert.numel()
        self.log_sums[:e] += per_expert
        self.log_sums[e] += (chosen & ~kept).sum().float()
        self.log_sums[e + 1] += 0.0 if aux is None else aux.detach()
        self.log_sums[e + 2] += 0.0 if z is None else z.detach()
        self.log_sums[e + 3] += 1.0
