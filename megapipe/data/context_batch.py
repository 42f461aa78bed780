"""The part of a batch one context-parallel rank reads: its two chunks of every sequence.

Every rank of a context group reads the same samples (those of its data rank) and keeps, of each
field laid out over the sequence (last dimension), the tokens of its chunks in its local order
(``layout/context.py``); per-sample fields (BERT's sentence-order label) stay whole, and so do the
packed documents' ids of the whole sequence (``sequence_documents``), which stay on the host: with
them each block of attention runs one unmasked call per piece of a document. The cut is made where
the samples are read, before anything is sent over the tensor group or put on the device.
"""

from __future__ import annotations

import torch

from megapipe.layout.context import local_positions
from megapipe.parallel.state import ParallelState

PER_SAMPLE_FIELDS = ("is_random",)  # [..., b]; every other field is [..., b, s]
HOST_FIELDS = ("sequence_documents",)  # kept whole and on the host (``context_parallel/documents.py`` reads them)


def context_share(batch: dict, seq_length: int, ps: ParallelState) -> dict:
    """``batch`` (fields [..., b, s], or [..., b] per sample) with every sequence cut to this rank's s/c tokens."""
    if ps.cp_size == 1:
        return batch
    index = torch.tensor(local_positions(seq_length, ps.cp_size, ps.cp_rank))
    return {key: value if key in PER_SAMPLE_FIELDS + HOST_FIELDS else value.index_select(-1, index.to(value.device))
            for key, value in batch.items()}
