"""Fused bias + GeLU (seed 002 section 4.4.2), exact (erf) or tanh approximation.

The autograd function saves only its inputs ``(x, bias)`` and recomputes ``x + bias`` in the
backward pass, so the intermediate sum is never stored (as Megatron's fused version does).
Its kernels: the explicit fp32 formulas below, compiled into one kernel each by torch.compile
(the Triton kernels implement the same formulas), computing in fp32 and rounding once; and,
on the eager backend where nothing can fuse, PyTorch's own GeLU kernels, which keep the
memory saving and the unfused path's speed and numerics.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megapipe.fusions.backend import active_backend
from megapipe.fusions.bias_math import add_bias_fp32, bias_grad
from megapipe.fusions.compiled import elementwise_kernels

APPROXIMATIONS = ("none", "tanh")

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def gelu_forward(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """GeLU(x + bias) computed in fp32, in x's dtype."""
    y = add_bias_fp32(x, bias)
    if approximate == "tanh":
        out = 0.5 * y * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (y + _CUBIC * y * y * y)))
    else:
        out = 0.5 * y * (1.0 + torch.erf(y * _INV_SQRT_2))
    return out.to(x.dtype)


def gelu_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str):
    """Gradients of GeLU(x + bias) for x and bias, recomputing x + bias."""
    y = add_bias_fp32(x, bias)
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (y + _CUBIC * y * y * y))
        slope = 0.5 * (1.0 + t) + 0.5 * y * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _CUBIC * y * y)
    else:
        slope = 0.5 * (1.0 + torch.erf(y * _INV_SQRT_2)) + y * torch.exp(-0.5 * y * y) * _INV_SQRT_2PI
    grad_y = grad.float() * slope
    return grad_y.to(x.dtype), bias_grad(grad_y, bias)


def native_forward(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """GeLU(x + bias) with PyTorch's kernels (the eager backend)."""
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def native_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str):
    """Gradients for x and bias with PyTorch's GeLU backward kernel, recomputing x + bias."""
    grad_y = torch.ops.aten.gelu_backward(grad, x if bias is None else x + bias, approximate=approximate)
    return grad_y, bias_grad(grad_y, bias)


class _BiasGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate, kernels):
        ctx.save_for_backward(x, bias)
        ctx.approximate, ctx.backward_kernel = approximate, kernels[1]
        return kernels[0](x, bias, approximate)

    @staticmethod
    def backward(ctx, grad):
        x, bias = ctx.saved_tensors
        grad_x, grad_bias = ctx.backward_kernel(grad.contiguous(), x, bias, ctx.approximate)
        return grad_x, grad_bias, None, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none",
              fused: bool = True) -> torch.Tensor:
    """GeLU(x + bias); ``bias`` has x's last dimension (or is None).

    ``approximate`` is "none" (exact, erf; BERT) or "tanh" (GPT-2). ``fused=False`` is the
    plain PyTorch composition (``--no-bias-gelu-fusion``).
    """
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"GeLU approximation {approximate!r} is unknown; use 'none' or 'tanh'.")
    if not fused:
        return native_forward(x, bias, approximate)
    kernels = elementwise_kernels(active_backend().family("bias_gelu", x), "bias_gelu", (gelu_forward, gelu_backward),
                                  (native_forward, native_backward))
    return _BiasGeLU.apply(x.contiguous(), bias, approximate, kernels)
