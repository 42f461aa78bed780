"""The communication operators of tensor and sequence parallelism, as autograd functions.

Seed 002 section 4.2.3: ``f`` (identity forward, all-reduce backward) opens a
tensor-parallel region and ``g`` (all-reduce forward, identity backward) closes it; the
scatter/gather pairs split or rebuild the last dimension. The sequence-parallel siblings
work on dimension 0 of ``[s, b, h]`` activations: all-gather where Megatron's f would be,
reduce-scatter where g would be. Every operator is the identity when the group has one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megapipe.parallel.collectives import all_gather_into, all_reduce, group_size, reduce_scatter_into


def _all_reduce_copy(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over ``group`` in a new tensor: for a gradient, which autograd may have handed to
    another function too (an addition's backward passes one tensor to both operands)."""
    if group_size(group) == 1:
        return x
    out = x.clone()
    all_reduce(out, group)
    return out


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=0)[dist.get_rank(group)].contiguous()


def _gather_first(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    out = torch.empty((x.shape[0] * world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x.contiguous(), group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[0] % world:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {world}")
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, x.contiguous(), group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_copy(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: the partial results are summed where they are (a product's output, which no backward reads), no copy."""

    @staticmethod
    def forward(ctx, x, group):
        if group_size(group) > 1:
            all_reduce(x, group)
            ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather along the sequence; backward reduce-scatters when the consumer is tensor-parallel."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


def copy_to_tensor_parallel_region(x, group):
    """f: identity forward, all-reduce of the gradient backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    """g: all-reduce forward, identity backward."""
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x, group):
    """Keep this rank's slice of the last dimension; backward all-gathers."""
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x, group):
    """All-gather the last dimension; backward keeps this rank's slice."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    """Keep this rank's slice of the sequence (dim 0); backward all-gathers."""
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence_parallel_region(x, group, grad_is_partial: bool = True):
    """All-gather the sequence; backward reduce-scatters (the consumer was tensor-parallel) or splits."""
    return _GatherFromSequence.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """Sum partial results over the group and keep this rank's slice of the sequence."""
    return _ReduceScatterToSequence.apply(x, group)
