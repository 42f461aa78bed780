"""A split backward's two parts: BI (input gradients) defers the weight-gradient products, BW runs them.

Zero-bubble schedules split each backward in two (``schedules/actions.py``). BI is an
ordinary backward through the stage, run inside ``deferring_weight_gradients``: there every
``linear`` computes its input (and bias) gradient at once, but instead of its weight gradient
it records what that product needs (the weight, the output gradient and the input). The MoE
experts' grouped product (``models/moe/grouped_linear.py``) records its per-expert products
through ``weight_gradient`` the same way. Every other gradient, small ones such as norms' and the
embeddings', is accumulated as usual. BW
then runs the recorded products (``apply_weight_gradients``) and accumulates them through
autograd, so the gradient syncs' post-accumulate hooks see them like any backward's; a weight
whose products go straight into its main gradient (``grad_accumulation.py``) gets them there,
and its gradient sync hears of it once per BW. The graph is freed by BI; between the two parts
only the recorded tensors are held.

Recomputed blocks need nothing special: their backward runs inside BI, so their linears defer
too. Outside that context ``linear`` is ``F.linear`` with the same gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import torch
import torch.nn.functional as F

from megapipe.parallel.collectives import all_gather_into, group_size
from megapipe.tensor_parallel.collective_matmul import scattered_product
from megapipe.tensor_parallel.column_input import ColumnInput, backward_products
from megapipe.tensor_parallel.grad_accumulation import WeightGradient, accumulate_product, main_grad_target

Deferred = list[tuple[torch.Tensor, WeightGradient]]
"""Recorded weight-gradient products: (weight, its gradient to compute)."""

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
    """Compute the recorded products: into the main gradients of the weights that take them, then tell
    each such weight's owner once; the others accumulated through autograd, which runs the weights' hooks."""
    weights, grads, targets = [], [], {}
    deferred.reverse()
    with torch.no_grad():  # the recorded tensors belong to a graph; these products need none of their own
        while deferred:  # in recorded order, each product's operands freed once it is done, as B frees them
            weight, gradient = deferred.pop()
            target = main_grad_target(weight)
            if target is None:
                weights.append(weight)
                grads.append(gradient.compute().to(weight.dtype))
            else:
                gradient.accumulate_into(target.open())
                targets[id(target)] = target
            del gradient
    for target in targets.values():
        target.close()
    if weights:
        torch.autograd.backward(weights, grads)


def weight_gradient(weight: torch.Tensor, gradient: WeightGradient) -> Optional[torch.Tensor]:
    """What a backward returns as ``weight``'s gradient: None when BW computes it (inside
    ``deferring_weight_gradients``) or when it went straight into the weight's main gradient
    (``grad_accumulation.py``), else the gradient itself."""
    deferred = _DEFERRED.get()
    if deferred is not None:
        deferred.append((weight, gradient))
        return None
    target = main_grad_target(weight)
    if target is None:
        return gradient.compute()
    gradient.accumulate_into(target.open())
    return None


class _Linear(torch.autograd.Function):
    """``F.linear`` over 2-d inputs whose weight gradient can be deferred to BW (module docstring), and
    whose input may enter the tensor-parallel region inside it (``column_input.py``)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, column_input: Optional[ColumnInput]):
        ctx.save_for_backward(inp, weight)  # with sequence parallelism, this rank's rows only
        ctx.weight = weight  # whose gradient it is: under saved-tensor hooks the saved one comes back a copy
        ctx.has_bias, ctx.column_input = bias is not None, column_input
        return F.linear(inp, weight, bias) if column_input is None else column_input.linear(inp, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        needs_inp, needs_weight, needs_bias, _ = ctx.needs_input_grad

        def weight_grad(full_input):
            if not needs_weight:
                return None
            return weight_gradient(ctx.weight, WeightGradient(
                lambda: grad_output.t().mm(full_input),
                lambda main_grad: accumulate_product(main_grad, grad_output.t(), full_input)))

        grad_inp, grad_weight = backward_products(ctx, inp,
                                                  (lambda: grad_output.mm(weight)) if needs_inp else None,
                                                  weight_grad)
        grad_bias = grad_output.sum(0) if ctx.has_bias and needs_bias else None
        return grad_inp, grad_weight, grad_bias, None


def linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           column_input: Optional[ColumnInput] = None) -> torch.Tensor:
    """``F.linear(inp, weight, bias)``; inside ``deferring_weight_gradients`` its weight gradient waits for BW.
    With ``column_input`` the input first enters the tensor-parallel region, its collectives fused into the
    backward where that applies (``column_input.py``).

    The function itself works on the rows ``[tokens, features]`` and the view back to the input's
    leading dimensions is taken outside it, so the output may be modified in place like F.linear's.
    """
    if column_input is not None and not column_input.fused():
        inp, column_input = column_input.enter(inp), None
    # evaluation and generation have no backward to split, and a compiled layer's backward computes every
    # gradient at once (``models/compiled_layers.py``)
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return F.linear(inp, weight, bias)
    rows = _Linear.apply(inp.reshape(-1, inp.shape[-1]), weight, bias, column_input)
    if column_input is not None:
        column_input.remember(rows.grad_fn)
    return rows.view(-1, *inp.shape[1:-1], weight.shape[0])


class _ScatteredLinear(torch.autograd.Function):
    """A row-parallel product and the reduce-scatter along the sequence after it, as one collective matmul
    (``collective_matmul.scattered_product``); the backward gathers the output gradient and is ``_Linear``'s."""

    @staticmethod
    def forward(ctx, inp, weight, bias, group):
        ctx.save_for_backward(inp, weight)
        ctx.weight, ctx.has_bias, ctx.column_input, ctx.group = weight, False, None, group
        return scattered_product(inp, weight, group)

    @staticmethod
    def backward(ctx, grad_output):
        full = grad_output.new_empty((grad_output.shape[0] * group_size(ctx.group), *grad_output.shape[1:]))
        all_gather_into(full, grad_output.contiguous(), ctx.group)
        return _Linear.backward(ctx, full)


def scattered_linear(inp: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """A sequence-parallel row-parallel product's output, summed over ``group`` and split along the sequence,
    as one collective matmul."""
    rows = _ScatteredLinear.apply(inp.reshape(-1, inp.shape[-1]), weight, None, group)
    return rows.view(-1, *inp.shape[1:-1], weight.shape[0])
