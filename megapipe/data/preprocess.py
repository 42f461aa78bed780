"""Turn local text into indexed datasets: read documents, tokenize them in worker processes, write .bin/.idx.

Output naming follows Megatron: ``<output_prefix>_<key>_document`` for one sequence per
document (GPT), ``<output_prefix>_<key>_sentence`` with ``split_sentences`` (BERT). Documents
keep their input order whatever the number of workers, so the output is reproducible.
"""

from __future__ import annotations

import multiprocessing
import os
from contextlib import ExitStack
from typing import Iterable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from megapipe.data.indexed_dataset import DEFAULT_FORMAT, IndexedDatasetBuilder, dtype_for_vocab
from megapipe.data.readers import TEXT_KEY, output_keys, read_documents
from megapipe.data.sentences import split_sentences
from megapipe.data.tokenizer import Tokenizer


class DocumentEncoder:
    """Tokenizes one document into its sequences: the whole text, or one sequence per sentence.

    Empty sequences are dropped; with ``append_eod`` the eod id ends the last sequence of
    every non-empty document.
    """

    def __init__(self, tokenizer: Tokenizer, split: bool = False, append_eod: bool = False):
        self.tokenizer = tokenizer
        self.split = split
        self.eod = tokenizer.eod if append_eod else None

    def encode_text(self, text: str) -> list[np.ndarray]:
        pieces = split_sentences(text) if self.split else [text]
        sequences = [ids for ids in map(self.tokenizer.tokenize, pieces) if ids]
        if self.eod is not None and sequences:
            sequences[-1] = sequences[-1] + [self.eod]
        return [np.asarray(ids, dtype=np.int32) for ids in sequences]

    def encode(self, document: dict[str, str]) -> dict[str, list[np.ndarray]]:
        return {key: self.encode_text(text) for key, text in document.items()}


_worker_encoder: Optional[DocumentEncoder] = None


def _init_worker(encoder: DocumentEncoder) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool already uses every core asked for
    _worker_encoder = encoder


def _encode_in_worker(document: dict[str, str]) -> dict[str, list[np.ndarray]]:
    return _worker_encoder.encode(document)


def output_prefix_for(output_prefix: str, key: str, split_sentences: bool) -> str:
    return f"{output_prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def encode_documents(documents: Iterable[dict[str, str]], encoder: DocumentEncoder,
                     workers: int) -> Iterable[dict[str, list[np.ndarray]]]:
    """Encoded documents in input order, computed in ``workers`` spawned processes when above 1."""
    if workers <= 1:
        yield from map(encoder.encode, documents)
        return
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (encoder,)) as pool:
        yield from pool.imap(_encode_in_worker, documents, chunksize=32)


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer: Tokenizer,
               json_keys: Sequence[str] = (TEXT_KEY,), split_sentences: bool = False, append_eod: bool = False,
               document_per_file: bool = False, workers: int = 1, progress: bool = True,
               output_format: str = DEFAULT_FORMAT) -> dict[str, str]:
    """Preprocess ``inputs`` into one dataset per key; returns ``{key: dataset prefix}``.

    The .bin dtype is uint16 when the tokenizer's vocabulary fits, int32 otherwise; the .idx is
    Megatron-LM's (``output_format="megatron"``) or megapipe's own (``"megapipe"``).
    """
    keys = output_keys(inputs, json_keys)
    encoder = DocumentEncoder(tokenizer, split_sentences, append_eod)
    prefixes = {key: output_prefix_for(output_prefix, key, split_sentences) for key in keys}
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    documents = read_documents(inputs, keys, document_per_file)
    with ExitStack() as stack, tqdm(unit="doc", disable=not progress, desc="preprocess") as bar:
        builders = {key: stack.enter_context(IndexedDatasetBuilder(prefix, dtype, output_format))
                    for key, prefix in prefixes.items()}
        tokens = 0
        for encoded in encode_documents(documents, encoder, workers):
            for key, sequences in encoded.items():
                builders[key].add_document(sequences)
                tokens += sum(len(s) for s in sequences)
            bar.update()
            bar.set_postfix(tokens=tokens, refresh=False)
    return prefixes
