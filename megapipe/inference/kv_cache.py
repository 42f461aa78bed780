"""Key/value cache for decoding, laid out like the model it serves.

Each rank caches only what it computes: the layers of its pipeline stage, and of those the
key/value heads (query groups) of its tensor rank, ``[b, groups / t, positions, head_dim]``.
Buffers are allocated on first use at the full length, so decoding never reallocates.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's keys and values; ``update`` writes the new positions and returns all so far."""

    def __init__(self, owner: "KVCache"):
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            shape = (k.shape[0], k.shape[1], self.owner.max_length, k.shape[3])
            self.keys = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.values = torch.empty(shape, dtype=v.dtype, device=v.device)
        start, end = self.owner.offset, self.owner.offset + k.shape[2]
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """The caches of one batch of sequences on this rank; ``offset`` is where the next forward's
    positions start (set by the caller before each forward)."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.offset = 0
        self.layers: dict[int, LayerCache] = {}

    def layer(self, number: int) -> LayerCache:
        if number not in self.layers:
            self.layers[number] = LayerCache(self)
        return self.layers[number]
