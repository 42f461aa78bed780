"""Triton kernels for bias + GeLU, bias + dropout + residual add and bias + SwiGLU.

Imported only when triton is importable. The ops tile the input as [rows, h] (h = the bias
dimension; SwiGLU's tiles hold (gate, up) pairs) and compute in fp32, rounding once on store. Each
backward program runs over consecutive row tiles of one column block and adds the bias gradient
of its rows into fp32 registers while it writes the input gradient, so the bias gradient costs no
second read of the [tokens, h] gradient (``triton_column_sums``: deterministic, no atomics).
Dropout draws Philox numbers from a seed taken from the default generator of the tensor's device
and the flat element index, and the backward pass recomputes the mask from the same seed instead
of storing it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapipe.fusions.bias_math import keep_scale, output_dtype
from megapipe.fusions.triton_column_sums import column_sums, programs_at_once, split_rows, store_partial

BACKWARD_PROGRAMS_PER_MULTIPROCESSOR = 8


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
def _columns(BLOCK_C: tl.constexpr):
    return tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)


@triton.jit
def _tile(row_tile, cols, n_rows, n_cols, BLOCK_R: tl.constexpr):
    """Offsets and mask of row tile ``row_tile`` of a [n_rows, n_cols] tensor, over columns ``cols``."""
    rows = row_tile.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows[:, None] * n_cols + cols[None, :], inside


@triton.jit
def _load_plus_bias(x_ptr, b_ptr, offsets, cols, inside, n_cols, HAS_BIAS: tl.constexpr):
    y = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _bias_gelu_fwd(x_ptr, b_ptr, out_ptr, n_rows, n_cols, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = _columns(BLOCK_C)
    offsets, inside = _tile(tl.program_id(0), cols, n_rows, n_cols, BLOCK_R)
    y = _load_plus_bias(x_ptr, b_ptr, offsets, cols, inside, n_cols, HAS_BIAS)
    tl.store(out_ptr + offsets, _gelu(y, TANH).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _bias_gelu_bwd(g_ptr, x_ptr, b_ptr, dx_ptr, partial_ptr, n_rows, n_cols, HAS_BIAS: tl.constexpr,
                   TANH: tl.constexpr, TILES_EACH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = _columns(BLOCK_C)
    column_sum = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for i in range(TILES_EACH):
        offsets, inside = _tile(tl.program_id(0) * TILES_EACH + i, cols, n_rows, n_cols, BLOCK_R)
        y = _load_plus_bias(x_ptr, b_ptr, offsets, cols, inside, n_cols, HAS_BIAS)
        grad = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32) * _gelu_slope(y, TANH)
        tl.store(dx_ptr + offsets, grad.to(dx_ptr.dtype.element_ty), mask=inside)
        column_sum += grad
    if HAS_BIAS:
        store_partial(partial_ptr, tl.sum(column_sum, axis=0), cols, n_cols)


@triton.jit
def _bias_dropout_add_fwd(x_ptr, b_ptr, r_ptr, out_ptr, seed_ptr, n_rows, n_cols, p, scale,
                          HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    cols = _columns(BLOCK_C)
    offsets, inside = _tile(tl.program_id(0), cols, n_rows, n_cols, BLOCK_R)
    y = _load_plus_bias(x_ptr, b_ptr, offsets, cols, inside, n_cols, HAS_BIAS)
    if DROPOUT:
        keep = tl.rand(tl.load(seed_ptr), offsets) >= p
        y = tl.where(keep, y * scale, 0.0)
    out = tl.load(r_ptr + offsets, mask=inside, other=0.0).to(tl.float32) + y
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _dropout_bwd(g_ptr, dx_ptr, partial_ptr, seed_ptr, n_rows, n_cols, p, scale, HAS_BIAS: tl.constexpr,
                 DROPOUT: tl.constexpr, TILES_EACH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = _columns(BLOCK_C)
    column_sum = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for i in range(TILES_EACH):
        offsets, inside = _tile(tl.program_id(0) * TILES_EACH + i, cols, n_rows, n_cols, BLOCK_R)
        grad = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        if DROPOUT:
            keep = tl.rand(tl.load(seed_ptr), offsets) >= p
            grad = tl.where(keep, grad * scale, 0.0)
        tl.store(dx_ptr + offsets, grad.to(dx_ptr.dtype.element_ty), mask=inside)
        column_sum += grad
    if HAS_BIAS:
        store_partial(partial_ptr, tl.sum(column_sum, axis=0), cols, n_cols)


@triton.jit
def _pair_offsets(offsets, inside):
    """Offsets and mask in a [rows, 2 n] tensor of (gate, up) pairs for a [rows, n] tile's offsets:
    a [BLOCK_R, BLOCK_C, 2] tile, gate then up."""
    halves = tl.arange(0, 2)[None, None, :]
    return 2 * offsets[:, :, None] + halves, inside[:, :, None] & (halves < 2)  # the mask spread over both


@triton.jit
def _load_pairs(x_ptr, b_ptr, offsets, inside, pairs, n_pairs, HAS_BIAS: tl.constexpr):
    """(gate, up) of a tile of pairs in fp32, the bias (interleaved like x) added."""
    pair_offsets, pair_inside = _pair_offsets(offsets, inside)
    xy = tl.load(x_ptr + pair_offsets, mask=pair_inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias_cols = 2 * pairs[:, None] + tl.arange(0, 2)[None, :]
        xy += tl.load(b_ptr + bias_cols, mask=bias_cols < 2 * n_pairs, other=0.0).to(tl.float32)[None, :, :]
    return tl.split(xy)


@triton.jit
def _swiglu_fwd(x_ptr, b_ptr, out_ptr, n_rows, n_pairs, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr):
    pairs = _columns(BLOCK_C)
    offsets, inside = _tile(tl.program_id(0), pairs, n_rows, n_pairs, BLOCK_R)
    gate, up = _load_pairs(x_ptr, b_ptr, offsets, inside, pairs, n_pairs, HAS_BIAS)
    tl.store(out_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _swiglu_bwd(g_ptr, x_ptr, b_ptr, dx_ptr, partial_ptr, n_rows, n_pairs, HAS_BIAS: tl.constexpr,
                TILES_EACH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pairs = _columns(BLOCK_C)
    column_sum = tl.zeros([BLOCK_R, BLOCK_C, 2], dtype=tl.float32)
    for i in range(TILES_EACH):
        offsets, inside = _tile(tl.program_id(0) * TILES_EACH + i, pairs, n_rows, n_pairs, BLOCK_R)
        gate, up = _load_pairs(x_ptr, b_ptr, offsets, inside, pairs, n_pairs, HAS_BIAS)
        g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        grad = tl.join(g * up * sig * (1.0 + gate * (1.0 - sig)), g * gate * sig)
        pair_offsets, pair_inside = _pair_offsets(offsets, inside)
        tl.store(dx_ptr + pair_offsets, grad.to(dx_ptr.dtype.element_ty), mask=pair_inside)
        column_sum += grad
    if HAS_BIAS:
        store_partial(partial_ptr, tl.sum(column_sum, axis=0), 2 * pairs[:, None] + tl.arange(0, 2)[None, :],
                      2 * n_pairs)


def _launch(x: torch.Tensor, n_cols: int, backward: bool = False, elements: int = 4096):
    """(rows, grid, block sizes) for tiles of about ``elements`` of [rows, n_cols] (x contiguous, rows =
    its leading dimensions). Backward kernels run each program over ``TILES_EACH`` consecutive row
    tiles, about ``BACKWARD_PROGRAMS_PER_MULTIPROCESSOR`` programs on each multiprocessor."""
    n_rows = x.numel() // max(x.shape[-1], 1)
    block_c = min(triton.next_power_of_2(n_cols), 256)
    block_r = max(elements // block_c, 1)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    blocks = dict(BLOCK_R=block_r, BLOCK_C=block_c)
    if backward:
        wanted = triton.cdiv(programs_at_once(x.device, BACKWARD_PROGRAMS_PER_MULTIPROCESSOR), grid[1])
        row_programs, blocks["TILES_EACH"] = split_rows(grid[0], wanted)
        grid = (row_programs, grid[1])
    return n_rows, grid, blocks


def _bias_partials(bias, grid, n_cols, like):
    if bias is None:
        return like  # unused by the kernel; any pointer will do
    return torch.empty(grid[0], n_cols, dtype=torch.float32, device=like.device)


def _bias_grad(partials, bias):
    return None if bias is None else column_sums(partials, bias.shape, bias.dtype)[0]


def bias_gelu_forward(x, bias, approximate):
    out = torch.empty_like(x)
    n_rows, grid, blocks = _launch(x, x.shape[-1])
    _bias_gelu_fwd[grid](x, x if bias is None else bias, out, n_rows, x.shape[-1], HAS_BIAS=bias is not None,
                         TANH=approximate == "tanh", **blocks)
    return out


def bias_gelu_backward(grad, x, bias, approximate):
    dx = torch.empty_like(x)
    n_rows, grid, blocks = _launch(x, x.shape[-1], backward=True)
    partials = _bias_partials(bias, grid, x.shape[-1], dx)
    _bias_gelu_bwd[grid](grad, x, x if bias is None else bias, dx, partials, n_rows, x.shape[-1],
                         HAS_BIAS=bias is not None, TANH=approximate == "tanh", **blocks)
    return dx, _bias_grad(partials, bias)


def bias_dropout_add_forward(x, bias, residual, p):
    """(output, seed tensor or None); the seed comes from the default generator of x's device."""
    out = torch.empty(x.shape, dtype=output_dtype(x, bias, residual), device=x.device)
    seed = torch.randint(0, 2**31 - 1, (1,), device=x.device) if p > 0 else None
    n_rows, grid, blocks = _launch(x, x.shape[-1])
    _bias_dropout_add_fwd[grid](x, x if bias is None else bias, residual, out, x if seed is None else seed,
                                n_rows, x.shape[-1], p, keep_scale(p), HAS_BIAS=bias is not None, DROPOUT=p > 0,
                                **blocks)
    return out, seed


def bias_dropout_add_backward(grad, seed, bias, p, x_dtype):
    dx = torch.empty(grad.shape, dtype=x_dtype, device=grad.device)
    n_rows, grid, blocks = _launch(grad, grad.shape[-1], backward=True)
    partials = _bias_partials(bias, grid, grad.shape[-1], dx)
    _dropout_bwd[grid](grad, dx, partials, grad if seed is None else seed, n_rows, grad.shape[-1], p, keep_scale(p),
                       HAS_BIAS=bias is not None, DROPOUT=p > 0, **blocks)
    return dx, _bias_grad(partials, bias)


def swiglu_forward(x, bias):
    """SiLU(gate) * up of ``x + bias``, x = [..., (gate, up) x f]; the result is [..., f] in x's dtype."""
    n_pairs = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], n_pairs, dtype=x.dtype, device=x.device)
    n_rows, grid, blocks = _launch(x, n_pairs, elements=2048)  # tiles of 2048 pairs
    _swiglu_fwd[grid](x, x if bias is None else bias, out, n_rows, n_pairs, HAS_BIAS=bias is not None, **blocks)
    return out


def swiglu_backward(grad, x, bias):
    dx = torch.empty_like(x)
    n_pairs = x.shape[-1] // 2
    n_rows, grid, blocks = _launch(x, n_pairs, backward=True, elements=2048)
    partials = _bias_partials(bias, grid, x.shape[-1], dx)
    _swiglu_bwd[grid](grad, x, x if bias is None else bias, dx, partials, n_rows, n_pairs,
                      HAS_BIAS=bias is not None, **blocks)
    return dx, _bias_grad(partials, bias)
