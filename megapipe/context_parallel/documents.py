"""Kernel calls of a block over packed documents, one per piece of a document, so that no call needs a mask.

With the document ids of the whole sequence on the host (``data/rank_data.py`` keeps them there for
context parallelism), each side of a block falls into *runs*: rows of one document at consecutive
positions. A query run attends exactly to the key runs of its own document, so each pair of runs of
one document is an unmasked call, full or (under causal attention) cut where the keys start and end,
so that every causal piece is a diagonal the kernel's own mask handles. Sequences of a batch have
their own documents, so each call names the batch row it is for.

Everything here is host arithmetic on host tensors (read through ``numpy()``): nothing waits for a device.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from megapipe.context_parallel.plan import Call, Ranges, block_calls


def _runs(ranges: Ranges, documents: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(document, first row, end row, first position) of each run of the side at ``ranges`` in one sequence."""
    position = np.concatenate([np.arange(a, b) for a, b in ranges])
    label = documents[position]
    starts = np.flatnonzero(np.r_[True, (label[1:] != label[:-1]) | (position[1:] != position[:-1] + 1)])
    ends = np.r_[starts[1:], len(position)]
    return [(int(label[s]), int(s), int(e), int(position[s])) for s, e in zip(starts, ends)]


def _unmasked(q: tuple[int, int], k: tuple[int, int], causal: bool) -> list[Call]:
    """Calls of the queries at positions ``q`` against the keys at ``k`` (one run each), rows counted from each
    run's start, none needing a mask: under causal attention the queries are cut where the keys start and end."""
    if not causal:
        return [Call((0, q[1] - q[0]), (0, k[1] - k[0]))]
    cuts = sorted({q[0], q[1]} | {p for p in k if q[0] < p < q[1]})
    return block_calls(tuple(zip(cuts, cuts[1:])), (k,), True)


def document_calls(q: Ranges, k: Ranges, causal: bool, documents: torch.Tensor) -> list[tuple[int, Call]]:
    """(batch row, call) of every unmasked call of queries at ``q`` against keys at ``k``; ``documents`` [b, s]
    on the host holds each position's document id."""
    ids = documents.numpy()
    calls = []
    for row in range(ids.shape[0]):
        keys = defaultdict(list)
        for document, start, end, position in _runs(k, ids[row]):
            keys[document].append((start, end, position))
        for document, q_start, q_end, q_position in _runs(q, ids[row]):
            for k_start, k_end, k_position in keys[document]:
                for call in _unmasked((q_position, q_position + q_end - q_start),
                                      (k_position, k_position + k_end - k_start), causal):
                    calls.append((row, Call((q_start + call.q[0], q_start + call.q[1]),
                                            (k_start + call.k[0], k_start + call.k[1]), call.causal, call.diagonal)))
    return calls
