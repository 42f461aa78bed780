"""Triton kernels for vocabulary-parallel cross-entropy: one read of the logits forward, one backward.

One program per row walks this rank's vocabulary slice in blocks. Forward keeps an online softmax
(running max, sum of exponentials rescaled whenever the max grows) in fp32 registers and writes three
fp32 numbers per row: the slice's max, its sum of ``exp(z - max)`` and the target's logit (0 where
another rank holds the target). Backward recomputes ``exp(z - M) / S`` from the all-reduced max ``M``
and sum ``S``, subtracts the one-hot target and scales by the row's loss gradient, storing in the
output's dtype (the logits' own buffer when the caller allows it). No [rows, vocabulary] fp32 buffer
exists. Columns at -inf (the padded vocabulary) weigh nothing; a row whose slice is all padding has
max -inf and sum 0. Semantics are those of ``megapipe.fusions.fused_cross_entropy``'s chunked path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # vocabulary columns per step of a row's loop


@triton.jit
def _cross_entropy_fwd(z_ptr, target_ptr, stats_ptr, n_rows, n_cols, row_stride, vocab_start,
                       BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * row_stride
    running_max = tl.full([], -float("inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    for block in range(BLOCKS):
        cols = block * BLOCK + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # a block of padding only: nothing to add
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(z - shift), axis=0)
        running_max = new_max
    index = tl.load(target_ptr + row) - vocab_start
    in_shard = (index >= 0) & (index < n_cols)
    picked = tl.load(base + index, mask=in_shard, other=0.0).to(tl.float32)
    tl.store(stats_ptr + row, running_max)
    tl.store(stats_ptr + n_rows + row, running_sum)
    tl.store(stats_ptr + 2 * n_rows + row, picked)


@triton.jit
def _cross_entropy_bwd(z_ptr, out_ptr, target_ptr, max_ptr, sum_ptr, grad_ptr, n_cols, row_stride, out_stride,
                       vocab_start, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * row_stride
    out = out_ptr + row.to(tl.int64) * out_stride
    logits_max = tl.load(max_ptr + row)
    sum_exp = tl.load(sum_ptr + row)
    grad = tl.load(grad_ptr + row)
    index = tl.load(target_ptr + row) - vocab_start  # outside [0, n_cols) on the ranks without the target
    for block in range(BLOCKS):
        cols = block * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        z = tl.load(base + cols, mask=inside, other=-float("inf")).to(tl.float32)
        softmax = tl.exp(z - logits_max) / sum_exp
        softmax = tl.where(cols == index, softmax - 1.0, softmax)
        tl.store(out + cols, (softmax * grad).to(out_ptr.dtype.element_ty), mask=inside)


def _launch_shape(n_cols: int) -> dict:
    """The block and its count as constants (a loop bound given at run time is not interpretable)."""
    block = min(MAX_BLOCK, triton.next_power_of_2(n_cols))
    return dict(BLOCK=block, BLOCKS=triton.cdiv(n_cols, block), num_warps=8 if block >= 2048 else 4)


def row_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """fp32 [3, rows]: each row's max over this slice, sum of ``exp(z - max)``, and target logit (or 0)."""
    rows, cols = logits.shape
    stats = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    _cross_entropy_fwd[(rows,)](logits, target, stats, rows, cols, logits.stride(0), vocab_start,
                                **_launch_shape(cols))
    return stats


def softmax_gradient(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, logits_max: torch.Tensor,
                     sum_exp: torch.Tensor, grad_loss: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``(exp(z - max) / sum_exp - onehot(target)) * grad_loss`` into ``out`` (may be ``logits``)."""
    rows, cols = logits.shape
    _cross_entropy_bwd[(rows,)](logits, out, target, logits_max, sum_exp, grad_loss, cols, logits.stride(0),
                                out.stride(0), vocab_start, **_launch_shape(cols))
    return out
