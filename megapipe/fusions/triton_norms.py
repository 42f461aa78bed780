"""Triton LayerNorm and RMSNorm, forward and backward, over the last dimension.

One program normalizes one row in fp32 and saves the row's mean and 1/std. The backward pass
gives each program a block of rows and writes its fp32 partial weight and bias gradients,
summed afterwards (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 16


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
def _norm_bwd(g_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, n_cols,
              RMS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        live = cols < tl.where(row < n_rows, n_cols, 0)  # the row's columns, none past the last row
        base = row.to(tl.int64) * n_cols
        x = tl.load(x_ptr + base + cols, mask=live, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + base + cols, mask=live, other=0.0).to(tl.float32)
        stats_row = tl.minimum(row, n_rows - 1)  # rows past the end load zeros and add nothing
        rstd = tl.load(rstd_ptr + stats_row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(live, (x - tl.load(mean_ptr + stats_row)) * rstd, 0.0)
        wg = g * w
        dx = wg - xhat * (tl.sum(xhat * wg, axis=0) / n_cols)
        if not RMS:
            dx -= tl.sum(wg, axis=0) / n_cols
        tl.store(dx_ptr + base + cols, (dx * rstd).to(dx_ptr.dtype.element_ty), mask=live)
        dw += g * xhat
        db += g
    tl.store(dw_ptr + tl.program_id(0) * n_cols + cols, dw, mask=inside)
    if not RMS:
        tl.store(db_ptr + tl.program_id(0) * n_cols + cols, db, mask=inside)


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
        programs = triton.cdiv(n_rows, ROWS_PER_PROGRAM)
        dx = torch.empty_like(x)
        dw = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
        db = torch.empty_like(dw)
        _norm_bwd[(programs,)](grad.contiguous(), x, weight, mean, rstd, dx, dw, db, n_rows, n_cols,
                               RMS=ctx.rms, ROWS=ROWS_PER_PROGRAM, BLOCK=triton.next_power_of_2(n_cols))
        grad_bias = None if ctx.rms else db.sum(0).to(ctx.bias_dtype).view(weight.shape)
        return dx, dw.sum(0).to(weight.dtype).view(weight.shape), grad_bias, None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return _TritonNorm.apply(x, weight, bias, eps, False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _TritonNorm.apply(x, weight, None, eps, True)
