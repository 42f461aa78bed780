"""The MoE MLP: route, permute once, run the experts, weigh and un-permute, add the shared experts.

It replaces the dense MLP of a transformer layer and returns what that returns (output, bias=None).
Tokens are permuted once into expert order (one gather), each expert runs on its contiguous run, and
one weighted ``index_add`` brings the outputs back to their tokens. Without token dropping (or with
padding to capacity) the number of routed pairs is known on the host, so the permutation needs no
host synchronisation; the grouped product needs none either. The router is replicated on every
tensor rank, the experts split their ffn dimension like the dense MLP: their partial outputs are
summed over the tensor group before being weighed, so the router sees the same gradient on every
rank. On one expert rank both token dispatchers (``--moe-token-dispatcher-type``) are this
permutation; expert parallelism will exchange the permuted tokens between ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.mlp import MLP
from megapipe.models.moe.capacity import expert_capacity
from megapipe.models.moe.experts import GroupedExperts
from megapipe.models.moe.router import TopKRouter
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel import mappings
from megapipe.tensor_parallel.utils import init_normal_


class SharedExperts(MLP):
    """The dense MLP every token passes (DeepSeek, Qwen2-MoE) at ``--moe-shared-expert-intermediate-size``,
    scaled with ``--moe-shared-expert-gate`` by sigmoid(x . gate) per token (a replicated [1, h] weight)."""

    def __init__(self, config: ModelConfig, ps: ParallelState, name: str, seed: int, sequence_parallel: bool,
                 device=None):
        super().__init__(config, ps, name, seed, sequence_parallel, device,
                         ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        self.gate = None
        if config.moe_shared_expert_gate:
            self.gate = nn.Linear(config.hidden_size, 1, bias=False, device=device, dtype=config.params_dtype)
            init_normal_(self.gate.weight, (1, config.hidden_size), config.init_method_std, seed, f"{name}.gate.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = super().forward(x)
        if bias is not None:
            out = out + bias
        return out if self.gate is None else torch.sigmoid(self.gate(x)) * out


def assignments(routing_map: torch.Tensor, count: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, token) index pairs of the map's True entries [T, E], sorted by expert, then token, found by a
    stable sort. Their ``count``, when the caller does not know it, is read from the device (a synchronisation)."""
    if count is None:
        count = int(routing_map.sum())
    flat = routing_map.t().reshape(-1).to(torch.int8)
    positions = torch.sort(flat, descending=True, stable=True).indices[:count]
    tokens = routing_map.shape[0]
    return positions // tokens, positions % tokens


class MoELayer(nn.Module):
    """``router``, ``experts`` and (with ``--moe-shared-expert-intermediate-size``) ``shared_experts``."""

    def __init__(self, config: ModelConfig, ps: ParallelState, name: str, seed: int, sequence_parallel: bool,
                 output_std: float, device=None):
        super().__init__()
        self.config, self.ps = config, ps
        self.router = TopKRouter(config, f"{name}.router", seed, device)
        self.experts = GroupedExperts(config, ps, f"{name}.experts", seed, output_std, device)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExperts(config, ps, f"{name}.shared_experts", seed, sequence_parallel,
                                                device)

    def _assignment_count(self, tokens: int) -> int | None:
        """How many (token, expert) pairs the routing holds, when the flags fix it: k per token without a
        capacity, every expert's capacity with padding; dropping without padding leaves it to the data."""
        c = self.config
        if c.moe_expert_capacity_factor is None:
            return tokens * c.moe_router_topk
        if c.moe_pad_expert_input_to_capacity:
            capacity = expert_capacity(tokens, c.num_experts, c.moe_router_topk, c.moe_expert_capacity_factor)
            return c.num_experts * min(capacity, tokens)
        return None

    def forward(self, x: torch.Tensor):
        """``x`` [s, b, h] -> ([s, b, h], None)."""
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        routing = self.router(tokens, s)
        expert_ids, token_ids = assignments(routing.routing_map, self._assignment_count(s * b))
        counts = routing.routing_map.sum(dim=0)
        permuted = mappings.copy_to_tensor_parallel_region(tokens, self.ps.tp_group)[token_ids]
        out = mappings.reduce_from_tensor_parallel_region(self.experts(permuted, counts), self.ps.tp_group)
        weights = routing.probs[token_ids, expert_ids].unsqueeze(-1)
        combined = torch.zeros_like(tokens).index_add_(0, token_ids, (out * weights).to(tokens.dtype))
        if self.shared_experts is not None:
            combined = combined + self.shared_experts(x).reshape(s * b, h)
        return combined.view(s, b, h), None
