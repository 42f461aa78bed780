"""Attention core ``softmax(scale * q k^T, masked) v`` on [b, heads, s, d] tensors.

Layout: q is [b, heads, sq, d], k and v are [b, heads, sk, d], the result is [b, heads, sq, d].
Grouped-query attention: k and v may have fewer heads (a divisor of q's, the query groups);
query head i then attends with key/value head i // (heads / groups). SDPA does this without
copying (``enable_gqa``); the explicit path repeats k and v.
A model that keeps activations as [s, b, h] (seed 002 section 4.4.2) gets this layout as a
view, ``x.view(s, b, heads, d).permute(1, 2, 0, 3)``, and returns with ``permute(2, 0, 1, 3)``.

Masks follow ``megapipe.fusions.softmax``: boolean, broadcastable to [b, heads, sq, sk],
True = masked out, optionally combined with the causal mask; fully masked query rows give
zeros. The fused path is ``F.scaled_dot_product_attention`` (flash or memory-efficient kernels
where the device has them); the explicit path is matmul, scale-mask-softmax, dropout, matmul.
They compute the same function.

Dropout draws from the default generator of q's device in both paths. Under tensor
parallelism each rank holds different heads, so the caller must run this inside the
model-parallel RNG region (the tensor-parallel RNG tracker's fork). On CPU, SDPA's dropout
draws exactly the mask ``F.dropout`` draws on the [b, heads, sq, sk] probabilities, so both
paths give the same result for the same seed; on CUDA the fused kernels draw differently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.fusions.softmax import check_mask, combined_mask, scale_mask_softmax


def _sdpa(q, k, v, mask, causal: bool, dropout_p: float, scale: float) -> torch.Tensor:
    gqa = k.size(1) != q.size(1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    masked = combined_mask(mask, causal, q.size(-2), k.size(-2), q.device)
    # Fully masked rows attend everywhere inside SDPA (finite on every kernel, no NaN in the
    # backward pass) and are zeroed afterwards, which also zeroes their gradients.
    fully_masked = masked.all(dim=-1, keepdim=True)
    allowed = ~masked | fully_masked
    if gqa and dropout_p == 0.0 and (allowed.dim() < 4 or allowed.size(1) == 1):
        out = _sdpa_folded(q, k, v, allowed, scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=gqa)
    return out.masked_fill(fully_masked, 0.0)


def _sdpa_folded(q, k, v, allowed, scale: float) -> torch.Tensor:
    """Grouped-query attention as ordinary attention over the groups: the n query heads of a
    group become n x sq query rows of that group's key/value head, the mask (the same for every
    head) repeated for each. The same rows are computed, with a plain kernel; with a mask,
    ``enable_gqa`` leaves SDPA's fast kernels for a slower path (a decode step took 1.6x as long
    on a CPU). Without dropout only: dropout would draw its mask in another order."""
    b, heads, sq, d = q.shape
    groups = k.size(1)
    n = heads // groups
    sk = k.size(2)
    rows = q.reshape(b, groups, n * sq, d)
    mask = allowed.expand(b, 1, sq, sk)
    if sq > 1:  # one decoded position needs no copy: its mask row broadcasts over the n rows
        mask = mask.unsqueeze(2).expand(b, 1, n, sq, sk).reshape(b, 1, n * sq, sk)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, sq, d)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              causal: bool = False, dropout_p: float = 0.0, training: bool = False, scale: float | None = None,
              softmax_in_fp32: bool = True, fused: bool = True, sdpa: bool = True) -> torch.Tensor:
    """Attention of q over (k, v); ``scale`` defaults to 1/sqrt(d), dropout only when ``training``.

    ``fused`` and ``sdpa``: scaled_dot_product_attention. ``fused`` without ``sdpa``: explicit
    attention with the fused scale-mask-softmax kernels (the paper's design). Not ``fused``
    (``--no-masked-softmax-fusion``): explicit attention of plain PyTorch ops.
    """
    check_mask((q.size(0), q.size(1), q.size(2), k.size(2)), mask)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    p = dropout_p if training else 0.0
    if fused and sdpa:
        return _sdpa(q, k, v, mask, causal, p, scale)
    if k.size(1) != q.size(1):
        groups = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1))
    probs = scale_mask_softmax(scores, scale, mask, causal, softmax_in_fp32, fused)
    if p > 0:
        probs = F.dropout(probs, p=p)
    return torch.matmul(probs, v)
