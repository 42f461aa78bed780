"""Tokenise chunks of documents ahead of their use, in worker processes, without changing their order.

``TokenizingPool.map(chunks)`` yields, for each chunk of texts in input order, one token array
per text (the text's tokens and the eod id; an empty text gives an empty array, as
``preprocess_data.py --append-eod`` does). With workers, up to ``2 x workers`` chunks are being
tokenised while the caller trains on earlier ones; the results are taken back strictly in
submission order, so the token stream is the same for any number of workers, 0 included (the
caller's process tokenises). Workers are spawned once, at first use, and shared by every
``map`` of the pool; a ``map`` left unfinished leaves at most its window of chunks to finish.

The training process alone decides when to stop: workers ignore SIGTERM and SIGINT (a scheduler
that preempts signals every process of the job, and the run must still get its next batches to
reach the iteration where it saves and exits), and end when it shuts them down, or when it dies.
A worker that dies anyway fails the next result (``BrokenProcessPool``) rather than hang it.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Iterable, Iterator

import numpy as np

from megapipe.data import preprocess
from megapipe.data.preprocess import DocumentEncoder
from megapipe.data.tokenizer import Tokenizer

EMPTY = np.zeros(0, dtype=np.int32)


def encode_texts(encoder: DocumentEncoder, texts: list[str]) -> list[np.ndarray]:
    """One token array per text: its tokens then eod, or nothing for a text without tokens."""
    return [(encoder.encode_text(text) or [EMPTY])[0] for text in texts]


def _start_worker(encoder: DocumentEncoder) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
    preprocess._init_worker(encoder)


def _exit_with(sentinel: int) -> None:
    """End this worker when the process that started it has ended, however it ended."""
    multiprocessing.connection.wait([sentinel])
    os._exit(0)


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
            self._pool = ProcessPoolExecutor(self.workers, multiprocessing.get_context("spawn"), _start_worker,
                                             (self.encoder,))
        pending = collections.deque()
        for texts in chunks:
            pending.append(self._pool.submit(_encode_texts_in_worker, texts))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def close(self) -> None:
        """Stop the workers once their current chunks are done (a later ``map`` starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
