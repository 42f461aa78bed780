"""What restricts attention in one forward pass, in the form the attention of this layout takes.

Without context parallelism the attention core takes one boolean mask broadcastable to
``[b, heads, s, s]`` (True = not allowed): BERT's padding and, for packed documents
(``--reset-attention-mask``), the document mask, combined here. Under context parallelism no rank
holds the whole sequence, so nothing ``[s, s]`` is built: the context-parallel attention takes the
per-token facts instead (``ContextMasks``) and compares them across ranks itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ContextMasks:
    """Per local token: ``key_padding`` [b, s/c] (True = padding) and ``document_ids`` [b, s/c], either None;
    ``sequence_documents``: the whole sequence's document ids [b, s] on the host, where the data gave them."""

    key_padding: Optional[torch.Tensor] = None
    document_ids: Optional[torch.Tensor] = None
    sequence_documents: Optional[torch.Tensor] = None


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s], True where query and key belong to different documents."""
    return document_ids[:, None, :, None] != document_ids[:, None, None, :]


def dense_mask(key_padding: Optional[torch.Tensor], document_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The one mask of a single-rank sequence: padded keys and keys of other documents masked; None if neither."""
    mask = None if key_padding is None else key_padding[:, None, None, :]
    if document_ids is not None:
        documents = document_mask(document_ids)
        mask = documents if mask is None else mask | documents
    return mask
