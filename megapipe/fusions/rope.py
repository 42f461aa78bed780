"""Rotary position embedding (RoPE), the rotate-half convention of GPT-NeoX, Llama and Megatron.

The first ``rotary_dim`` channels of each head are split in two halves (x1, x2) and rotated by
the angle of their position: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
(-x2, x1)``; the remaining channels pass through (``--rotary-percent`` < 1). The fused path is
an autograd function that saves only ``cos`` and ``sin`` (shared by every layer) instead of
the rotated halves, with kernels compiled by torch.compile; eager PyTorch otherwise.
"""

from __future__ import annotations

import torch

from megapipe.fusions.backend import active_backend
from megapipe.fusions.compiled import compiled


def rotary_tables(positions: torch.Tensor, rotary_dim: int, base: float, dtype=torch.float32):
    """``(cos, sin)`` of shape ``[b, 1, s, rotary_dim]`` for integer ``positions`` ``[b, s]``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32)
                               / rotary_dim))
    angles = positions.float().unsqueeze(-1) * inv_freq  # [b, s, rotary_dim / 2]
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_transposed(x: torch.Tensor) -> torch.Tensor:
    """The adjoint of ``_rotate_half``: (g1, g2) -> (g2, -g1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[b, heads, s, d]``; channels past ``cos``'s width pass through."""
    r = cos.shape[-1]
    rotated = x[..., :r] * cos + _rotate_half(x[..., :r]) * sin
    return torch.cat((rotated, x[..., r:]), dim=-1) if r < x.shape[-1] else rotated


def rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    g = grad[..., :r]
    rotated = g * cos + _rotate_half_transposed(g * sin)
    return torch.cat((rotated, grad[..., r:]), dim=-1) if r < grad.shape[-1] else rotated


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, kernels):
        ctx.save_for_backward(cos, sin)
        ctx.backward_kernel = kernels[1]
        return kernels[0](x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return ctx.backward_kernel(grad, cos, sin), None, None, None


def _kernels(family: str):
    if family == "compile":
        return compiled(rope_forward), compiled(rope_backward)
    return rope_forward, rope_backward


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """RoPE of ``x`` ``[b, heads, s, d]`` with tables from ``rotary_tables`` (``--no-rope-fusion``: plain ops)."""
    if not fused:
        return rope_forward(x, cos, sin)
    kernels = _kernels(active_backend().family("rope", x))
    if not (torch.is_grad_enabled() and x.requires_grad):  # inference: no graph, no autograd function
        return kernels[0](x, cos, sin)
    return _RoPE.apply(x, cos, sin, kernels)
