"""``--mock-data``: synthetic GPT samples for benchmarks, as Megatron's mock GPT dataset.

No file is read or written: sample ``i`` is ``seq_length + 1`` tokens drawn uniformly from
``[0, vocab_size)`` by ``numpy.random.default_rng([seed, split, i])``, the same in every run and
rank. The tokenizer is Megatron's null tokenizer: ``--vocab-size N`` ids plus an end-of-document id ``N``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from megapipe.data.gpt_dataset import lm_sample
from megapipe.data.packing import Packing
from megapipe.data.splits import SPLIT_NAMES


class MockGPTDataset:
    """``num_samples`` items in ``GPTDataset``'s format (``tokens``, ``labels``, ``loss_mask``, and what ``packing``
    adds: with no end-of-document token drawn, one document per sample) of random tokens."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split_name: str = "train",
                 packing: Optional[Packing] = None):
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.split, self.packing = seed, SPLIT_NAMES.index(split_name), packing

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        window = np.random.default_rng([self.seed, self.split, int(i)]).integers(0, self.vocab_size,
                                                                                self.seq_length + 1)
        return lm_sample(window, self.packing)
