"""Data-parallel sharding levels (Megatron-core's names) and what each one partitions.

* ``no_shard`` -- every replica holds all weights, gradients and optimizer state; gradients
  are all-reduced.
* ``optim`` (ZeRO-1, ``--use-distributed-optimizer``) -- fp32 master weights and optimizer
  moments are split over the data-parallel group; gradients are reduce-scattered and the
  updated shards all-gathered into the model weights.
* ``optim_grads`` (ZeRO-2) -- as ``optim``, and the full gradient buffer is released once it
  is reduced: between steps a rank keeps only its shard of the gradients.
* ``optim_grads_params`` (ZeRO-3) -- as ``optim_grads``, and the model weights themselves are
  released after every pass; each chunk's weights are gathered before its forward and its
  backward.
"""

from __future__ import annotations

from dataclasses import dataclass

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class ShardingLevel:
    """What ``strategy`` (one of ``SHARDING_STRATEGIES``) partitions over the data-parallel group."""

    strategy: str = "no_shard"

    @property
    def shards_optimizer(self) -> bool:
        return self.strategy != "no_shard"

    @property
    def shards_grads(self) -> bool:
        return self.strategy in ("optim_grads", "optim_grads_params")

    @property
    def shards_params(self) -> bool:
        return self.strategy == "optim_grads_params"
