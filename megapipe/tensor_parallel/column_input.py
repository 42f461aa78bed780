"""How a column-parallel product's input enters the tensor-parallel region, with its communication
behind the backward's matrix products.

Seed 002's ``f`` (identity forward, all-reduce of the input gradient backward), or with sequence
parallelism the all-gather along the sequence (reduce-scatter of the input gradient backward), run as
separate autograd functions leave every collective on the critical path: the input gradient's
reduction waits until the linear's backward has computed its weight gradient too, and the gathered
input is kept for that weight gradient, so sequence parallelism saves no memory on the QKV and fc1
inputs. Fused into the linear's backward (Megatron-LM's asynchronous all-reduce), the order becomes:

1. with sequence parallelism, start re-gathering the input (only this rank's slice was kept), unless
   it started earlier: when the gradient of the layer's next row-parallel product's output arrived
   (``regather_early``: fc1's input behind fc2's backward, QKV's behind the dense projection's and the
   attention's), so that it travels behind much more compute;
2. compute the input gradient; wait for the gather;
3. start reducing the input gradient (all-reduce, or reduce-scatter along the sequence), in place;
4. compute the weight gradient (or record it for a zero-bubble BW) while the reduction travels;
5. wait for the reduction.

Every product and every sum is the one the separate functions compute, in the same order: the numbers
are the same bit for bit. ``--no-async-tensor-model-parallel-allreduce`` runs the separate functions
instead (for comparisons), and so do code paths with no backward to overlap (evaluation, generation)
and code torch.compile traces, whose backward computes every gradient at once.

The input is ``[tokens, features]`` rows whose leading dimension is the sequence's (``[s, b, h]`` viewed
as rows keeps ``s`` outermost), so gathering rows is gathering the sequence.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megapipe.parallel.collectives import all_gather_into, all_reduce, group_size, reduce_scatter_into
from megapipe.parallel.progress import collective
from megapipe.tensor_parallel.collective_matmul import gathered_product
from megapipe.tensor_parallel import mappings

_overlap = True


def overlap_tensor_parallel_communication(on: bool) -> None:
    """Chosen once per run (``--no-async-tensor-model-parallel-allreduce`` turns it off)."""
    global _overlap
    _overlap = on


def overlaps(size: int) -> bool:
    """Whether a product over a tensor-parallel group of ``size`` runs its communication fused with it (the
    overlap on, a backward to come, not traced by torch.compile)."""
    return size > 1 and _overlap and torch.is_grad_enabled() and not torch.compiler.is_compiling()


def backward_products(ctx, rows, input_gradient, weight_gradient):
    """A linear's (input gradient, weight gradient) from its backward's two products: with its column
    input's collectives behind them (``ColumnInput.backward``), or, without one, one after the other."""
    if ctx.column_input is not None:
        regathered, ctx.regathered = getattr(ctx, "regathered", None), None  # freed with the backward, not the graph
        return ctx.column_input.backward(rows, input_gradient, weight_gradient, regathered)
    return (input_gradient() if input_gradient is not None else None), weight_gradient(rows)


class ColumnInput:
    """The tensor-parallel group a column-parallel product's input enters, and whether it comes split
    along the sequence."""

    def __init__(self, group, sequence_parallel: bool):
        self.group, self.sequence_parallel = group, sequence_parallel
        self.size = group_size(group)
        self._last = None  # the autograd node of this product's latest fused forward under sequence parallelism

    def remember(self, node) -> None:
        """``node``: the fused product just run (its saved rows are what ``regather_early`` gathers)."""
        if self.sequence_parallel:
            self._last = node

    def regather_early(self, y: torch.Tensor) -> None:
        """When the gradient of ``y`` (the output of the layer's row-parallel product that follows this one in
        the forward) arrives, start re-gathering the input of this product's latest forward: the gather then
        travels behind the row-parallel product's backward and everything between the two, not only behind
        the input-gradient product (module docstring)."""
        node, self._last = self._last, None
        if node is not None and y.requires_grad:
            def start(grad: torch.Tensor) -> None:  # the gradient itself passes unchanged
                self._prefetch(node)

            y.register_hook(start)

    def _prefetch(self, node) -> None:
        if getattr(node, "regathered", None) is None:
            node.regathered = self._start_gather(node.saved_tensors[0])

    def fused(self) -> bool:
        """Whether the product runs the communication inside its backward (module docstring)."""
        return overlaps(self.size)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input through the separate autograd functions (when not ``fused``)."""
        if self.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(x, self.group)
        return mappings.copy_to_tensor_parallel_region(x, self.group)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The forward's whole input: the sequence's rows of every rank, or ``rows`` itself."""
        if not self.sequence_parallel:
            return rows
        full, work = self._start_gather(rows)
        _finish(work, "all_gather", self.group)
        return full

    def linear(self, rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``F.linear`` of the forward's whole input (``gather``): with sequence parallelism a collective
        matmul, the rows' transfers behind the products (``collective_matmul.gathered_product``)."""
        if not self.sequence_parallel:
            return F.linear(rows, weight, bias)
        return gathered_product(rows, weight, bias, self.group)

    def backward(self, rows: torch.Tensor, input_gradient: Optional[Callable[[], torch.Tensor]],
                 weight_gradient: Callable[[torch.Tensor], Optional[torch.Tensor]], regathered=None):
        """(this rank's input gradient, what ``weight_gradient`` returned), the collectives behind the
        products (module docstring). ``rows`` is what the forward kept: this rank's slice with sequence
        parallelism, else the whole input; ``input_gradient`` is None when no input gradient is needed;
        ``regathered``: the gather ``regather_early`` started, if it did."""
        full, gathering = (regathered or self._start_gather(rows)) if self.sequence_parallel else (rows, None)
        grad = input_gradient() if input_gradient is not None else None
        _finish(gathering, "all_gather", self.group)
        reduced, reducing = self._start_reduce(grad) if grad is not None else (None, None)
        result = weight_gradient(full)
        _finish(reducing, "reduce_scatter" if self.sequence_parallel else "all_reduce", self.group)
        return reduced, result

    def _start_gather(self, rows: torch.Tensor):
        full = torch.empty((rows.shape[0] * self.size, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        return full, all_gather_into(full, rows.contiguous(), self.group, async_op=True)

    def _start_reduce(self, grad: torch.Tensor):
        if not self.sequence_parallel:  # the product's own output: reduced where it is, no copy
            return grad, all_reduce(grad, self.group, self.size, async_op=True)
        if grad.shape[0] % self.size:
            raise ValueError(f"sequence length {grad.shape[0]} is not divisible by the tensor-parallel size "
                             f"{self.size}")
        out = torch.empty((grad.shape[0] // self.size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        return out, reduce_scatter_into(out, grad, self.group, async_op=True)


def _finish(work, name: str, group) -> None:
    """Wait for an asynchronous collective, as a blocking one is waited for (``progress.collective``,
    not counted again: it was counted when issued)."""
    if work is None:
        return
    with collective(name, group, counted=False):
        work.wait()

