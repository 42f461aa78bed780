"""The column- and row-parallel linears' products in FP8 under ``--fp8-format`` (``fusions/fp8.py``).

``parallel_linear`` is what ``ColumnParallelLinear`` and ``RowParallelLinear`` compute: with an active
recipe (``fusions/fp8_mode.py``) the forward ``y = x W^T``, the input gradient ``dx = dy W`` and the weight
gradient ``dW = dy^T x`` each run as one FP8 product, x and W in E4M3 and dy in E4M3 (``e4m3``) or E5M2
(``hybrid``), scaled per tensor or per row (``fusions/fp8.py``), with outputs in the activations' dtype and
the bias and its gradient in it too; without one it is ``split_backward.linear``. The output layer and
BERT's heads keep their bf16 products, as in Megatron-LM.

The weights, their fp32 main gradients and the optimizer are untouched: FP8 is how the products are
computed, not how anything is stored, so checkpoints are the same and a run resumes in bf16 from an FP8
run's. The weight gradient goes through ``split_backward.weight_gradient`` like the bf16 linear's: a
zero-bubble schedule's BI records it (holding the FP8 operands) and its BW runs it, and with
gradient-accumulation fusion it is added into ``main_grad`` (tensorwise products write fp32 for it;
rowwise ones write bf16 only, which is then added).

Tensorwise, the forward's FP8 input and weight are what the backward reuses (the input kept in FP8: half
the bytes of a bf16 one); rowwise, the backward scales them again along the other dimension, so the
bf16 input is kept. With sequence parallelism this rank's bf16 rows are kept (1/t of the input) and the
backward quantises the re-gathered input again, the same values as the forward's
(``tensor_parallel/column_input.py``). Forward products accumulate fast (Hopper's FP8 units without periodic promotion),
backward ones fully, as torchao does. In code that torch.compile traces, the weight gradient is returned to
the compiled backward, which computes every gradient at once (``models/compiled_layers.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from megapipe.fusions.fp8 import Fp8Recipe, Quantised, quantise, scaled_mm
from megapipe.fusions.fp8_mode import active_fp8
from megapipe.parallel.collectives import group_size
from megapipe.tensor_parallel import mappings
from megapipe.tensor_parallel.column_input import ColumnInput, backward_products, overlaps
from megapipe.tensor_parallel.grad_accumulation import WeightGradient
from megapipe.tensor_parallel.split_backward import linear, scattered_linear, weight_gradient


class _Fp8Linear(torch.autograd.Function):
    """``F.linear`` over 2-d inputs with its three products in FP8 (module docstring), its input entering the
    tensor-parallel region inside it where ``column_input`` says so (``column_input.py``)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, recipe: Fp8Recipe, column_input: Optional[ColumnInput]):
        full = inp if column_input is None else column_input.gather(inp)
        x = quantise(full, recipe.forward_dtype, recipe.rowwise, 1)
        w = quantise(weight.t(), recipe.forward_dtype, recipe.rowwise, 0)  # [in, out], column-major
        out = scaled_mm(x, w, inp.dtype, fast_accumulation=True)
        if bias is not None:
            out += bias
        ctx.recipe, ctx.dtype, ctx.has_bias, ctx.column_input = recipe, inp.dtype, bias is not None, column_input
        ctx.weight = weight  # whose gradient it is: under saved-tensor hooks the saved one comes back a copy
        # the input as the weight gradient reads it: quantised again from this rank's rows (gathered in the
        # backward) rowwise or with sequence parallelism, else the forward's FP8 input itself
        ctx.requantise = recipe.rowwise or full is not inp
        if recipe.rowwise:  # the weight too is quantised again, along its other dimension
            ctx.save_for_backward(inp, weight)
        elif ctx.requantise:
            ctx.save_for_backward(inp, weight, w.data, w.scale)
        else:
            ctx.save_for_backward(x.data, weight, w.data, w.scale, x.scale)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        recipe = ctx.recipe
        needs_inp, needs_weight, needs_bias, _, _ = ctx.needs_input_grad
        kept, weight, *quantised = ctx.saved_tensors
        if recipe.rowwise:
            grad = quantise(grad_output, recipe.gradient_dtype, True, 1) if needs_inp else None
            w = quantise(weight, recipe.forward_dtype, True, 0) if needs_inp else None
            grad_t = quantise(grad_output.t(), recipe.gradient_dtype, True, 1) if needs_weight else None
        else:
            grad = quantise(grad_output, recipe.gradient_dtype, False)
            w, grad_t = Quantised(*quantised[:2]).t(), grad.t()
        rows = kept if ctx.requantise else Quantised(kept, quantised[2])

        def weight_grad(full):
            if not needs_weight:
                return None
            x = quantise(full, recipe.forward_dtype, recipe.rowwise, 0 if recipe.rowwise else 1) \
                if ctx.requantise else full
            gradient = _weight_gradient(grad_t, x, weight.dtype, recipe)
            return gradient.compute() if torch.compiler.is_compiling() else weight_gradient(ctx.weight, gradient)

        grad_inp, grad_weight = backward_products(ctx, rows,
                                                  (lambda: scaled_mm(grad, w, ctx.dtype)) if needs_inp else None,
                                                  weight_grad)
        grad_bias = grad_output.sum(0) if ctx.has_bias and needs_bias else None
        return grad_inp, grad_weight, grad_bias, None, None


def _weight_gradient(grad_t: Quantised, x: Quantised, dtype: torch.dtype, recipe: Fp8Recipe) -> WeightGradient:
    """``dy^T x`` in ``dtype``, or added into a main gradient (in fp32 where the recipe's product can write it)."""

    def accumulate_into(main_grad: torch.Tensor) -> None:
        main_grad.add_(scaled_mm(grad_t, x, dtype if recipe.rowwise else main_grad.dtype))

    return WeightGradient(lambda: scaled_mm(grad_t, x, dtype), accumulate_into)


def parallel_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    column_input: Optional[ColumnInput] = None) -> torch.Tensor:
    """``F.linear(inp, weight, bias)`` of a column- or row-parallel linear: in FP8 under the active recipe
    (in every pass that runs it, so a recomputed forward equals the first), else ``split_backward.linear``;
    a column-parallel one's input enters the tensor-parallel region through ``column_input``."""
    recipe = active_fp8()
    if recipe is None:
        return linear(inp, weight, bias, column_input)
    if column_input is not None and not column_input.fused():
        inp, column_input = column_input.enter(inp), None
    rows = _Fp8Linear.apply(inp.reshape(-1, inp.shape[-1]), weight, bias, recipe, column_input)
    if column_input is not None:
        column_input.remember(rows.grad_fn)
    return rows.view(-1, *inp.shape[1:-1], weight.shape[0])


def sequence_scattered_linear(inp: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """A row-parallel linear's output under sequence parallelism: ``parallel_linear`` summed over ``group``
    and split along the sequence; as one collective matmul (``collective_matmul.py``) where the
    tensor-parallel overlap is on and the product is not FP8's, else the product then the reduce-scatter."""
    if active_fp8() is None and overlaps(group_size(group)):
        return scattered_linear(inp, weight, group)
    return mappings.reduce_scatter_to_sequence_parallel_region(parallel_linear(inp, weight), group)
