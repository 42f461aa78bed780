"""Fused bias + SwiGLU: ``SiLU(gate) * up`` from the interleaved (gate, up) output of one projection.

The MLP's first projection writes gate and up side by side in pairs, ``[..., f, 2]`` flattened
to ``[..., 2f]``, so that a contiguous tensor-parallel split gives each rank matching halves; its
bias, when it has one, is interleaved the same way and added here (``skip_bias_add``). The
autograd function saves only its inputs and recomputes ``x + bias`` and the sigmoid in the backward
pass, so neither the biased input, the SiLU output nor the sigmoid is stored (as Megatron's fused
bias-SwiGLU does). Its kernels: Triton's, which also sum the bias gradient while they write the
input gradient; the fp32 formulas below compiled into one kernel each by torch.compile; on the
eager backend, where nothing can fuse, PyTorch's own SiLU kernels keep the memory saving.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.fusions.backend import active_backend
from megapipe.fusions.bias_math import add_bias_fp32, bias_grad
from megapipe.fusions.compiled import elementwise_kernels


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = x.unflatten(-1, (-1, 2))
    return pairs[..., 0], pairs[..., 1]


def swiglu_forward(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SiLU(gate) * up of ``x + bias`` computed in fp32, in x's dtype."""
    gate, up = _halves(add_bias_fp32(x, bias))
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


def swiglu_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None):
    """Gradients for the interleaved input and the bias, recomputing ``x + bias`` and the sigmoid in fp32."""
    gate, up = _halves(add_bias_fp32(x, bias))
    sig = torch.sigmoid(gate)
    g = grad.float()
    grad_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = g * gate * sig
    grad_x = torch.stack((grad_gate, grad_up), dim=-1).flatten(-2)
    return grad_x.to(x.dtype), bias_grad(grad_x, bias)


def native_forward(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = _halves(x if bias is None else x + bias)
    return F.silu(gate.contiguous()) * up  # SiLU's vectorised kernel needs a contiguous input (2x faster)


def native_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None):
    """Both halves' gradients written straight into their interleaved places (no stacking copy), then
    the bias gradient summed from them, as autograd sums it for ``x + bias``."""
    gate, up = _halves(x if bias is None else x + bias)
    gate = gate.contiguous()
    out = torch.empty_like(x)
    grad_gate, grad_up = _halves(out)
    grad_gate.copy_(torch.ops.aten.silu_backward(grad * up, gate))  # its vectorised kernel wants a contiguous out
    torch.mul(grad, F.silu(gate), out=grad_up)
    return out, bias_grad(out, bias)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, kernels):
        ctx.save_for_backward(x, bias)
        ctx.backward_kernel = kernels[1]
        return kernels[0](x, bias)

    @staticmethod
    def backward(ctx, grad):
        x, bias = ctx.saved_tensors
        grad_x, grad_bias = ctx.backward_kernel(grad.contiguous(), x, bias)
        return grad_x, grad_bias, None


def swiglu(x: torch.Tensor, bias: torch.Tensor | None = None, fused: bool = True) -> torch.Tensor:
    """SiLU(gate) * up for ``x + bias = [..., (gate, up) x f]``; the result is ``[..., f]``. ``bias`` is
    the first projection's (interleaved like x; None without one).

    ``fused=False`` is the plain PyTorch composition (``--no-bias-swiglu-fusion``).
    """
    if x.shape[-1] % 2:
        raise ValueError(f"SwiGLU input has odd width {x.shape[-1]}; it must hold (gate, up) pairs.")
    if bias is not None and bias.shape != x.shape[-1:]:
        raise ValueError(f"SwiGLU bias has shape {tuple(bias.shape)}; it must be ({x.shape[-1]},), the input's "
                         f"last dimension.")
    if not fused or torch.compiler.is_compiling():  # a compiled layer derives and fuses the backward itself
        return native_forward(x, bias)
    kernels = elementwise_kernels(active_backend().family("swiglu", x), "swiglu", (swiglu_forward, swiglu_backward),
                                  (native_forward, native_backward))
    x = x.contiguous()  # Triton's kernels index x as [rows, 2f]
    needs_grad = x.requires_grad or (bias is not None and bias.requires_grad)
    if not (torch.is_grad_enabled() and needs_grad):  # inference: no graph, no autograd function
        return kernels[0](x, bias)
    return _SwiGLU.apply(x, bias, kernels)
