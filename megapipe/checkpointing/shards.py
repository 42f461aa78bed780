"""A rank's piece of a global tensor, and where each model tensor's piece sits.

A checkpoint stores every tensor under its canonical name with its global (whole-model,
vocabulary-unpadded) shape; each rank writes only the block it holds, at an offset. That
makes the files independent of the layout that wrote them: a run with another (t, p, d, v)
asks for its own blocks and the reader assembles them from whatever pieces were saved. Stacked
experts are stored under their global index: an expert rank's slice sits at ``ep_rank`` times its
experts along dimension 0, so a checkpoint loads at any expert-parallel size too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megapipe.config import ModelConfig
from megapipe.models.state_dict import VOCAB_DIM0, canonical_name
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.utils import is_expert_parallel, is_tensor_parallel, split_over


@dataclass
class Shard:
    """``local`` is the block of a ``global_shape`` tensor that starts at ``offsets``."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @staticmethod
    def whole(tensor: torch.Tensor) -> "Shard":
        """A tensor this rank holds in full (replicated, or unique to the rank)."""
        return Shard(tensor, tuple(tensor.shape), (0,) * tensor.dim())


def place(name: str, tensor: torch.Tensor, param: torch.Tensor, ps: ParallelState,
          config: ModelConfig) -> tuple[str, Optional[Shard]]:
    """Canonical key of a chunk's parameter ``name`` and the block of it that ``tensor`` holds.

    ``tensor`` is the parameter itself or anything of its shape (a master copy, an Adam
    moment). Tensor-parallel slices sit at ``tp_rank`` times their size along the split
    dimension; vocabulary padding is cut off, so a slice made only of padding holds nothing
    (``None``).
    """
    key = canonical_name(name, param)
    shape, offsets = list(tensor.shape), [0] * tensor.dim()
    rank, size, _ = split_over(param, ps)
    if size > 1:
        dim = param.partition_dim
        offsets[dim] = rank * tensor.shape[dim]
        shape[dim] = tensor.shape[dim] * size
    if is_expert_parallel(param) and ps.ep_size > 1:
        offsets[0] = ps.ep_rank * tensor.shape[0]
        shape[0] = tensor.shape[0] * ps.ep_size
    local = tensor
    if name in VOCAB_DIM0:
        shape[0] = config.vocab_size
        rows = min(tensor.shape[0], config.vocab_size - offsets[0])
        if rows <= 0:
            return key, None
        local = tensor.narrow(0, 0, rows)
    return key, Shard(local, tuple(shape), tuple(offsets))


def local_shape(name: str, global_shape: tuple[int, ...], param: torch.Tensor, tp_size: int,
                config: ModelConfig, ep_size: int, etp_size: int) -> tuple[int, ...]:
    """The shape a rank of a ``tp_size``-way tensor group (and ``ep_size``-way expert group, whose experts are
    split over ``etp_size`` ranks) holds for a global tensor (padding included)."""
    shape = list(global_shape)
    if is_expert_parallel(param):
        shape[0] //= ep_size
    if name in VOCAB_DIM0:
        shape[0] = config.padded_vocab_size(tp_size)
    if is_expert_parallel(param) and hasattr(param, "partition_dim"):
        shape[param.partition_dim] //= etp_size
    elif is_tensor_parallel(param) and tp_size > 1:
        shape[param.partition_dim] //= tp_size
    return tuple(shape)


def cut(name: str, whole: torch.Tensor, param: torch.Tensor, ps: ParallelState,
        config: ModelConfig) -> tuple[str, Optional[Shard]]:
    """The piece of the global tensor ``whole`` that the rank ``ps`` describes would hold (see :func:`place`)."""
    shape = local_shape(name, tuple(whole.shape), param, ps.tp_size, config, ps.ep_size, ps.etp_size)
    key, bounds = place(name, torch.empty(shape, device="meta"), param, ps, config)
    if bounds is None:
        return key, None
    block = whole[tuple(slice(o, o + n) for o, n in zip(bounds.offsets, bounds.local.shape))]
    return key, Shard(block, bounds.global_shape, bounds.offsets)
