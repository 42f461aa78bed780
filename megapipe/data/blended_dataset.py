"""Weighted mixtures of datasets (``--data-path 0.3 prefixA 0.7 prefixB``).

Sample ``i`` of the mixture comes from the dataset whose share so far is furthest below its
weight: the one maximising ``weight[d] * (i + 1) - taken[d]`` (ties go to the lower index).
The interleaving is deterministic and every prefix of it is as close to the weights as one
sample allows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megapipe.data.index_cache import load_or_build
from megapipe.errors import ConfigError

INDEX_VERSION = 1


def parse_data_path(items: Sequence[str]) -> list[tuple[float, str]]:
    """``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]`` as (normalised weight, prefix) pairs."""
    items = list(items)
    if len(items) == 1:
        return [(1.0, items[0])]
    pairs = []
    if items and len(items) % 2 == 0:
        for weight, prefix in zip(items[0::2], items[1::2]):
            try:
                pairs.append((float(weight), prefix))
            except ValueError:
                break
    if not items or len(pairs) != len(items) // 2 or len(pairs) == 0:
        raise ConfigError(f"--data-path {' '.join(items)} is not valid; give one dataset prefix or "
                          "weight/prefix pairs such as 0.3 prefixA 0.7 prefixB.")
    if min(w for w, _ in pairs) <= 0:
        raise ConfigError(f"--data-path {' '.join(items)} has a weight that is not positive; "
                          "every weight must be above 0.")
    total = sum(w for w, _ in pairs)
    return [(w / total, prefix) for w, prefix in pairs]


def build_blending_index(weights: Sequence[float], size: int) -> dict[str, np.ndarray]:
    """Which dataset serves each of ``size`` samples, and that dataset's own sample number."""
    weights = [float(w) / sum(weights) for w in weights]
    taken = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    candidates = range(len(weights))
    for i in range(size):
        chosen = max(candidates, key=lambda d: weights[d] * (i + 1) - taken[d])
        dataset_index[i] = chosen
        dataset_sample_index[i] = taken[chosen]
        taken[chosen] += 1
    return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}


def blending_index(weights: Sequence[float], size: int, cache_dir: str) -> dict[str, np.ndarray]:
    """``build_blending_index``, cached (building it is a Python loop over every sample)."""
    description = {"kind": "blend", "version": INDEX_VERSION, "weights": [float(w) for w in weights], "size": size}
    return load_or_build(cache_dir, description, lambda: build_blending_index(weights, size))


class BlendedDataset:
    """Serves ``datasets`` interleaved by ``blending_index``; items are the datasets' own items."""

    def __init__(self, datasets: Sequence, index: dict[str, np.ndarray]):
        self.datasets = list(datasets)
        self.dataset_index = index["dataset_index"]
        self.dataset_sample_index = index["dataset_sample_index"]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int):
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
