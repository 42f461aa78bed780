"""Parameter bookkeeping shared by the tensor-parallel layers, the optimizer and checkpoints.

A parameter split across the tensor group carries ``tensor_model_parallel = True`` and the
dimension it is split along (``partition_dim``); every other parameter is a replica on each
tensor rank. ``shared_embedding`` marks the last stage's copy of a tied word embedding (its
gradient is summed with the first stage's, and a global norm counts it once).
Stacked experts carry ``expert_parallel`` and their ``partition_dim``, split over the expert-tensor
group, which is the tensor group at the default expert-tensor size (``split_over``).
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


def mark_expert_parallel(param: torch.nn.Parameter) -> None:
    """``param`` is one expert rank's slice (along dimension 0) of stacked experts."""
    param.expert_parallel = True


def is_expert_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "expert_parallel", False)


def split_over(param: torch.Tensor, ps) -> tuple[int, int, object]:
    """(rank, size, group) of the ranks whose slices of ``param`` along ``param.partition_dim`` make it whole:
    the expert-tensor group (``--expert-tensor-parallel-size``) for stacked experts, the tensor group for other
    tensor-parallel parameters; (0, 1, None) for a parameter held whole."""
    if is_expert_parallel(param) and hasattr(param, "partition_dim"):
        return ps.etp_rank, ps.etp_size, ps.etp_group
    if is_tensor_parallel(param):
        return ps.tp_rank, ps.tp_size, ps.tp_group
    return 0, 1, None


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "tensor_model_parallel", False)


def is_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True for the copies of a replicated parameter on tensor ranks other than 0."""
    return not is_tensor_parallel(param) and tp_rank > 0


# Values drawn at a time. On the host 256 KiB of fp32: every parameter draws at least one whole
# block, so a block much larger than a small parameter costs time, and memory the C allocator keeps
# for the process once freed (with 16 MiB blocks a test process that built dozens of small models
# grew by gigabytes). On an accelerator 16 MiB: drawing there takes microseconds and the caching
# allocator reuses the block, so few large blocks keep the build to a few hundred kernel launches
# (host-drawn 256 KiB blocks, each copied synchronously, took 11 s for GPT-1.3B on an H100).
HOST_BLOCK_ELEMENTS = 1 << 16
DEVICE_BLOCK_ELEMENTS = 1 << 22


def _draw_device(device: torch.device) -> torch.device:
    """Where the values of a parameter on ``device`` are drawn: there, unless it is the host or has
    no data (meta tensors of the fake device take host-drawn values, as a CPU run does)."""
    return torch.device("cpu") if device.type in ("cpu", "meta") else device


def _block_generator(seed: int, name: str, block: int, device: torch.device) -> torch.Generator:
    key = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()[:8]
    return torch.Generator(device=device).manual_seed(int.from_bytes(key, "little") & ((1 << 63) - 1))


def init_normal_(out: torch.Tensor, full_shape: tuple[int, ...], std: float, seed: int, name: str,
                 partition_dim: Optional[int] = None, rank: int = 0, world: int = 1,
                 rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Fill ``out`` with its part of a full N(0, std^2) tensor of ``full_shape`` keyed by (seed, name).

    ``out`` is the ``rank``-th of ``world`` equal slices along ``partition_dim`` (the whole tensor
    when None), in any dtype, of the rows ``[rows[0], rows[1])`` when given (an expert rank's slice
    of stacked experts, with ``partition_dim`` not 0). The full tensor is drawn in blocks of rows,
    each from its own generator keyed by (seed, name, block), one block at a time on ``out``'s device (on the host for
    CPU and meta tensors) and copied into ``out``: no device ever holds the full tensor, and on a
    given device a parameter's values do not depend on how many tensor ranks split it, on which
    pipeline stage builds it, on build order, or on padding rows appended to it. Devices draw
    different values (each has its own generator), so a model is the same function for every
    (t, p, v) on one device, and checkpoints carry the values between devices.
    """
    draw = _draw_device(out.device)
    row_shape = tuple(full_shape[1:])
    block_elements = HOST_BLOCK_ELEMENTS if draw.type == "cpu" else DEVICE_BLOCK_ELEMENTS
    block_rows = max(1, block_elements // max(1, math.prod(row_shape)))
    first, end = rows or ((rank * full_shape[0] // world, (rank + 1) * full_shape[0] // world) if partition_dim == 0
                          else (0, full_shape[0]))
    with torch.no_grad():
        values = torch.empty((block_rows, *row_shape), dtype=torch.float32, device=draw)
        for block in range(first // block_rows, -(-end // block_rows)):
            values.normal_(0.0, std, generator=_block_generator(seed, name, block, draw))
            start = block * block_rows
            lo, hi = max(start, first), min(start + block_rows, end)
            piece = values[lo - start:hi - start]
            if partition_dim not in (None, 0):
                piece = piece.chunk(world, dim=partition_dim)[rank]
            out[lo - first:hi - first].copy_(piece)
    return out


def shard(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """The ``rank``-th of ``world`` contiguous equal slices of ``full`` along ``dim``."""
    return full.chunk(world, dim=dim)[rank].contiguous()
