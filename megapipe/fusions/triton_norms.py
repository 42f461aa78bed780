"""Triton LayerNorm and RMSNorm, forward and backward, over the last dimension.

One program normalizes one row in fp32 and saves the row's mean and 1/std. The backward pass runs
about two programs per multiprocessor, each over a run of consecutive row tiles: it writes the input
gradient of each tile and adds the weight and bias gradients of its rows into fp32 registers, then
stores them as one partial row; one small kernel sums the partial rows (``triton_column_sums``:
deterministic, no atomics, x and the output gradient read once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapipe.fusions.triton_column_sums import column_sums, programs_at_once, split_rows

TILE_ELEMENTS = 4096  # a backward tile holds as many whole rows as fit in this many elements (at least one)
PROGRAMS_PER_MULTIPROCESSOR = 2


@triton.jit
def _norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps, RMS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    base = row.to(tl.int64) * n_cols
    x = tl.load(x_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
    if RMS:
        centered = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        centered = tl.where(inside, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    y = centered * rstd * tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if not RMS:
        y += tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _norm_bwd(g_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, partial_ptr, n_rows, n_cols,
              RMS: tl.constexpr, TILES_EACH: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    db = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for i in range(TILES_EACH):
        rows = (tl.program_id(0) * TILES_EACH + i) * ROWS + tl.arange(0, ROWS)
        live = rows < n_rows
        inside = live[:, None] & (cols[None, :] < n_cols)  # rows past the last load zeros and add nothing
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=live, other=0.0)[:, None]
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(inside, (x - tl.load(mean_ptr + rows, mask=live, other=0.0)[:, None]) * rstd, 0.0)
        wg = g * w[None, :]
        dx = wg - xhat * (tl.sum(xhat * wg, axis=1) / n_cols)[:, None]
        if not RMS:
            dx -= (tl.sum(wg, axis=1) / n_cols)[:, None]
        tl.store(dx_ptr + offsets, (dx * rstd).to(dx_ptr.dtype.element_ty), mask=inside)
        dw += g * xhat
        db += g
    # this program's partial row: [weight gradient | bias gradient] (RMSNorm: the weight gradient alone)
    partial_row = partial_ptr + tl.program_id(0) * (n_cols if RMS else 2 * n_cols) + cols
    tl.store(partial_row, tl.sum(dw, axis=0), mask=cols < n_cols)
    if not RMS:
        tl.store(partial_row + n_cols, tl.sum(db, axis=0), mask=cols < n_cols)


class _TritonNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        x = x.contiguous()
        n_cols = weight.numel()
        n_rows = x.numel() // n_cols
        y = torch.empty_like(x)
        mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        block = triton.next_power_of_2(n_cols)
        _norm_fwd[(n_rows,)](x, weight, weight if bias is None else bias, y, mean, rstd, n_cols, eps,
                             RMS=rms, BLOCK=block)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.rms, ctx.bias_dtype = rms, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved_tensors
        n_cols = weight.numel()
        n_rows = x.numel() // n_cols
        block = triton.next_power_of_2(n_cols)
        rows = max(TILE_ELEMENTS // block, 1)
        programs, tiles_each = split_rows(triton.cdiv(n_rows, rows),
                                          programs_at_once(x.device, PROGRAMS_PER_MULTIPROCESSOR))
        dx = torch.empty_like(x)
        partials = torch.empty(programs, n_cols * (1 if ctx.rms else 2), dtype=torch.float32, device=x.device)
        _norm_bwd[(programs,)](grad.contiguous(), x, weight, mean, rstd, dx, partials, n_rows, n_cols,
                               RMS=ctx.rms, TILES_EACH=tiles_each, ROWS=rows, BLOCK=block, num_warps=8)
        dtypes = (weight.dtype,) if ctx.rms else (weight.dtype, ctx.bias_dtype)
        param_grads = column_sums(partials, weight.shape, *dtypes)
        return dx, param_grads[0], None if ctx.rms else param_grads[1], None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return _TritonNorm.apply(x, weight, bias, eps, False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _TritonNorm.apply(x, weight, None, eps, True)
