"""Several per-chunk optimizers seen as one, for code that schedules or checkpoints "the optimizer".

An asynchronous schedule with interleaving (2BW, v > 1) updates each model chunk on its own,
so a rank has one optimizer per chunk. The learning-rate scheduler sets the rate of every
param group; the loss is scaled once for the whole backward (all chunks share one constant
scale, or none); checkpoints hold each optimizer's state in chunk order.
"""

from __future__ import annotations

import torch

from megapipe.optim import PrecisionOptimizer


class OptimizerGroup:
    def __init__(self, optimizers: list[PrecisionOptimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def main_params(self) -> list[torch.nn.Parameter]:
        return [param for optimizer in self.optimizers for param in optimizer.main_params]

    @property
    def loss_scale(self):
        return self.optimizers[0].loss_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizers[0].scale_loss(loss)

    def state_dict(self) -> dict:
        return {"chunks": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for optimizer, chunk_state in zip(self.optimizers, state["chunks"]):
            optimizer.load_state_dict(chunk_state)
