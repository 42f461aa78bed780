"""Parameter bookkeeping shared by the tensor-parallel layers, the optimizer and checkpoints.

A parameter split across the tensor group carries ``tensor_model_parallel = True`` and the
dimension it is split along (``partition_dim``); every other parameter is a replica on each
tensor rank. ``shared_embedding`` marks the last stage's copy of a tied word embedding (its
gradient is summed with the first stage's, and a global norm counts it once).
``sequence_parallel`` marks replicated parameters that see only a slice of the sequence under
sequence parallelism, whose gradients must be summed over the tensor group.
"""

from __future__ import annotations

import hashlib

import torch


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def mark_tensor_parallel(param: torch.nn.Parameter, partition_dim: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "tensor_model_parallel", False)


def is_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True for the copies of a replicated parameter on tensor ranks other than 0."""
    return not is_tensor_parallel(param) and tp_rank > 0


def deterministic_normal(shape: tuple[int, ...], std: float, seed: int, name: str,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A full (unsplit) N(0, std^2) tensor drawn from a generator keyed by (seed, name).

    Every parameter gets its own stream, so a layer's initial weights do not depend on
    how many tensor ranks split it, on which pipeline stage builds it, or on build order.
    """
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)
    generator = torch.Generator().manual_seed(key)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator).to(dtype)


def shard(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """The ``rank``-th of ``world`` contiguous equal slices of ``full`` along ``dim``."""
    return full.chunk(world, dim=dim)[rank].contiguous()
