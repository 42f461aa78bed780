"""Triton kernels for scale + mask + softmax over [b, heads, sq, sk] scores, one program per row.

The general mask is read through its broadcast strides (a [b, 1, 1, sk] padding mask is never
expanded in memory); the causal mask is computed from the row's query index. Semantics are
those of ``megapipe.fusions.softmax``: fp32 accumulation, masked keys at 0, fully masked rows
all zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_fwd(s_ptr, m_ptr, out_ptr, scale, n_heads, sq, sk, m_sb, m_sh, m_sq, m_sk,
                 HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    query = row % sq
    head = (row // sq) % n_heads
    batch = row // (sq * n_heads)
    cols = tl.arange(0, BLOCK)
    inside = cols < sk
    base = row.to(tl.int64) * sk
    x = tl.load(s_ptr + base + cols, mask=inside, other=0.0).to(tl.float32) * scale
    masked = cols >= sk
    if HAS_MASK:
        where = batch.to(tl.int64) * m_sb + head * m_sh + query * m_sq + cols * m_sk
        masked = masked | (tl.load(m_ptr + where, mask=inside, other=1) != 0)
    if CAUSAL:
        masked = masked | (cols > query)
    x = tl.where(masked, float("-inf"), x)
    row_max = tl.max(x, axis=0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # fully masked: exp() gives zeros
    e = tl.exp(x - row_max)
    total = tl.sum(e, axis=0)
    probs = e / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + base + cols, probs.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _softmax_bwd(g_ptr, p_ptr, dx_ptr, scale, sk, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    inside = cols < sk
    base = tl.program_id(0).to(tl.int64) * sk
    p = tl.load(p_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
    dx = scale * p * (g - tl.sum(p * g, axis=0))
    tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)


def softmax_forward(scores: torch.Tensor, scale: float, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    b, heads, sq, sk = scores.shape
    probs = torch.empty_like(scores)
    if mask is None:
        mask_view, strides = scores, (0, 0, 0, 0)
    else:  # same element size, so a uint8 view of the broadcast (zero-stride) mask is free
        mask_view = mask.expand(scores.shape).view(torch.uint8)
        strides = mask_view.stride()
    _softmax_fwd[(b * heads * sq,)](scores, mask_view, probs, scale, heads, sq, sk, *strides,
                                    HAS_MASK=mask is not None, CAUSAL=causal, BLOCK=triton.next_power_of_2(sk))
    return probs


def softmax_backward(grad: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    sk = probs.shape[-1]
    dx = torch.empty_like(probs)
    _softmax_bwd[(probs.numel() // sk,)](grad, probs, dx, scale, sk, BLOCK=triton.next_power_of_2(sk))
    return dx
