"""GPT samples: windows of ``seq_length + 1`` tokens over a shuffled stream of documents.

The documents of a split are concatenated in a fresh random order every epoch (epoch ``e``
permutes them with ``numpy.random.default_rng([seed, e])``), and sample ``j`` of the stream is
tokens ``[j*seq_length, (j+1)*seq_length + 1)``: windows cross document boundaries and
consecutive windows share one token, so no token is wasted. The windows that start in epoch
``e`` are served together, shuffled by ``default_rng([seed, e, 1])``.

Nothing here depends on how many samples are asked for: the order is a prefix-stable function
of the seed and the data, so a run resumed with a larger ``--train-iters`` sees exactly the
samples an uninterrupted longer run would. The cached index covers whole epochs.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from megapipe.data.index_cache import array_digest, load_or_build
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.packing import Packing
from megapipe.errors import DataError

INDEX_VERSION = 2


def windows_before(tokens: int, seq_length: int) -> int:
    """How many windows start before stream position ``tokens``."""
    return -(-tokens // seq_length)


def num_epochs_needed(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    """The fewest epochs in which ``num_samples`` windows start (at least one): the smallest E
    with ``ceil(E * tokens_per_epoch / seq_length) >= num_samples``."""
    return max(1, (num_samples - 1) * seq_length // tokens_per_epoch + 1)


def build_sample_index(document_lengths: np.ndarray, num_epochs: int, seq_length: int,
                       seed: int) -> dict[str, np.ndarray]:
    """Document order, where each window starts, and the serving order of the windows of ``num_epochs`` epochs.

    ``sample_start[j] = (k, offset)``: window ``j`` starts ``offset`` tokens into the ``k``-th
    document of ``document_order`` (an index into ``document_lengths``). The document order
    runs past the last epoch far enough for its last window to end.
    """
    tokens_per_epoch = int(document_lengths.sum())
    spill = math.ceil((seq_length + 1) / tokens_per_epoch) if tokens_per_epoch else 0  # epochs the last windows reach
    document_order = np.concatenate([np.random.default_rng([seed, e]).permutation(len(document_lengths))
                                     for e in range(num_epochs + spill)])
    stream_offsets = np.concatenate([[0], np.cumsum(document_lengths[document_order])])
    bounds = [windows_before(e * tokens_per_epoch, seq_length) for e in range(num_epochs + 1)]
    starts = np.arange(bounds[-1], dtype=np.int64) * seq_length
    position = np.searchsorted(stream_offsets, starts, side="right") - 1
    sample_start = np.stack([position, starts - stream_offsets[position]], axis=1)
    sample_order = np.concatenate([bounds[e] + np.random.default_rng([seed, e, 1]).permutation(bounds[e + 1] - bounds[e])
                                   for e in range(num_epochs)])
    return {"document_order": document_order, "sample_start": sample_start, "sample_order": sample_order}


class GPTDataset:
    """``num_samples`` language-model samples from the documents ``documents`` of ``indexed``.

    Items are dicts: ``tokens`` and ``labels`` (int64[seq_length], labels = tokens shifted by
    one) and ``loss_mask`` (float32[seq_length]); with ``packing``, what its switches add
    (``data/packing.py``: the loss mask zero on end-of-document inputs, ``position_ids``, ``document_ids``).
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int, seq_length: int,
                 seed: int, cache_dir: str, split_name: str = "train", packing: Optional[Packing] = None):
        self.indexed = indexed
        self.documents = np.asarray(documents, dtype=np.int64)
        self.seq_length = seq_length
        self.packing = packing
        lengths = indexed.document_lengths[self.documents]
        if num_samples > 0 and lengths.sum() == 0:
            raise DataError(f"the {split_name} split of {indexed.prefix} has no tokens but {num_samples} samples "
                            "were asked for; give it more documents with --split or add data.")
        num_epochs = num_epochs_needed(int(lengths.sum()), num_samples, seq_length) if num_samples else 1
        description = {"kind": "gpt", "version": INDEX_VERSION, "split": split_name, "seed": seed,
                       "seq_length": seq_length, "num_epochs": num_epochs, "lengths": array_digest(lengths),
                       "num_documents": len(lengths)}
        index = load_or_build(cache_dir, description,
                              lambda: build_sample_index(lengths, num_epochs, seq_length, seed))
        self.document_order = index["document_order"]
        self.sample_start = index["sample_start"]
        self.sample_order = index["sample_order"][:num_samples]

    def __len__(self) -> int:
        return len(self.sample_order)

    def sample_tokens(self, j: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of stream window ``j`` (before serving order is applied)."""
        position, offset = (int(v) for v in self.sample_start[j])
        pieces, needed = [], self.seq_length + 1
        while needed:
            document = self.indexed.document(int(self.documents[self.document_order[position]]))
            piece = document[offset:offset + needed]
            pieces.append(piece)
            needed -= len(piece)
            position, offset = position + 1, 0
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return lm_sample(self.sample_tokens(int(self.sample_order[i])), self.packing)


def lm_sample(window: np.ndarray, packing: Optional[Packing] = None) -> dict[str, np.ndarray]:
    """The item of a window of ``seq_length + 1`` tokens: ``tokens``, ``labels`` (shifted by one), ``loss_mask``,
    and with ``packing`` the fields its switches add."""
    tokens, labels = window[:-1], window[1:]
    loss_mask = np.ones(len(tokens), dtype=np.float32)
    item = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
    if packing is not None:
        item.update(packing.fields(tokens, loss_mask))
    return item
