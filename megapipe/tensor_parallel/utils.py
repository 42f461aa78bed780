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
import math
from typing import Optional

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


# Values drawn on the host at a time (256 KiB of fp32). Every parameter draws at least one whole
# block, so a block much larger than a small parameter costs time, and memory the C allocator
# keeps for the process once freed (with 16 MiB blocks a test process that built dozens of small
# models grew by gigabytes).
INIT_BLOCK_ELEMENTS = 1 << 16


def _block_generator(seed: int, name: str, block: int) -> torch.Generator:
    key = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()[:8]
    return torch.Generator().manual_seed(int.from_bytes(key, "little") & ((1 << 63) - 1))


def init_normal_(out: torch.Tensor, full_shape: tuple[int, ...], std: float, seed: int, name: str,
                 partition_dim: Optional[int] = None, rank: int = 0, world: int = 1) -> torch.Tensor:
    """Fill ``out`` with its part of a full N(0, std^2) tensor of ``full_shape`` keyed by (seed, name).

    ``out`` is the ``rank``-th of ``world`` equal slices along ``partition_dim`` (the whole tensor
    when None), on any device and in any dtype. The full tensor is drawn in blocks of rows, each
    from its own generator keyed by (seed, name, block), on the host one block at a time and
    copied into ``out``: neither the host nor the device ever holds the full tensor, and a
    parameter's values do not depend on how many tensor ranks split it, on which pipeline stage
    builds it, on build order, on the device, or on padding rows appended to it.
    """
    rows, row_shape = full_shape[0], tuple(full_shape[1:])
    block_rows = max(1, INIT_BLOCK_ELEMENTS // max(1, math.prod(row_shape)))
    first, end = (rank * rows // world, (rank + 1) * rows // world) if partition_dim == 0 else (0, rows)
    with torch.no_grad():
        for block in range(first // block_rows, -(-end // block_rows)):
            values = torch.empty((block_rows, *row_shape), dtype=torch.float32)
            values.normal_(0.0, std, generator=_block_generator(seed, name, block))
            start = block * block_rows
            lo, hi = max(start, first), min(start + block_rows, end)
            piece = values[lo - start:hi - start]
            if partition_dim not in (None, 0):
                piece = piece.chunk(world, dim=partition_dim)[rank]
            out[lo - first:hi - first].copy_(piece.to(out.device))
    return out


def deterministic_normal(shape: tuple[int, ...], std: float, seed: int, name: str,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full (unsplit) tensor ``init_normal_`` draws for (seed, name), on the host."""
    return init_normal_(torch.empty(shape, dtype=dtype), shape, std, seed, name)


def shard(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """The ``rank``-th of ``world`` contiguous equal slices of ``full`` along ``dim``."""
    return full.chunk(world, dim=dim)[rank].contiguous()
