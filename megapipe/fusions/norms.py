"""LayerNorm and RMSNorm modules whose kernels follow the fusion backend.

apex's fused kernels under the apex backend, Triton kernels under triton, and otherwise
``torch.nn.functional.layer_norm`` / ``rms_norm`` (already single fused kernels in PyTorch).
Parameters are named ``weight`` and ``bias`` so state dicts match ``torch.nn.LayerNorm`` and
``torch.nn.RMSNorm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.fusions.backend import active_backend


def _family(op: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    family = active_backend().family(op, x)
    # apex's affine kernels take input and weight of one dtype; mixed dtypes stay with PyTorch.
    return "eager" if family == "apex" and x.dtype != weight.dtype else family


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension with an affine ``weight`` and ``bias``."""
    family = _family("layer_norm", x, weight)
    if family == "apex":
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine

        return fused_layer_norm_affine(x, weight, bias, weight.shape, eps)
    if family == "triton":
        from megapipe.fusions import triton_norms

        return triton_norms.layer_norm(x, weight, bias, eps)
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``."""
    family = _family("rms_norm", x, weight)
    if family == "apex":
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine

        return fused_rms_norm_affine(x, weight, weight.shape, eps)
    if family == "triton":
        from megapipe.fusions import triton_norms

        return triton_norms.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


class LayerNorm(nn.Module):
    """LayerNorm over the last ``hidden_size`` features (weight ones, bias zeros at start)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"


class RMSNorm(nn.Module):
    """RMSNorm over the last ``hidden_size`` features (weight ones at start, no bias)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"

