"""Column sums (bias and norm-weight gradients) computed by the backward kernel that reads the gradient.

A backward kernel that also owes a parameter gradient summed over tokens gives each program a run
of consecutive row tiles: the program adds its tiles into an fp32 accumulator in registers while it
writes the input gradient, and stores one partial row into a [programs, columns] fp32 buffer.
``column_sums`` then adds the partial rows in one small kernel and rounds once to the parameter's
dtype. The [tokens, features] gradient is read once, the order of the additions is fixed
(deterministic, no atomics), and the partial buffer has about as many rows as the GPU runs programs
at once, not one row per tile.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Triton's interpreter (CPU tensors) has no multiprocessors: a few programs, so that the partial
# sums of several programs, and a last program with fewer rows, are what the CPU tests check.
INTERPRETED_PROGRAMS = 4


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_at_once(device: torch.device, per_multiprocessor: int) -> int:
    """How many programs fill ``device``: ``per_multiprocessor`` on each of its multiprocessors."""
    if device.type != "cuda":
        return INTERPRETED_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessors(index) * per_multiprocessor


def split_rows(n_row_tiles: int, programs: int) -> tuple[int, int]:
    """(programs, row tiles per program): runs of consecutive row tiles, at most ``programs`` runs,
    none empty (one, writing zeros, when there are no rows).

    The run length is a power of two because the kernels take it as a compile-time constant (Triton's
    interpreter under NumPy 2.4 cannot run a loop of a run-time length), so that few lengths compile.
    """
    n_row_tiles = max(n_row_tiles, 1)
    each = triton.next_power_of_2(triton.cdiv(n_row_tiles, max(programs, 1)))
    return triton.cdiv(n_row_tiles, each), each


@triton.jit
def store_partial(partial_ptr, partial_sum, cols, n_cols):
    """This program's partial column sums into row ``program_id(0)`` of a [programs, n_cols] buffer."""
    tl.store(partial_ptr + tl.program_id(0) * n_cols + cols, partial_sum, mask=cols < n_cols)


@triton.jit
def _sum_partials(partial_ptr, first_ptr, second_ptr, n_partials, n_cols, n_first,
                  ROW_BLOCKS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    total = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for block in range(ROW_BLOCKS):
        rows = block * BLOCK_P + tl.arange(0, BLOCK_P)
        inside = (rows[:, None] < n_partials) & (cols[None, :] < n_cols)
        total += tl.load(partial_ptr + rows[:, None] * n_cols + cols[None, :], mask=inside, other=0.0)
    total = tl.sum(total, axis=0)
    tl.store(first_ptr + cols, total.to(first_ptr.dtype.element_ty), mask=cols < n_first)
    tl.store(second_ptr + (cols - n_first), total.to(second_ptr.dtype.element_ty),
             mask=(cols >= n_first) & (cols < n_cols))


def column_sums(partials: torch.Tensor, shape: torch.Size, *dtypes: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The column sums of fp32 ``partials`` [programs, k n], rounded once: k tensors of ``shape`` (n
    elements), the first n columns in ``dtypes[0]``, the next n (a LayerNorm's bias) in ``dtypes[1]``."""
    outputs = [torch.empty(shape, dtype=dtype, device=partials.device) for dtype in dtypes]
    n_partials, n_cols = partials.shape
    block_p, block_c = 32, 64  # 2048 partial sums a step, 64 columns a program
    _sum_partials[(triton.cdiv(n_cols, block_c),)](partials, outputs[0], outputs[-1], n_partials, n_cols,
                                                   outputs[0].numel(), ROW_BLOCKS=triton.cdiv(n_partials, block_p),
                                                   BLOCK_P=block_p, BLOCK_C=block_c)
    return tuple(outputs)
