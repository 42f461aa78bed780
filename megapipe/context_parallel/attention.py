"""``context_attention``: attention of this rank's queries over the whole sequence, whose tokens are
split over the context-parallel ranks (chunks i and 2c-1-i on rank i, ``layout/context.py``), by
the comm type of the ``ContextGroups``: ring (p2p), all-gather, all-to-all over heads (a2a), or
all-to-all inside groups and a ring across them (a2a+p2p). Each returns exactly the rows that one
process attending over the whole sequence gives for this rank's queries.
"""

from __future__ import annotations

import functools

import torch

from megapipe.context_parallel.blocks import PADDING, Block
from megapipe.context_parallel.checks import check_head_split
from megapipe.context_parallel.gather import GatherSequence, gathered
from megapipe.context_parallel.heads import heads_to_sequence, sequence_to_heads
from megapipe.context_parallel.local import LocalAttention
from megapipe.context_parallel.plan import ranges_of
from megapipe.context_parallel.ring import RingAttention
from megapipe.context_parallel.timeline import Timeline
from megapipe.context_parallel.transfer import Ring
from megapipe.errors import ConfigError
from megapipe.layout.context import check_sequence_split, chunk_ranges, local_positions
from megapipe.parallel.context import ContextGroups


def _labels(document_ids, key_padding, shape) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(query labels, key labels): a query attends to a key of the same label only."""
    if document_ids is None and key_padding is None:
        return None, None
    ids = document_ids.long() if document_ids is not None else torch.zeros(shape, dtype=torch.long,
                                                                            device=key_padding.device)
    return ids, ids if key_padding is None else ids.masked_fill(key_padding, PADDING)


class _Sequence:
    """The positions the context ranks ``members`` hold together, in their rank order, and the index
    that puts them in position order (``order``) and back (``back``)."""

    def __init__(self, seq_length: int, context: int, members: tuple[int, ...], device):
        positions = torch.tensor([p for m in members for p in local_positions(seq_length, context, m)])
        self.sorted = ranges_of(sorted(positions.tolist()))
        self.order = torch.argsort(positions).to(device)
        self.back = torch.argsort(self.order)


@functools.lru_cache(maxsize=64)
def _sequence(seq_length: int, context: int, members: tuple[int, ...], device) -> _Sequence:
    """Built once per layout: every layer of every step asks for the same."""
    return _Sequence(seq_length, context, members, device)


def _heads_then(q, k, v, labels, group, size, sequence: _Sequence, attend):
    """All-to-all to a head split over ``group``, the tokens in position order, ``attend``, and back."""
    q, k, v = (sequence_to_heads(t, group, size).index_select(2, sequence.order) for t in (q, k, v))
    if labels[0] is not None:
        labels = tuple(gathered(t, group, size, 1).index_select(1, sequence.order) for t in labels)
    out = attend(q, k, v, labels)
    return heads_to_sequence(out.index_select(2, sequence.back), group, size)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: ContextGroups, *,
                      seq_length: int, causal: bool, scale: float, key_padding: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None, sequence_documents: torch.Tensor | None = None,
                      timeline: Timeline | None = None) -> torch.Tensor:
    """q [b, heads, s/c, d], k and v [b, query groups, s/c, d] in this rank's local order; returns
    [b, heads, s/c, d]. ``key_padding`` bool [b, s/c] (True: a key nobody attends to);
    ``document_ids`` int [b, s/c] (attention stays inside a document); ``sequence_documents`` the same for
    the whole sequence, [b, s] on the host: without key padding the blocks then run one unmasked call
    per document piece and no labels travel. ``timeline``: records the ring's transfers and computes
    (p2p, a2a+p2p)."""
    c, index = groups.size, groups.index
    check_sequence_split(seq_length, c)
    if q.size(2) * c != seq_length:
        raise ConfigError(f"context_attention got {q.size(2)} local tokens, but --seq-length {seq_length} over "
                          f"--context-parallel-size {c} gives {seq_length // c} per rank.")
    documents = sequence_documents if key_padding is None else None
    labels = (None, None) if documents is not None else _labels(document_ids, key_padding,
                                                                q.shape[:1] + q.shape[2:3])
    mine = chunk_ranges(seq_length, c, index)
    if c == 1:
        return LocalAttention.apply(q, k, v, Block(mine, mine, causal, *labels, documents), scale)
    if groups.comm_type == "p2p":
        ring = Ring(groups.group, groups.ranks, index, timeline)
        tokens = functools.partial(chunk_ranges, seq_length, c)
        return RingAttention.apply(q, k, v, ring, tokens, causal, scale, *labels, documents)
    if groups.comm_type == "all_gather":
        sequence = _sequence(seq_length, c, tuple(range(c)), q.device)
        k, v = (GatherSequence.apply(t, groups.group, c, sequence.order) for t in (k, v))
        key_labels = None if labels[1] is None else gathered(labels[1], groups.group, c, 1)[:, sequence.order]
        return LocalAttention.apply(q, k, v, Block(mine, sequence.sorted, causal, labels[0], key_labels, documents),
                                    scale)
    if groups.comm_type == "a2a":
        check_head_split(q.size(1), k.size(1), c, "a2a")
        sequence = _sequence(seq_length, c, tuple(range(c)), q.device)
        whole = lambda q, k, v, labels: LocalAttention.apply(
            q, k, v, Block(sequence.sorted, sequence.sorted, causal, *labels, documents), scale)
        return _heads_then(q, k, v, labels, groups.group, c, sequence, whole)
    if groups.comm_type == "a2a+p2p":
        size = len(groups.a2a_ranks)
        check_head_split(q.size(1), k.size(1), size, "a2a+p2p")
        inner = [groups.ranks.index(r) // size for r in groups.ring_ranks]  # each ring member's a2a group
        sequences = [_sequence(seq_length, c, tuple(range(g * size, (g + 1) * size)), q.device) for g in inner]
        ring = Ring(groups.ring_group, groups.ring_ranks, groups.ring_ranks.index(groups.ranks[index]), timeline)
        ringed = lambda q, k, v, labels: RingAttention.apply(
            q, k, v, ring, lambda member: sequences[member].sorted, causal, scale, *labels, documents)
        return _heads_then(q, k, v, labels, groups.a2a_group, size, sequences[ring.index], ringed)
    raise ConfigError(f"--cp-comm-type {groups.comm_type} is not one of p2p, all_gather, a2a, a2a+p2p.")
