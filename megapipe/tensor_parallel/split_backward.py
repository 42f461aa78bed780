"""A split backward's two parts: BI (input gradients) defers the weight-gradient products, BW runs them.

Zero-bubble schedules split each backward in two (``pipeline/ir/actions.py``). BI is an
ordinary backward through the stage, run inside ``deferring_weight_gradients``: there every
``linear`` computes its input (and bias) gradient at once, but instead of its weight gradient
it records what that product needs (the weight, the output gradient and the input). The MoE
experts' grouped product (``models/moe/grouped_linear.py``) records its per-expert products
through ``defer`` the same way. Every other gradient, small ones such as norms' and the
embeddings', is accumulated as usual. BW
then runs the recorded products (``apply_weight_gradients``) and accumulates them through
autograd, so the gradient syncs' post-accumulate hooks see them like any backward's. The
graph is freed by BI; between the two parts only the recorded tensors are held.

Recomputed blocks need nothing special: their backward runs inside BI, so their linears defer
too. Outside that context ``linear`` is ``F.linear`` with the same gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional

import torch
import torch.nn.functional as F

Deferred = list[tuple[torch.Tensor, Callable[[], torch.Tensor]]]
"""Recorded weight-gradient products: (weight, the function computing its gradient)."""

_DEFERRED: contextvars.ContextVar[Optional[Deferred]] = contextvars.ContextVar("deferred_weight_gradients",
                                                                                default=None)


@contextlib.contextmanager
def deferring_weight_gradients(deferred: Deferred):
    """Within it, ``linear``'s backward appends its weight-gradient product to ``deferred``."""
    token = _DEFERRED.set(deferred)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def apply_weight_gradients(deferred: Deferred) -> None:
    """Compute the recorded products and accumulate them into the weights (through autograd's
    accumulation, which runs the weights' hooks)."""
    weights, grads = [], []
    for weight, product in deferred:
        weights.append(weight)
        grads.append(product().to(weight.dtype))
    deferred.clear()
    if weights:
        torch.autograd.backward(weights, grads)


def defer(weight: torch.Tensor, product: Callable[[], torch.Tensor]) -> bool:
    """Inside ``deferring_weight_gradients``, record ``product`` (which computes ``weight``'s gradient) for
    BW and say so; outside it, do nothing and return False (the caller computes the gradient now)."""
    deferred = _DEFERRED.get()
    if deferred is None:
        return False
    deferred.append((weight, product))
    return True


def _weight_grad(grad_output: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    return grad_output.t().mm(inp)


class _Linear(torch.autograd.Function):
    """``F.linear`` over 2-d inputs whose weight gradient can be deferred to BW (module docstring)."""

    @staticmethod
    def forward(ctx, inp, weight, bias):
        ctx.save_for_backward(inp, weight)
        ctx.has_bias = bias is not None
        return F.linear(inp, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        needs_inp, needs_weight, needs_bias = ctx.needs_input_grad
        grad_inp = grad_output.mm(weight) if needs_inp else None
        grad_bias = grad_output.sum(0) if ctx.has_bias and needs_bias else None
        grad_weight = None
        if needs_weight and not defer(weight, lambda: _weight_grad(grad_output, inp)):
            grad_weight = _weight_grad(grad_output, inp)
        return grad_inp, grad_weight, grad_bias


def linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(inp, weight, bias)``; inside ``deferring_weight_gradients`` its weight gradient waits for BW.

    The function itself works on the rows ``[tokens, features]`` and the view back to the input's
    leading dimensions is taken outside it, so the output may be modified in place like F.linear's.
    """
    if not torch.is_grad_enabled():  # evaluation and generation: no backward to split
        return F.linear(inp, weight, bias)
    rows = _Linear.apply(inp.reshape(-1, inp.shape[-1]), weight, bias)
    return rows.view(*inp.shape[:-1], weight.shape[0])
