"""Exact combination of attention over disjoint key blocks by their log-sum-exps.

If block A gives out_A = softmax-weighted values with normaliser exp(lse_A) and block B likewise,
attention over A and B together is (exp(lse_A) out_A + exp(lse_B) out_B) / exp(lse), with
lse = log(exp(lse_A) + exp(lse_B)). Accumulators are fp32 whatever the blocks' dtype. A row no
block has reached yet has lse -inf and weight 0, without NaN.
"""

from __future__ import annotations

import torch


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the union of the keys behind (out, lse) and (block_out, block_lse).

    ``out``: [..., sq, d] fp32; ``lse``: [..., sq] fp32 (-inf where no key was seen yet)."""
    total = torch.logaddexp(lse, block_lse)
    finite = total.masked_fill(total == float("-inf"), 0.0)
    merged = out * torch.exp(lse - finite).unsqueeze(-1) + block_out.float() * torch.exp(block_lse - finite).unsqueeze(-1)
    return merged, total
