"""Fused SwiGLU: ``SiLU(gate) * up`` from the interleaved (gate, up) output of one projection.

The MLP's first projection writes gate and up side by side in pairs, ``[..., f, 2]`` flattened
to ``[..., 2f]``, so that a contiguous tensor-parallel split gives each rank matching halves.
The autograd function saves only its input and recomputes the sigmoid in the backward pass,
so neither the SiLU output nor the sigmoid is stored (as Megatron's fused SwiGLU does). Its
kernels: the fp32 formulas below compiled into one kernel each by torch.compile; on the eager
backend, where nothing can fuse, PyTorch's own SiLU kernels keep the memory saving.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.fusions.backend import active_backend
from megapipe.fusions.compiled import compiled


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = x.unflatten(-1, (-1, 2))
    return pairs[..., 0], pairs[..., 1]


def swiglu_forward(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up computed in fp32, in x's dtype."""
    gate, up = _halves(x.float())
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


def swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient for the interleaved input, recomputing the sigmoid in fp32."""
    gate, up = _halves(x.float())
    sig = torch.sigmoid(gate)
    g = grad.float()
    grad_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = g * gate * sig
    return torch.stack((grad_gate, grad_up), dim=-1).flatten(-2).to(x.dtype)


def native_forward(x: torch.Tensor) -> torch.Tensor:
    gate, up = _halves(x)
    return F.silu(gate.contiguous()) * up  # SiLU's vectorised kernel needs a contiguous input (2x faster)


def native_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Both halves' gradients written straight into their interleaved places (no stacking copy)."""
    gate, up = _halves(x)
    gate = gate.contiguous()
    out = torch.empty_like(x)
    grad_gate, grad_up = _halves(out)
    grad_gate.copy_(torch.ops.aten.silu_backward(grad * up, gate))  # its vectorised kernel wants a contiguous out
    torch.mul(grad, F.silu(gate), out=grad_up)
    return out


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernels):
        ctx.save_for_backward(x)
        ctx.backward_kernel = kernels[1]
        return kernels[0](x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return ctx.backward_kernel(grad.contiguous(), x), None


def _kernels(family: str):
    if family == "compile":
        return compiled(swiglu_forward), compiled(swiglu_backward)
    return native_forward, native_backward


def swiglu(x: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """SiLU(gate) * up for ``x = [..., (gate, up) x f]``; the result is ``[..., f]``.

    ``fused=False`` is the plain PyTorch composition (``--no-bias-swiglu-fusion``).
    """
    if x.shape[-1] % 2:
        raise ValueError(f"SwiGLU input has odd width {x.shape[-1]}; it must hold (gate, up) pairs.")
    if not fused:
        return native_forward(x)
    kernels = _kernels(active_backend().family("swiglu", x))
    if not (torch.is_grad_enabled() and x.requires_grad):  # inference: no graph, no autograd function
        return kernels[0](x)
    return _SwiGLU.apply(x.contiguous(), kernels)
