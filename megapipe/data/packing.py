"""Packed documents: how the documents that share one sample are kept apart (Megatron-LM's flags).

A GPT sample is a window over a stream of documents, each ending in the end-of-document token, so
one sample usually holds the end of one document and the start of others. Megatron's
``get_ltor_masks_and_position_ids`` defines three independent switches, all keyed on that token:

* ``--eod-mask-loss``: no loss where the input token is the end-of-document token (its label is
  the next document's first token, which nothing before it predicts);
* ``--reset-position-ids``: positions restart at 0 after each end-of-document token;
* ``--reset-attention-mask``: a token attends only to tokens of its own document.

The end-of-document token belongs to the document it ends. The fields are computed here, per
sample, so every parallel layout (context parallelism slices them like the tokens) sees the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from megapipe.config import DataConfig


@dataclass(frozen=True)
class Packing:
    """The three switches and the end-of-document id they key on."""

    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    def fields(self, tokens: np.ndarray, loss_mask: np.ndarray) -> dict[str, np.ndarray]:
        """The sample's extra fields for ``tokens`` [s]: ``position_ids`` and ``document_ids`` (int64 [s])
        when their switch is on; ``loss_mask`` is zeroed in place under ``eod_mask_loss``."""
        ends = tokens == self.eod
        if self.eod_mask_loss:
            loss_mask[ends] = 0.0
        out = {}
        documents = document_ids(ends)
        if self.reset_position_ids:
            starts = np.flatnonzero(np.concatenate(([True], documents[1:] != documents[:-1])))
            out["position_ids"] = np.arange(len(tokens), dtype=np.int64) - starts[documents]
        if self.reset_attention_mask:
            out["document_ids"] = documents
        return out


def packing_of(data: DataConfig, tokenizer) -> Optional[Packing]:
    """The packing the flags ask for (None when no switch is on), keyed on the tokenizer's end-of-document id."""
    switches = dict(eod_mask_loss=data.eod_mask_loss, reset_position_ids=data.reset_position_ids,
                    reset_attention_mask=data.reset_attention_mask)
    return Packing(tokenizer.eod, **switches) if any(switches.values()) else None


def document_ids(ends: np.ndarray) -> np.ndarray:
    """Which document (0, 1, ...) each token belongs to: the end-of-document tokens before it."""
    return np.concatenate(([0], np.cumsum(ends[:-1]))).astype(np.int64)
