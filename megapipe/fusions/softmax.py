"""Fused scale + mask + softmax over attention scores [b, heads, sq, sk] (seed 002 section 4.4.2).

Two masks, as in the paper's two kernels: a general boolean mask (BERT padding; any shape that
broadcasts to [b, heads, sq, sk], True = masked out) and the implicit causal mask of GPT (key j
is masked for query i when j > i, aligned top-left like ``scaled_dot_product_attention``'s
``is_causal``); both may be given together.

Masked positions get probability exactly 0. A row whose keys are all masked (a padding query
under a query-and-key padding mask) has no distribution to normalize: it is defined as all
zeros, forward and backward, never NaN. This matches ``scaled_dot_product_attention`` on
boolean masks.

The fused versions always accumulate in fp32 and return the input dtype; they save only the
output probabilities for the backward pass, ``dx = scale * p * (g - sum(g * p))`` (in fp32
under torch.compile and Triton; with PyTorch's softmax backward kernel on the eager backend).
``softmax_in_fp32`` (Megatron's ``--attention-softmax-in-fp32``) therefore only changes the
unfused path, which otherwise computes in the input dtype.
"""

from __future__ import annotations

import torch

from megapipe.fusions.backend import active_backend, log_once
from megapipe.fusions.compiled import compiled

# Longest key row one Triton program normalizes in registers.
TRITON_MAX_KEYS = 16384


def causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """[sq, sk] boolean, True where key j comes after query i (j > i)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def combined_mask(mask: torch.Tensor | None, causal: bool, sq: int, sk: int, device) -> torch.Tensor | None:
    """The general mask OR the causal mask (None when neither applies)."""
    if not causal:
        return mask
    triangle = causal_mask(sq, sk, device)
    return triangle if mask is None else mask | triangle


def check_mask(scores_shape: torch.Size, mask: torch.Tensor | None) -> None:
    """Reject masks this module would misread: not boolean, or not broadcastable to the scores."""
    if len(scores_shape) != 4:
        raise ValueError(f"attention scores must be [b, heads, sq, sk], got shape {tuple(scores_shape)}.")
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise TypeError(f"attention mask must be boolean (True = masked out), got {mask.dtype}.")
    # broadcastable to the scores without growing them: each trailing dimension is 1 or equal
    fits = mask.dim() <= 4 and all(m in (1, s) for m, s in zip(reversed(mask.shape), reversed(scores_shape)))
    if not fits:
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not broadcast to the scores "
                         f"{tuple(scores_shape)}.")


def softmax_unfused(scores: torch.Tensor, scale: float, mask: torch.Tensor | None, causal: bool,
                    softmax_in_fp32: bool) -> torch.Tensor:
    """The reference composition of PyTorch ops (``--no-masked-softmax-fusion``)."""
    reduced = scores.dtype in (torch.float16, torch.bfloat16)
    x = scores.float() if softmax_in_fp32 and reduced else scores
    x = x * scale
    masked = combined_mask(mask, causal, scores.size(-2), scores.size(-1), scores.device)
    if masked is None:
        return torch.softmax(x, dim=-1).to(scores.dtype)
    # The most negative finite value instead of -inf: exp() of it is exactly 0 next to any real
    # score, and a fully masked row becomes uniform (no NaN, forward or backward) before zeroing.
    x = x.masked_fill(masked, torch.finfo(x.dtype).min)
    probs = torch.softmax(x, dim=-1).masked_fill(masked.all(dim=-1, keepdim=True), 0.0)
    return probs.to(scores.dtype)


def softmax_forward(scores: torch.Tensor, scale: float, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """Fused forward: the same maths as the unfused path, always accumulated in fp32."""
    return softmax_unfused(scores, scale, mask, causal, softmax_in_fp32=True)


def softmax_backward(grad: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """d(scores) from the saved probabilities: ``scale * p * (g - sum(g * p))``, in fp32."""
    p, g = probs.float(), grad.float()
    return (scale * p * (g - (g * p).sum(dim=-1, keepdim=True))).to(probs.dtype)


def native_softmax_backward(grad: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """The same gradient with PyTorch's softmax backward kernel, then the scale (the eager backend)."""
    grad_scores = torch.ops.aten._softmax_backward_data(grad, probs, -1, probs.dtype)
    return grad_scores if scale == 1.0 else grad_scores * scale


class _ScaleMaskSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, scale, mask, causal, kernels):
        probs = kernels[0](scores, scale, mask, causal)
        ctx.save_for_backward(probs)
        ctx.scale, ctx.backward_kernel = scale, kernels[1]
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        return ctx.backward_kernel(grad.contiguous(), probs, ctx.scale), None, None, None, None


def _kernels(family: str, scores: torch.Tensor):
    if family == "triton":
        if scores.size(-1) <= TRITON_MAX_KEYS:
            from megapipe.fusions import triton_softmax

            return triton_softmax.softmax_forward, triton_softmax.softmax_backward
        log_once(f"fused softmax: rows of {scores.size(-1)} keys exceed the Triton kernel's "
                 f"{TRITON_MAX_KEYS}; using the eager fused softmax")
    if family == "compile":
        return compiled(softmax_forward), compiled(softmax_backward)
    return softmax_forward, native_softmax_backward


def scale_mask_softmax(scores: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None,
                       causal: bool = False, softmax_in_fp32: bool = True, fused: bool = True) -> torch.Tensor:
    """softmax(scale * scores) over the last dimension with masked positions at probability 0.

    ``scores`` is [b, heads, sq, sk]; ``mask`` is boolean, broadcastable to it, True = masked
    out; ``causal`` adds the GPT mask. ``fused=False`` is the unfused PyTorch composition
    (``--no-masked-softmax-fusion``). Returns probabilities in the dtype of ``scores``.
    """
    check_mask(scores.shape, mask)
    if not fused:
        return softmax_unfused(scores, scale, mask, causal, softmax_in_fp32)
    family = active_backend().family("softmax", scores)
    return _ScaleMaskSoftmax.apply(scores.contiguous(), float(scale), mask, causal, _kernels(family, scores))
