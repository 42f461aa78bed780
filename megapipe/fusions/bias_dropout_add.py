"""Fused bias + dropout + residual add: ``residual + dropout(x + bias)`` (seed 002 section 4.4.2).

Used after the attention and MLP output projections on [s, b, h] activations (any [..., h]
works). The eager and torch.compile kernels draw the keep mask exactly as ``F.dropout`` draws
it on CPU (``bernoulli_(1 - p)`` on a tensor like ``x``, from the default generator of x's
device), so on CPU fused and unfused runs drop the same elements for the same seed and leave
the generator in the same state. Triton kernels draw Philox numbers in the kernel from a seed
taken from that same generator, and recompute the mask in the backward pass instead of
storing it. Callers under tensor parallelism choose the generator state (RNG tracker).

The eager backend, where nothing can fuse, does ``F.dropout``'s own arithmetic (the mask
scaled in x's dtype, kept for the backward pass) with fewer passes: one ``addcmul`` applies
mask and residual, so the dropped activations are never materialized. torch.compile keeps the
0/1 mask and computes in fp32, rounding once; Triton kernels store no mask at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.fusions.backend import active_backend
from megapipe.fusions.bias_math import add_bias_fp32, bias_grad, keep_scale, output_dtype
from megapipe.fusions.compiled import compiled


def draw_keep_mask(x: torch.Tensor, p: float) -> torch.Tensor | None:
    """1 where dropout keeps an element, 0 where it drops it (x's dtype), drawn exactly as
    ``F.dropout`` draws it; None when p == 0."""
    if p == 0.0:
        return None
    if p == 1.0:  # F.dropout draws nothing here either
        return torch.zeros_like(x)
    return torch.empty_like(x).bernoulli_(1.0 - p)


def dropout_add_forward(x, bias, residual, keep, scale: float) -> torch.Tensor:
    """``residual + keep * (x + bias) * scale`` in fp32, rounded once to the result dtype.

    ``keep`` is the 0/1 mask from ``draw_keep_mask`` (or None: no dropout).
    """
    y = add_bias_fp32(x, bias)
    if keep is not None:
        y = y * keep * scale
    return (residual.float() + y).to(output_dtype(x, bias, residual))


def dropout_add_backward(grad, keep, bias, scale: float, x_dtype: torch.dtype):
    """Gradients for x and bias: the incoming gradient times the 0/1 ``keep`` mask and ``scale``."""
    grad_y = grad.float() if keep is None else grad.float() * keep * scale
    return grad_y.to(x_dtype), bias_grad(grad_y, bias)


def _eager_forward(x, bias, residual, p):
    """(output, scaled mask): F.dropout's mask ``bernoulli_(1 - p).div_(1 - p)`` and one addcmul."""
    y = x if bias is None else x + bias
    noise = draw_keep_mask(x, p)
    if noise is None:
        return residual + y, None
    if p < 1.0:
        noise.div_(1.0 - p)
    return torch.addcmul(residual, y, noise), noise


def _eager_backward(grad, noise, bias, p, x_dtype):
    grad_y = grad if noise is None else grad * noise
    return grad_y.to(x_dtype), bias_grad(grad_y, bias)


def _compiled_forward(x, bias, residual, p):
    keep = draw_keep_mask(x, p)
    return compiled(dropout_add_forward)(x, bias, residual, keep, keep_scale(p)), keep


def _compiled_backward(grad, keep, bias, p, x_dtype):
    return compiled(dropout_add_backward)(grad, keep, bias, keep_scale(p), x_dtype)


_EAGER_KERNELS = (_eager_forward, _eager_backward)


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, kernels):
        out, dropout_state = kernels[0](x, bias, residual, p)
        ctx.save_for_backward(dropout_state, bias)
        ctx.p, ctx.x_dtype, ctx.residual_dtype, ctx.backward_kernel = p, x.dtype, residual.dtype, kernels[1]
        return out

    @staticmethod
    def backward(ctx, grad):
        dropout_state, bias = ctx.saved_tensors
        grad_x, grad_bias = ctx.backward_kernel(grad.contiguous(), dropout_state, bias, ctx.p, ctx.x_dtype)
        return grad_x, grad_bias, grad.to(ctx.residual_dtype), None, None


def _kernels(family: str):
    if family == "triton":
        from megapipe.fusions import triton_elementwise

        return triton_elementwise.bias_dropout_add_forward, triton_elementwise.bias_dropout_add_backward
    if family == "compile":
        return _compiled_forward, _compiled_backward
    return _EAGER_KERNELS


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     training: bool, fused: bool = True) -> torch.Tensor:
    """``residual + dropout(x + bias, p)``; dropout only when ``training``.

    ``x`` and ``residual`` have the same shape, ``bias`` is x's last dimension (or None).
    ``fused=False`` is the plain PyTorch composition (``--no-bias-dropout-fusion``).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability {p} must be between 0 and 1.")
    if x.shape != residual.shape:
        raise ValueError(f"bias_dropout_add needs x and residual of the same shape, got {tuple(x.shape)} "
                         f"and {tuple(residual.shape)}.")
    if not fused:
        return residual + F.dropout(x if bias is None else x + bias, p=p, training=training)
    family = active_backend().family("bias_dropout_add", x)
    return _BiasDropoutAdd.apply(x.contiguous(), bias, residual.contiguous(), p if training else 0.0,
                                 _kernels(family))
