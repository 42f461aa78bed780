"""Tokenise chunks of documents ahead of their use, in worker processes, without changing their order.

``TokenizingPool.map(chunks)`` yields, for each chunk of texts in input order, one token array
per text (the text's tokens and the eod id; an empty text gives an empty array, as
``preprocess_data.py --append-eod`` does). With workers, up to ``2 x workers`` chunks are being
tokenised while the caller trains on earlier ones; the results are taken back strictly in
submission order, so the token stream is the same for any number of workers, 0 included (the
caller's process tokenises). Workers are spawned once, at first use, and shared by every
``map`` of the pool; a ``map`` left unfinished leaves at most its window of chunks to finish.
"""

from __future__ import annotations

import collections
import multiprocessing
from typing import Iterable, Iterator

import numpy as np

from megapipe.data import preprocess
from megapipe.data.preprocess import DocumentEncoder
from megapipe.data.tokenizer import Tokenizer

EMPTY = np.zeros(0, dtype=np.int32)


def encode_texts(encoder: DocumentEncoder, texts: list[str]) -> list[np.ndarray]:
    """One token array per text: its tokens then eod, or nothing for a text without tokens."""
    return [(encoder.encode_text(text) or [EMPTY])[0] for text in texts]


def _encode_texts_in_worker(texts: list[str]) -> list[np.ndarray]:
    return encode_texts(preprocess._worker_encoder, texts)


class TokenizingPool:
    """``workers`` spawned processes (none for 0) that tokenise with ``tokenizer``, eod appended."""

    def __init__(self, tokenizer: Tokenizer, workers: int):
        self.encoder = DocumentEncoder(tokenizer, append_eod=True)
        self.workers = workers
        self._pool = None

    def map(self, chunks: Iterable[list[str]]) -> Iterator[list[np.ndarray]]:
        """The token arrays of each chunk of ``chunks``, in order (``chunks`` may be endless)."""
        if self.workers == 0:
            for texts in chunks:
                yield encode_texts(self.encoder, texts)
            return
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(self.workers, preprocess._init_worker,
                                                                    (self.encoder,))
        pending = collections.deque()
        for texts in chunks:
            pending.append(self._pool.apply_async(_encode_texts_in_worker, (texts,)))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        """Stop the workers (a later ``map`` starts new ones)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
