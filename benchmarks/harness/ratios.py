"""Figures of paired measurements: per-round ratios and their spread, means, rank correlation."""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def paired(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]``: the ratio of each round (both measured under about the same load)."""
    return [x / y for x, y in zip(a, b)]


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.median(paired(a, b))


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile (one value: that value three times)."""
    if len(values) == 1:
        return (values[0],) * 3
    low, middle, high = statistics.quantiles(values, n=4)
    return low, middle, high


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(statistics.mean(math.log(x) for x in values))


def max_relative_diff(values: Sequence[float], reference: Sequence[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference))


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Rank correlation (average ranks for ties)."""
    import numpy as np

    def ranks(values):
        order = np.argsort(values)
        result = np.empty(len(values))
        result[order] = np.arange(len(values))
        for value in set(values):
            same = [i for i, v in enumerate(values) if v == value]
            result[same] = np.mean(result[same])
        return result

    return float(np.corrcoef(ranks(list(xs)), ranks(list(ys)))[0, 1])
