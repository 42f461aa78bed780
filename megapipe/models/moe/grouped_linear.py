"""Rows sorted by expert times their expert's weight, with a backward whose weight gradient can wait for BW.

``grouped_linear(x, weight, counts)``: ``x`` [N, in] holds ``counts[e]`` rows of expert e after
another, ``weight`` [E, out, in] is stacked by expert; row i gets ``x[i] @ weight[e(i)].T``. Rows past
the counts' sum are padding: their outputs are left unwritten and they reach no weight gradient. It runs
as one ``torch._grouped_mm`` where this build has it for the tensors' device and dtype (and their
widths are multiples of 16 bytes), else as a loop over the experts' runs, which reads the counts on
the host once (unless they are one int: every expert padded to its capacity). The backward computes the input gradient at once and the weight gradients (one
product per expert, ``x_e^T``-shaped) through ``split_backward.weight_gradient``: under a zero-bubble
schedule's BI they wait for its BW, like a dense linear's, and with gradient-accumulation fusion
(``tensor_parallel/grad_accumulation.py``) they go into the stacked weight's main gradient. The loop
adds each expert's product into its block there in fp32 where the device can; ``_grouped_mm`` has no
accumulating form, so the grouped product is computed in the weights' dtype and then added.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from megapipe.tensor_parallel.grad_accumulation import WeightGradient, accumulate_product
from megapipe.tensor_parallel.split_backward import weight_gradient

Counts = Union[torch.Tensor, int]
"""Rows per expert: a tensor of one count per expert, or one int when every expert has that many (the dispatch
padded each to its capacity), which the host knows without reading the device."""


@functools.lru_cache(maxsize=None)
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs (3-d and 2-d weights, as forward and backward use it) on this
    device and dtype, tried once."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.ones(4, 16, device=device, dtype=dtype)
        b = torch.ones(2, 16, 16, device=device, dtype=dtype)
        offsets = torch.arange(1, 3, device=device, dtype=torch.int32) * 2  # experts of 2 rows each
        torch._grouped_mm(a, b, offs=offsets)
        torch._grouped_mm(a.t(), a, offs=offsets)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _aligned(*tensors: torch.Tensor) -> bool:
    """``_grouped_mm`` wants every stride of 16 bytes or more a multiple of 16 bytes."""
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


class _Products:
    """The three per-expert products of one grouped linear, grouped or looped."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, counts: Counts, grouped: bool):
        self.grouped = grouped and grouped_mm_works(x.device, x.dtype) and _aligned(x, weight.transpose(1, 2))
        experts = weight.shape[0]
        if self.grouped:
            self.offsets = (torch.cumsum(counts, dim=0).to(torch.int32) if isinstance(counts, torch.Tensor) else
                            torch.arange(1, experts + 1, device=x.device, dtype=torch.int32) * counts)
        else:  # the loop's one read of the device, unless every expert has the same number of rows
            self.splits = counts.tolist() if isinstance(counts, torch.Tensor) else [counts] * experts
            self.rows = sum(self.splits)

    def output(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[N, out]: each row times its expert's weight transposed."""
        if self.grouped:
            return torch._grouped_mm(x, weight.transpose(1, 2), offs=self.offsets)
        return self._rows(x, lambda e: weight[e].t(), weight.shape[1])

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[N, in]: each row's output gradient times its expert's weight."""
        if self.grouped:
            return torch._grouped_mm(grad, weight, offs=self.offsets)
        return self._rows(grad, lambda e: weight[e], weight.shape[2])

    @torch.no_grad()  # BW runs it outside the backward, on tensors of the graph
    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[E, out, in]: per expert, its rows' output gradients transposed times their inputs."""
        if self.grouped:
            return torch._grouped_mm(grad.t(), x, offs=self.offsets)
        out = x.new_empty(len(self.splits), grad.shape[1], x.shape[1])
        for e, (g, part) in enumerate(zip(grad[:self.rows].split(self.splits), x[:self.rows].split(self.splits))):
            torch.mm(g.t(), part, out=out[e])
        return out

    @torch.no_grad()
    def accumulate_weight_grad(self, grad: torch.Tensor, x: torch.Tensor, main_grad: torch.Tensor) -> None:
        """``main_grad`` [E, out, in] += ``weight_grad(grad, x)``, each expert's block in place in the loop."""
        if self.grouped:
            main_grad.add_(self.weight_grad(grad, x))
            return
        for e, (g, part) in enumerate(zip(grad[:self.rows].split(self.splits), x[:self.rows].split(self.splits))):
            accumulate_product(main_grad[e], g.t(), part)

    @torch.no_grad()
    def _rows(self, rows: torch.Tensor, matrix, width: int) -> torch.Tensor:
        """[N, width]: each expert's run of ``rows`` times ``matrix(e)``, written in place (no concatenation)."""
        out = rows.new_empty(rows.shape[0], width)
        start = 0
        for e, count in enumerate(self.splits):
            torch.mm(rows[start:start + count], matrix(e), out=out[start:start + count])
            start += count
        return out


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, products: _Products):
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # whose gradient it is: under saved-tensor hooks the saved one comes back a copy
        ctx.products = products
        return products.output(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        products: _Products = ctx.products
        needs_x, needs_weight, _ = ctx.needs_input_grad
        grad = grad.contiguous()
        grad_x = products.input_grad(grad, weight) if needs_x else None
        grad_weight: Optional[torch.Tensor] = None
        if needs_weight:
            grad_weight = weight_gradient(ctx.weight, WeightGradient(
                lambda: products.weight_grad(grad, x),
                lambda main_grad: products.accumulate_weight_grad(grad, x, main_grad)))
        return grad_x, grad_weight, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: Counts, grouped: bool) -> torch.Tensor:
    """Rows of ``x`` [N, in] sorted by expert (``counts`` [E] rows each, or as an int the same number for every
    expert) times their expert's ``weight`` [E, out, in] transposed: [N, out]; ``grouped`` asks for one
    ``torch._grouped_mm`` where it runs."""
    products = _Products(x, weight, counts, grouped)
    if not torch.is_grad_enabled():
        return products.output(x, weight)
    return _GroupedLinear.apply(x, weight, products)
