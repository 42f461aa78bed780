"""What the pipeline executor tells the gradient syncs around each forward and backward pass.

Before a pass the chunk's weights are made whole (gathered at ``optim_grads_params``, or the
all-gather started after the last step awaited with ``--overlap-param-gather``) and released
after it. Before a backward the chunk's sync learns whether it is the last one before the
chunk's next update, so that with ``--overlap-grad-reduce`` each bucket's reduction starts from
the hook of its last gradient.
"""

from __future__ import annotations

from typing import Optional

from megapipe.optim.grad_sync import GradSync


class SyncPasses:
    """Pass hooks for the executor over one rank's chunks; ``syncs[c]`` is chunk c's sync (None: no
    trainable weights), ``backwards_per_update`` how many backwards each update applies."""

    def __init__(self, syncs: list[Optional[GradSync]], backwards_per_update: int):
        self.syncs, self.backwards_per_update = syncs, backwards_per_update
        self._backwards = [0] * len(syncs)

    def before_pass(self, backward: bool, chunk: int, weights: bool = True) -> None:
        """``weights`` False: a backward that computes only input gradients (a split backward's BI),
        which neither counts towards the update nor makes weight gradients."""
        sync = self.syncs[chunk]
        if sync is None:
            return
        if backward and weights:
            self._backwards[chunk] += 1
            sync.begin_backward(final=self._backwards[chunk] == self.backwards_per_update)
        sync.gather_weights()

    def after_pass(self, backward: bool, chunk: int) -> None:
        if self.syncs[chunk] is not None:
            self.syncs[chunk].release_weights()

    def updated(self, chunks: list[int]) -> None:
        """The listed chunks stepped: their next backwards count towards the next update."""
        for chunk in chunks:
            self._backwards[chunk] = 0
