"""Bias, dropout-scale and dtype helpers shared by the fused elementwise ops (eager and Triton)."""

from __future__ import annotations

import torch


def add_bias_fp32(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x + bias`` in fp32 (bias broadcast over the leading dimensions); ``x`` if there is no bias."""
    y = x.float()
    return y if bias is None else y + bias.float()


def bias_grad(grad: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias gradient: ``grad`` summed over the leading dimensions (accumulated in at least
    fp32), in the bias's dtype."""
    if bias is None:
        return None
    return grad.reshape(-1, bias.numel()).sum(0, dtype=torch.promote_types(grad.dtype, torch.float32)).view(bias.shape).to(bias.dtype)


def keep_scale(p: float) -> float:
    """The factor kept elements are multiplied by: 1 / (1 - p), and 0 when everything is dropped."""
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)


def output_dtype(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.dtype:
    """The dtype PyTorch's ``residual + (x + bias)`` would have."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return dtype if bias is None else torch.promote_types(dtype, bias.dtype)
