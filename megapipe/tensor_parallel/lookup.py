"""Embedding lookups of ``[b, s]`` ids written as ``[s, b, h]``, the layers' layout, without a transposing copy.

``F.embedding(ids.t(), weight)`` gathers the rows straight into ``[s, b, h]``. Its own backward would add the
gradient rows into the table in ``[s, b]`` order; this one adds them in the ``[b, s]`` order of a lookup of
``ids`` that is then transposed, so a row that several tokens share sums their gradients in the same order
and the table's gradient keeps its bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SequenceFirstLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.rows = weight.shape[0]
        return F.embedding(ids.t(), weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return None, torch.ops.aten.embedding_dense_backward(grad.transpose(0, 1), ids, ctx.rows, -1, False)


def sequence_first_lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight).transpose(0, 1).contiguous()`` for ``ids`` [b, s]: the rows as [s, b, h]."""
    if ids.dim() != 2:
        raise ValueError(f"sequence_first_lookup takes [batch, sequence] ids, got shape {tuple(ids.shape)}.")
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding(ids.t(), weight)
    return _SequenceFirstLookup.apply(ids, weight)
