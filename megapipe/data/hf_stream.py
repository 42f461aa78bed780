"""GPT samples from text tokenised while training reads it (``--hf-dataset``), resumable bit for bit.

The order is ``GPTDataset``'s without its window shuffle: epoch ``e`` concatenates the documents
of a split in the order ``numpy.random.default_rng([seed, e]).permutation``, each document's
tokens followed by eod, epochs following each other; window ``j`` of that stream is tokens
``[j*seq_length, (j+1)*seq_length + 1)`` (windows cross documents and share one token). So the
samples are those ``GPTDataset`` serves for the same documents preprocessed with ``--append-eod``,
in stream order, and sample ``j`` is a function of the data, the tokenizer, the seed and ``j`` only.

Position. A run that has consumed ``n`` samples continues at window ``n``: the checkpoint's
consumed-samples count is the whole position, nothing else is stored, and a resumed run sees the
samples of an uninterrupted one whatever its data-parallel degree (the samplers deal out the same
global sequence). Finding where window ``n`` starts needs the token count of every document before
it: a resumed run tokenises (to count, in the worker processes) the documents of the first epoch up
to that point, at most one epoch; once all lengths are known, later epochs are arithmetic.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from megapipe.data.gpt_dataset import lm_sample
from megapipe.data.packing import Packing
from megapipe.data.splits import SPLIT_NAMES, check_split_documents, parse_split, split_document_ranges
from megapipe.data.tokenizing_pool import TokenizingPool
from megapipe.errors import DataError

CHUNK_DOCUMENTS = 64  # documents per task of a tokenising worker
TextReader = Callable[[list], list]  # document indices -> their texts


class StreamedGPTDataset:
    """``num_samples`` GPT samples packed from the documents ``documents`` (indices for ``read``),
    tokenised by ``pool``. Read in order through ``windows(first)``; items as ``GPTDataset``'s."""

    def __init__(self, read: TextReader, documents: np.ndarray, num_samples: int, seq_length: int, seed: int,
                 pool: TokenizingPool, name: str = "train", packing: Optional[Packing] = None):
        self.read, self.pool, self.name, self.packing = read, pool, name, packing
        self.documents = np.asarray(documents, dtype=np.int64)
        self.num_samples, self.seq_length, self.seed = num_samples, seq_length, seed
        self._lengths = np.full(len(self.documents), -1, dtype=np.int64)  # tokens per document, -1: not yet counted

    def __len__(self) -> int:
        return self.num_samples

    def item(self, window: np.ndarray) -> dict[str, np.ndarray]:
        return lm_sample(window, self.packing)

    def windows(self, first: int = 0) -> Iterator[np.ndarray]:
        """Windows ``first``, ``first + 1``, ... (``seq_length + 1`` int64 tokens each), without end."""
        epoch, k, offset = self.locate(first * self.seq_length)
        arrays = self._arrays_from(epoch, k)
        size, buffer = self.seq_length + 1, next(arrays)[offset:]
        while True:
            pieces, have = [buffer], len(buffer)
            while have < size:
                pieces.append(next(arrays))
                have += len(pieces[-1])
            buffer = np.concatenate(pieces) if len(pieces) > 1 else buffer
            yield buffer[:size].astype(np.int64)
            buffer = buffer[self.seq_length:]

    def locate(self, token: int) -> tuple[int, int, int]:
        """(epoch, k, offset): stream token ``token`` is token ``offset`` of the ``k``-th document of epoch
        ``epoch``'s order. Counts the first epoch's documents by tokenising them until all are known."""
        if (self._lengths < 0).any():
            order, before = self.order(0), 0
            chunks = [order[s:s + CHUNK_DOCUMENTS] for s in range(0, len(order), CHUNK_DOCUMENTS)]
            for start, arrays in zip(range(0, len(order), CHUNK_DOCUMENTS), self.pool.map(map(self._texts, chunks))):
                for k, array in enumerate(arrays, start):
                    self._lengths[order[k]] = len(array)
                    if before + len(array) > token:
                        return 0, k, token - before
                    before += len(array)
            if before == 0:
                raise DataError(f"the {self.name} split of --hf-dataset has no tokens in its {len(order)} documents "
                                "(all texts are empty); add text or give the split more documents with --split.")
        epoch, rest = divmod(token, int(self._lengths.sum()))
        lengths = self._lengths[self.order(epoch)]
        ends = np.cumsum(lengths)
        k = int(np.searchsorted(ends, rest, side="right"))
        return epoch, k, int(rest - (ends[k] - lengths[k]))

    def order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order of the documents, as positions in ``documents``."""
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.documents))

    def _texts(self, positions: np.ndarray) -> list[str]:
        return self.read(self.documents[positions].tolist())

    def _arrays_from(self, epoch: int, k: int) -> Iterator[np.ndarray]:
        """The token arrays of the documents from the ``k``-th of epoch ``epoch`` on, through every later epoch."""
        def chunks():
            e, start = epoch, k
            while True:
                order = self.order(e)
                for s in range(start, len(order), CHUNK_DOCUMENTS):
                    yield self._texts(order[s:s + CHUNK_DOCUMENTS])
                e, start = e + 1, 0

        for arrays in self.pool.map(chunks()):
            yield from arrays


def build_streamed_datasets(read: TextReader, num_documents: int, where: str, split: str, seq_length: int,
                            seed: int, num_samples: Sequence[int], pool: TokenizingPool,
                            packing: Optional[Packing] = None) -> tuple[Optional[StreamedGPTDataset], ...]:
    """(train, valid, test) streams over ``num_documents`` documents cut by ``--split`` (as ``--data-path``'s
    are); a split with no weight or no samples asked of it is None. ``where`` names the data in errors."""
    weights = parse_split(split)
    needed = [w > 0 and n > 0 for w, n in zip(weights, num_samples)]
    check_split_documents(split, {where: num_documents}, needed)
    ranges = split_document_ranges(num_documents, weights)
    return tuple(StreamedGPTDataset(read, np.arange(*ranges[s]), num_samples[s], seq_length, seed, pool, name,
                                    packing) if needed[s] else None for s, name in enumerate(SPLIT_NAMES))
