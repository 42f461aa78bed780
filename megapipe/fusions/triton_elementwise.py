"""Triton kernels for bias + GeLU and bias + dropout + residual add.

Imported only when triton is importable. Both ops tile the input as [rows, h] (h = the bias
dimension) and compute in fp32, rounding once on store. Backward kernels also write one fp32
partial bias gradient per row tile, summed afterwards, so the bias gradient is accumulated in
fp32 without atomics (deterministic). Dropout draws Philox numbers from a seed taken from the
default generator of the tensor's device and the flat element index, and the backward pass
recomputes the mask from the same seed instead of storing it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapipe.fusions.bias_math import keep_scale, output_dtype

@triton.jit
def _tanh(u):
    # From exp, accurate at both ends (no libdevice dependency, runs in the interpreter too).
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u >= 0, t, -t)


# Constants are written out (sqrt(2/pi) = 0.7978845608028654, 1/sqrt(2) = 0.7071067811865476,
# 1/sqrt(2*pi) = 0.3989422804014327, cubic term 0.044715): Triton's interpreter mishandles
# module-level constexpr factors passed on to nested jit functions.
@triton.jit
def _gelu(y, TANH: tl.constexpr):
    if TANH:
        out = 0.5 * y * (1.0 + _tanh(0.7978845608028654 * (y + 0.044715 * y * y * y)))
    else:
        out = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    return out


@triton.jit
def _gelu_slope(y, TANH: tl.constexpr):
    if TANH:
        t = _tanh(0.7978845608028654 * (y + 0.044715 * y * y * y))
        slope = 0.5 * (1.0 + t) + 0.5 * y * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * y * y)
    else:
        slope = 0.5 * (1.0 + tl.erf(y * 0.7071067811865476)) + y * tl.exp(-0.5 * y * y) * 0.3989422804014327
    return slope


@triton.jit
def _tile(n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows[:, None] * n_cols + cols[None, :], cols, inside


@triton.jit
def _load_plus_bias(x_ptr, b_ptr, offsets, cols, inside, n_cols, HAS_BIAS: tl.constexpr):
    y = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _store_bias_partial(partial_ptr, grad, cols, n_cols, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        tl.store(partial_ptr + tl.program_id(0) * n_cols + cols, tl.sum(grad, axis=0), mask=cols < n_cols)


@triton.jit
def _bias_gelu_fwd(x_ptr, b_ptr, out_ptr, n_rows, n_cols, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    offsets, cols, inside = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    y = _load_plus_bias(x_ptr, b_ptr, offsets, cols, inside, n_cols, HAS_BIAS)
    tl.store(out_ptr + offsets, _gelu(y, TANH).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _bias_gelu_bwd(g_ptr, x_ptr, b_ptr, dx_ptr, partial_ptr, n_rows, n_cols, HAS_BIAS: tl.constexpr,
                   TANH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    offsets, cols, inside = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    y = _load_plus_bias(x_ptr, b_ptr, offsets, cols, inside, n_cols, HAS_BIAS)
    grad = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32) * _gelu_slope(y, TANH)
    tl.store(dx_ptr + offsets, grad.to(dx_ptr.dtype.element_ty), mask=inside)
    _store_bias_partial(partial_ptr, grad, cols, n_cols, HAS_BIAS)


@triton.jit
def _bias_dropout_add_fwd(x_ptr, b_ptr, r_ptr, out_ptr, seed_ptr, n_rows, n_cols, p, scale,
                          HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    offsets, cols, inside = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    y = _load_plus_bias(x_ptr, b_ptr, offsets, cols, inside, n_cols, HAS_BIAS)
    if DROPOUT:
        keep = tl.rand(tl.load(seed_ptr), offsets) >= p
        y = tl.where(keep, y * scale, 0.0)
    out = tl.load(r_ptr + offsets, mask=inside, other=0.0).to(tl.float32) + y
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _dropout_bwd(g_ptr, dx_ptr, partial_ptr, seed_ptr, n_rows, n_cols, p, scale, HAS_BIAS: tl.constexpr,
                 DROPOUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    offsets, cols, inside = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    grad = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if DROPOUT:
        keep = tl.rand(tl.load(seed_ptr), offsets) >= p
        grad = tl.where(keep, grad * scale, 0.0)
    tl.store(dx_ptr + offsets, grad.to(dx_ptr.dtype.element_ty), mask=inside)
    _store_bias_partial(partial_ptr, grad, cols, n_cols, HAS_BIAS)


def _launch_shape(x: torch.Tensor):
    """(rows, cols, grid, block sizes) for a contiguous [..., h] tensor; tiles of about 4096 elements."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // max(n_cols, 1)
    block_c = min(triton.next_power_of_2(n_cols), 256)
    block_r = max(4096 // block_c, 1)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    return n_rows, n_cols, grid, block_r, block_c


def _bias_partials(bias, n_row_tiles, n_cols, like):
    if bias is None:
        return like  # unused by the kernel; any pointer will do
    return torch.empty(n_row_tiles, n_cols, dtype=torch.float32, device=like.device)


def _finish_bias_grad(partials, bias):
    return None if bias is None else partials.sum(0).to(bias.dtype).view(bias.shape)


def bias_gelu_forward(x, bias, approximate):
    out = torch.empty_like(x)
    n_rows, n_cols, grid, block_r, block_c = _launch_shape(x)
    _bias_gelu_fwd[grid](x, x if bias is None else bias, out, n_rows, n_cols, HAS_BIAS=bias is not None,
                         TANH=approximate == "tanh", BLOCK_R=block_r, BLOCK_C=block_c)
    return out


def bias_gelu_backward(grad, x, bias, approximate):
    dx = torch.empty_like(x)
    n_rows, n_cols, grid, block_r, block_c = _launch_shape(x)
    partials = _bias_partials(bias, grid[0], n_cols, dx)
    _bias_gelu_bwd[grid](grad, x, x if bias is None else bias, dx, partials, n_rows, n_cols,
                         HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK_R=block_r, BLOCK_C=block_c)
    return dx, _finish_bias_grad(partials, bias)


def bias_dropout_add_forward(x, bias, residual, p):
    """(output, seed tensor or None); the seed comes from the default generator of x's device."""
    out = torch.empty(x.shape, dtype=output_dtype(x, bias, residual), device=x.device)
    seed = torch.randint(0, 2**31 - 1, (1,), device=x.device) if p > 0 else None
    n_rows, n_cols, grid, block_r, block_c = _launch_shape(x)
    _bias_dropout_add_fwd[grid](x, x if bias is None else bias, residual, out, x if seed is None else seed,
                                n_rows, n_cols, p, keep_scale(p), HAS_BIAS=bias is not None, DROPOUT=p > 0,
                                BLOCK_R=block_r, BLOCK_C=block_c)
    return out, seed


def bias_dropout_add_backward(grad, seed, bias, p, x_dtype):
    dx = torch.empty(grad.shape, dtype=x_dtype, device=grad.device)
    n_rows, n_cols, grid, block_r, block_c = _launch_shape(grad)
    partials = _bias_partials(bias, grid[0], n_cols, dx)
    _dropout_bwd[grid](grad, dx, partials, grad if seed is None else seed, n_rows, n_cols, p, keep_scale(p),
                       HAS_BIAS=bias is not None, DROPOUT=p > 0, BLOCK_R=block_r, BLOCK_C=block_c)
    return dx, _finish_bias_grad(partials, bias)
