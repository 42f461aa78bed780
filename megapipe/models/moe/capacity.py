"""Expert capacity: each expert takes at most ceil(k T / E x factor) tokens (GShard, Megatron-LM).

Tokens beyond an expert's capacity are dropped from that expert (their other experts and the
residual still carry them): by ``probs``, the lowest-probability ones go; by ``position``, the
latest in the sequence-major token order. With ``pad`` every expert receives exactly its
capacity: the free places are filled with the earliest tokens not routed to it, at weight 0, so
the experts' inputs have fixed shapes (what an all-to-all between expert-parallel ranks wants).
"""

from __future__ import annotations

import math

import torch


def expert_capacity(tokens: int, experts: int, topk: int, factor: float) -> int:
    return math.ceil(tokens * topk / experts * factor)


def _rank_within_expert(order_key: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """For each routed (token, expert), its place among the expert's tokens ordered by ``order_key`` (smallest
    first); unrouted entries rank after every routed one."""
    key = torch.where(routing_map, order_key, torch.full_like(order_key, float("inf")))
    order = torch.sort(key, dim=0, stable=True).indices  # [T, E]: tokens per expert, in keep order
    ranks = torch.empty_like(order)
    ranks.scatter_(0, order, torch.arange(order.shape[0], device=order.device).unsqueeze(1).expand_as(order))
    return ranks


def apply_capacity(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, factor: float, policy: str,
                   pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) [T, E] after dropping (and with ``pad`` padding) to each expert's capacity."""
    tokens, experts = routing_map.shape
    capacity = expert_capacity(tokens, experts, topk, factor)
    positions = torch.arange(tokens, device=probs.device, dtype=torch.float32).unsqueeze(1).expand(tokens, experts)
    key = -probs.float() if policy == "probs" else positions
    keep = routing_map & (_rank_within_expert(key, routing_map) < capacity)
    if pad:
        free = capacity - keep.sum(dim=0, keepdim=True)
        fill_rank = _rank_within_expert(positions, ~keep)
        keep = keep | (~keep & (fill_rank < free))
    return probs * keep, keep
