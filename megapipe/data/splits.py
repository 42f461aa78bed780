"""``--split 969,30,1``: train/valid/test weights, turned into contiguous ranges of documents."""

from __future__ import annotations

import re

import numpy as np

from megapipe.errors import ConfigError

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
