"""Auxiliary-loss-free balancing (DeepSeek-V3 report, section 2.1.2): after each optimizer step, every
expert's routing bias moves by ``--moe-router-bias-update-rate`` towards balance,

    b_e <- b_e + rate * sign(mean_j c_j - c_e),

where c_e counts the tokens routed to expert e during the step, summed over the data-parallel
replicas and context ranks, each of which routes tokens of its own (tensor ranks route the same
tokens, so they agree without a sum). An overloaded expert is
chosen less often afterwards, an idle one more; the bias never changes the weights of the outputs.
"""

from __future__ import annotations

import torch

from megapipe.models.moe.router import TopKRouter
from megapipe.parallel.collectives import all_reduce, group_size


def bias_update(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """The new bias for one step's per-expert ``counts``."""
    return bias + rate * torch.sign(counts.mean() - counts)


@torch.no_grad()
def update_expert_biases(chunks, dp_group=None) -> None:
    """Move the expert bias of every router in ``chunks`` after a step and restart the step's counts
    (a collective over ``dp_group`` when it has more than one rank)."""
    for chunk in chunks:
        for router in chunk.modules():
            if not isinstance(router, TopKRouter):
                continue
            if router.expert_bias is not None:
                counts = router.step_tokens.clone()
                if group_size(dp_group) > 1:
                    all_reduce(counts, dp_group)
                router.expert_bias.copy_(bias_update(router.expert_bias, counts,
                                                     router.config.moe_router_bias_update_rate))
            router.step_tokens.zero_()
