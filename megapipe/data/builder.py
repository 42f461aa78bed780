"""``build_train_valid_test_datasets``: what the training loop calls to get its three datasets."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megapipe.data.bert_dataset import BERTDataset
from megapipe.data.blended_dataset import BlendedDataset, blending_index, parse_data_path
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.index_cache import default_cache_dir
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.splits import SPLIT_NAMES, check_split_documents, parse_split, split_document_ranges
from megapipe.data.tokenizer import Tokenizer
from megapipe.errors import ConfigError

KINDS = ("gpt", "bert")


def _component(kind: str, indexed: IndexedDataset, documents: np.ndarray, num_samples: int, split_name: str,
               seq_length: int, seed: int, cache_dir: str, tokenizer: Tokenizer, options: dict):
    if kind == "gpt":
        return GPTDataset(indexed, documents, num_samples, seq_length, seed, cache_dir, split_name, **options)
    return BERTDataset(indexed, documents, num_samples, seq_length, seed, cache_dir, tokenizer, split_name, **options)


def build_train_valid_test_datasets(kind: str, data_path: Sequence[str], split: str, seq_length: int, seed: int,
                                    num_samples: Sequence[int], tokenizer: Tokenizer,
                                    cache_dir: Optional[str] = None, **options) -> tuple:
    """(train, valid, test) datasets for ``kind`` "gpt" or "bert" from ``--data-path`` and ``--split``.

    Every dataset of ``data_path`` is split by documents with the ``split`` weights; several
    datasets are blended by their weights. A split whose weight or requested sample count is
    zero is ``None``. ``cache_dir`` (``--data-cache-path``) holds the sample indices, by default
    ``index-cache/`` next to each dataset. ``options`` go to the dataset class: GPT takes
    ``packing`` (``data/packing.py``); BERT takes ``masked_lm_prob``, ``short_seq_prob``, ``binary_head``, ``pair_task``.
    """
    if kind not in KINDS:
        raise ConfigError(f"dataset kind {kind} is unknown; use gpt or bert.")
    if len(num_samples) != 3:
        raise ConfigError(f"num_samples {list(num_samples)} must give train, valid and test sample counts.")
    blend = parse_data_path(data_path)
    indexed = [IndexedDataset(prefix, vocab_size=tokenizer.vocab_size) for _, prefix in blend]
    split_weights = parse_split(split)
    check_split_documents(split, {prefix: ds.num_documents for (_, prefix), ds in zip(blend, indexed)},
                          [w > 0 and n > 0 for w, n in zip(split_weights, num_samples)])
    document_ranges = [split_document_ranges(ds.num_documents, split_weights) for ds in indexed]

    def component(d: int, s: int, count: int):
        start, stop = document_ranges[d][s]
        return _component(kind, indexed[d], np.arange(start, stop), count, SPLIT_NAMES[s], seq_length, seed,
                          default_cache_dir(blend[d][1], cache_dir), tokenizer, options)

    def split_dataset(s: int):
        if split_weights[s] == 0 or num_samples[s] == 0:
            return None
        if len(blend) == 1:
            return component(0, s, num_samples[s])
        index = blending_index([w for w, _ in blend], num_samples[s], default_cache_dir(blend[0][1], cache_dir))
        counts = np.bincount(index["dataset_index"], minlength=len(blend))
        return BlendedDataset([component(d, s, int(c)) for d, c in enumerate(counts)], index)

    return tuple(split_dataset(s) for s in range(len(SPLIT_NAMES)))
