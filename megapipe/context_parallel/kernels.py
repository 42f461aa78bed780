"""Attention of one block with its log-sum-exp, through PyTorch's fused kernels: the one module that
knows their operator names.

Context-parallel attention combines blocks exactly only with each block's log-sum-exp (lse) per
query row, which ``F.scaled_dot_product_attention`` does not return; the aten operators behind it
do: on CPU ``_scaled_dot_product_flash_attention_for_cpu`` (an additive mask of the query's dtype),
on CUDA ``_scaled_dot_product_flash_attention`` where no mask is needed (fp16/bf16) and
``_scaled_dot_product_efficient_attention`` otherwise (additive bias, lse padded to 32 rows).
Their backward operators take the output and lse of the *whole* attention, so a block's backward
needs nothing stored from its forward. The signatures used here are the same on torch 2.11 and 2.13.

``allowed``: bool, broadcastable to [b, heads, sq, sk], True where a query may attend to a key. A
row with no allowed key gets output 0 and lse -inf (the kernels would give NaN or a made-up
lse): the kernel runs it unmasked and the result is overwritten. In the backward pass such a row,
and a row whose whole-attention lse is -inf, is given lse = +inf, so that its probabilities
exp(s - lse) are 0 and it adds nothing to any gradient.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
_LSE_ROWS = 32  # the memory-efficient CUDA kernel pads its lse to a multiple of this many rows
_BIAS_ALIGN = 16  # ... and wants its bias's rows padded to a multiple of this many columns


def _rows_allowed(allowed: torch.Tensor | None) -> torch.Tensor | None:
    return None if allowed is None else allowed.any(dim=-1)


def _bias(allowed: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Additive mask of ``like``'s dtype; fully masked rows attend everywhere (overwritten later)."""
    keep = allowed | ~rows.unsqueeze(-1)
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(keep.shape).masked_fill(~keep, float("-inf"))


def _cuda_bias(bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The bias laid out as the memory-efficient kernel requires: full shape, aligned rows."""
    sk = k.size(-2)
    padded = -(-sk // _BIAS_ALIGN) * _BIAS_ALIGN
    full = bias.new_zeros(*bias.shape[:-1], padded)
    full[..., :sk] = bias
    return full[..., :sk].expand(q.size(0), q.size(1), q.size(2), sk)


def _flash_on_cuda(q: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return bias is None and q.dtype in (torch.float16, torch.bfloat16)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, allowed: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, sq, d] in q's dtype, lse [b, h, sq] fp32) of q over (k, v); q, k, v have the same
    heads. ``causal``: the kernel's own top-left causal mask (only for sq == sk on the same tokens)."""
    rows = _rows_allowed(allowed)
    bias = None if allowed is None else _bias(allowed, rows, q)
    if q.device.type != "cuda":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                     scale=scale)
    elif _flash_on_cuda(q, bias):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        cuda_bias = None if bias is None else _cuda_bias(bias, q, k)
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, cuda_bias, True, 0.0, causal,
                                                                scale=scale)[:2]
        lse = lse[..., :q.size(2)]
    lse = lse.float()
    if rows is not None:
        out = out.masked_fill(~rows.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(~rows, float("-inf"))
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, *, causal: bool, allowed: torch.Tensor | None,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this block, from the whole attention's ``out`` and ``lse`` for these queries."""
    rows = _rows_allowed(allowed)
    silent = lse == float("-inf") if rows is None else (lse == float("-inf")) | ~rows
    lse = lse.masked_fill(silent, float("inf")).contiguous()
    bias = None if allowed is None else _bias(allowed, rows, q)
    if q.device.type != "cuda":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # read only under dropout, which is refused
    if _flash_on_cuda(q, bias):
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, causal, no_rng, no_rng, scale=scale)
    padded = -(-q.size(2) // _LSE_ROWS) * _LSE_ROWS
    lse = torch.nn.functional.pad(lse, (0, padded - q.size(2)))
    cuda_bias = None if bias is None else _cuda_bias(bias, q, k)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, cuda_bias, out, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv
