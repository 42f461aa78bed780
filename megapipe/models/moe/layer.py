"""The MoE MLP: route, permute once, run the experts, weigh and un-permute, add the shared experts.

It replaces the dense MLP of a transformer layer and returns what that returns (output, bias=None).
Tokens are permuted once into expert order (one gather), each expert runs on its contiguous run, and
one weighted ``index_add`` brings the outputs back to their tokens. Without token dropping (or with
padding to capacity) the number of routed pairs is known on the host, so the permutation needs no
host synchronisation; the grouped product needs none either. The router is replicated on every
tensor rank, the experts split their ffn dimension like the dense MLP: their partial outputs are
summed over the tensor group before being weighed, so the router sees the same gradient on every
rank. Under expert parallelism the tokens travel to the ranks holding their experts and back
(``dispatch.py``, ``--moe-token-dispatcher-type``); on one expert rank both dispatchers are this
permutation. Under sequence parallelism the layer gathers the sequence first and keeps its own
slice of the output: the routing and the experts see what they see without it, and every tensor
rank's gradient of the gathered input is whole and the same, so its backward keeps its slice.

At ``--expert-tensor-parallel-size 1`` below t, each expert is whole on its expert rank and the t
tensor ranks, which all route every token alike, each dispatch a t-th of the tokens (their share,
``_share``); the shares' outputs are summed over the tensor group (reduce-scattered under sequence
parallelism), and the tokens' and routing weights' gradients, each partial to a share, are summed
by the backward of a tensor-parallel copy.
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.mlp import MLP
from megapipe.models.moe import dispatch
from megapipe.models.moe.capacity import expert_capacity
from megapipe.models.moe.experts import GroupedExperts
from megapipe.models.moe.load_balancing import ContextSplit
from megapipe.models.moe.router import Routing, TopKRouter
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


class MoELayer(nn.Module):
    """``router``, ``experts`` and (with ``--moe-shared-expert-intermediate-size``) ``shared_experts``."""

    def __init__(self, config: ModelConfig, ps: ParallelState, name: str, seed: int, sequence_parallel: bool,
                 output_std: float, device=None):
        super().__init__()
        self.config, self.ps, self.sequence_parallel = config, ps, sequence_parallel
        self.router = TopKRouter(config, f"{name}.router", seed, device)
        self.experts = GroupedExperts(config, ps, f"{name}.experts", seed, output_std, device)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExperts(config, ps, f"{name}.shared_experts", seed, sequence_parallel,
                                                device)

    def _drops_tokens(self) -> bool:
        """Whether a capacity may drop tokens (``--moe-dropless-device-dispatch`` allows only factors that cannot)."""
        return self.config.moe_expert_capacity_factor is not None and not self.config.moe_dropless_device_dispatch

    def _assignment_count(self, tokens: int) -> int | None:
        """How many (token, expert) pairs the routing holds, when the flags fix it: k per token without a
        capacity, every expert's capacity with padding; dropping without padding leaves it to the data."""
        c = self.config
        if not self._drops_tokens():
            return tokens * c.moe_router_topk
        if c.moe_pad_expert_input_to_capacity:
            capacity = expert_capacity(tokens, c.num_experts, c.moe_router_topk, c.moe_expert_capacity_factor)
            return c.num_experts * min(capacity, tokens)
        return None

    def _share(self, tokens: torch.Tensor, routing: Routing, count: int | None, shares: int):
        """This expert-tensor group's share of the tokens, when the tensor group holds ``shares`` of them
        (expert-tensor size below t): the routing keeps only the share's rows, and the tokens and weights
        pass a tensor-parallel copy, whose backward sums the shares' gradients."""
        total = tokens.shape[0]
        sizes = [total // shares + (i < total % shares) for i in range(shares)]
        index = self.ps.tp_rank // self.ps.etp_size
        start = sum(sizes[:index])
        rows = torch.zeros(total, 1, dtype=torch.bool, device=tokens.device)
        rows[start:start + sizes[index]] = True
        group = self.ps.tp_group
        shared = Routing(mappings.copy_to_tensor_parallel_region(routing.probs, group), routing.routing_map & rows)
        count = None if count is None or self._drops_tokens() else sizes[index] * self.config.moe_router_topk
        return mappings.copy_to_tensor_parallel_region(tokens, group), shared, count

    def forward(self, x: torch.Tensor):
        """``x`` [s, b, h] -> ([s, b, h], None); under sequence parallelism this tensor rank's [s/t, b, h]."""
        whole = x
        if self.sequence_parallel:  # every tensor rank routes the whole sequence, as without it
            whole = mappings.gather_from_sequence_parallel_region(x, self.ps.tp_group, grad_is_partial=False)
        s, b, h = whole.shape
        tokens = whole.reshape(s * b, h)
        routing = self.router(tokens, s, ContextSplit(self.ps.cp_group, self.ps.cp_size))
        count = self._assignment_count(s * b)
        shares = self.ps.tp_size // self.ps.etp_size
        if shares > 1:
            tokens, routing, count = self._share(tokens, routing, count, shares)
        if self.ps.ep_size > 1 and self.config.moe_token_dispatcher_type == "allgather":
            combined = dispatch.allgather(tokens, routing, self.experts, self.ps)
        else:
            c = self.config
            padded = count // c.num_experts if c.moe_pad_expert_input_to_capacity and \
                shares == 1 else None  # each expert's capacity, the same on every rank (``_assignment_count``)
            bound = tokens.shape[0] * min(c.moe_router_topk, c.num_experts // self.ps.ep_size) \
                if c.moe_dropless_device_dispatch else None  # the most rows this rank can send one expert rank
            combined = dispatch.alltoall(tokens, routing, count, self.experts, self.ps, padded, bound)
        out = combined.view(s, b, h)
        if shares > 1:  # every share's outputs, summed over the tensor group (and this rank's slice kept)
            out = (mappings.reduce_scatter_to_sequence_parallel_region if self.sequence_parallel else
                   mappings.reduce_from_tensor_parallel_region)(out, self.ps.tp_group)
        elif self.sequence_parallel:
            out = mappings.scatter_to_sequence_parallel_region(out, self.ps.tp_group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, None
