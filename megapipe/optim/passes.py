"""What the pipeline executor tells the gradient syncs around each forward and backward pass.

Before a pass the chunk's weights are made whole (gathered at ``optim_grads_params``, or the
all-gather started after the last step awaited with ``--overlap-param-gather``) and released
after it; under ZeRO-1/2 with ``--overlap-param-gather`` a forward waits for each bucket where its
first user starts instead, and under ZeRO-3 each pass gathers and frees them a layer at a time
(``unit_weights.py``). Before a backward the chunk's sync learns whether it is the last one before the
chunk's next update, so that with ``--overlap-grad-reduce`` each bucket's reduction starts from
the hook of its last gradient.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Optional, Sequence

from torch import nn

from megapipe.optim.unit_weights import UnitWeights
from megapipe.optim.grad_sync import GradSync
from megapipe.schedules.actions import ActionKind

_PARTS = {ActionKind.B: (ActionKind.BI, ActionKind.BW), ActionKind.BI: (ActionKind.BI,), ActionKind.BW: (ActionKind.BW,)}


class SyncPasses:
    """Pass hooks for the executor over one rank's chunks; ``syncs[c]`` is chunk c's sync (None: no
    trainable weights), ``backwards_per_update`` how many backwards each update applies."""

    def __init__(self, syncs: list[Optional[GradSync]], backwards_per_update: int, chunks: Sequence[nn.Module] = ()):
        self.syncs, self.backwards_per_update = syncs, backwards_per_update
        # a layer at a time: with --overlap-param-gather under ZeRO-1/2 a forward waits for each bucket where it
        # first needs it; under ZeRO-3 each pass gathers and frees the weights a layer at a time
        self.unit_weights = [UnitWeights(sync, chunk, lambda c=c: self._running[c] == 1)
                             if sync is not None and sync.weights_per_unit else None
                             for c, (sync, chunk) in enumerate(zip(syncs, chunks))]
        self.unit_weights += [None] * (len(syncs) - len(self.unit_weights))
        self._backwards = [Counter() for _ in syncs]  # per chunk: passes of each part since the update
        self._running = Counter()  # per chunk: passes using its weights now
        self._lock = threading.Lock()

    def before_pass(self, backward: bool, chunk: int, part: Optional[ActionKind] = None) -> None:
        """``part``: for a backward, B (the default) or a split backward's BI or BW. BI
        accumulates every gradient except the deferred weight-gradient products, BW only those;
        a B counts as both, and each counts towards the update on its own, so the last pass to
        touch a gradient is the final one for it."""
        sync = self.syncs[chunk]
        if sync is None:
            return
        if backward:
            parts = _PARTS[part or ActionKind.B]
            counts = self._backwards[chunk]
            counts.update(parts)
            sync.begin_backward(final=all(counts[p] == self.backwards_per_update for p in parts))
        with self._lock:
            self._running[chunk] += 1
        weights = self.unit_weights[chunk]
        if weights is not None:
            weights_by_unit = weights.ready and (not backward or weights.frees and part is not ActionKind.BW)
            weights.begin(backward)
            if weights_by_unit:
                return
        sync.gather_weights()

    def after_pass(self, backward: bool, chunk: int) -> None:
        if self.syncs[chunk] is None:
            return
        if self.unit_weights[chunk] is not None:
            self.unit_weights[chunk].end(backward)
        with self._lock:
            self._running[chunk] -= 1
            last = self._running[chunk] == 0
        if last:
            self.syncs[chunk].release_weights()

    def updated(self, chunks: list[int]) -> None:
        """The listed chunks stepped: their next backwards count towards the next update."""
        for chunk in chunks:
            self._backwards[chunk] = Counter()
