"""``--split 969,30,1``: train/valid/test weights, turned into contiguous ranges of documents.

Megatron's default gives the test split a thousandth of the documents: none at all for a corpus
under 500 documents, so a split that gets none is refused naming a split that works.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from megapipe.errors import ConfigError, DataError

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """Three non-negative weights from ``"969,30,1"`` (or ``/``-separated); missing ones are 0."""
    parts = [p for p in re.split(r"[,/]", split.strip()) if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ConfigError(f"--split {split} is not valid; give up to three non-negative train,valid,test "
                          "weights with a positive sum, e.g. 969,30,1.")
    return weights + [0.0] * (3 - len(weights))


def split_document_ranges(num_documents: int, weights: list[float]) -> list[tuple[int, int]]:
    """Document ``[start, stop)`` of each split, in proportion to ``weights`` (rounded cumulatively)."""
    fractions = np.cumsum(weights) / sum(weights)
    bounds = [0] + [int(round(f * num_documents)) for f in fractions]
    bounds[-1] = num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]


def check_split_documents(split: str, num_documents: dict[str, int], needed: Sequence[bool]) -> None:
    """Raise DataError when a ``needed`` split (samples are asked of it) gets no document of one of the
    datasets (prefix -> number of documents), naming a split that gives each needed split one."""
    weights = parse_split(split)
    for prefix, count in num_documents.items():
        empty = [SPLIT_NAMES[s] for s, (start, stop) in enumerate(split_document_ranges(count, weights))
                 if needed[s] and stop == start]
        if empty:
            counts = working_split(weights, min(num_documents.values()), needed)
            raise DataError(f"--split {split} gives the {' and '.join(empty)} split of {prefix} none of its {count} "
                            f"documents; use --split {','.join(map(str, counts))} (documents per split) or add data.")


def working_split(weights: list[float], num_documents: int, needed: Sequence[bool]) -> list[int]:
    """Documents per split, near ``weights``, giving each ``needed`` split at least one (in the order train,
    valid, test while documents last); the train split takes the rest."""
    counts, remaining = [0, 0, 0], num_documents
    for s in range(3):
        if needed[s] and remaining:
            counts[s], remaining = 1, remaining - 1
    for s in (1, 2):
        extra = min(remaining, max(0, round(weights[s] / sum(weights) * num_documents) - counts[s]))
        counts[s], remaining = counts[s] + extra, remaining - extra
    counts[0] += remaining
    return counts
