"""The canonical (whole-model, unsplit, unpadded) state dict and its per-rank slices.

The canonical form is what a t=1, e=1, p=1 model would hold, with the vocabulary trimmed to its
real size and the tied output copy dropped; it does not depend on the layout that made it.
``local_state_dict`` cuts the slice one model chunk holds under a given layout (padding the
vocabulary for that tensor size, keeping this expert rank's experts); ``gather_tensor_parallel``
rebuilds a full tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.utils import is_expert_parallel, is_tensor_parallel, shard

WORD_EMBEDDING = "embedding.word_embeddings.weight"
VOCAB_DIM0 = {WORD_EMBEDDING, "output_embedding.weight", "lm_bias"}


def canonical_name(local_name: str, param: torch.Tensor) -> str:
    """The canonical key of a chunk's parameter (the tied copy maps to the word embedding)."""
    if local_name == "output_embedding.weight" and getattr(param, "shared_embedding", False):
        return WORD_EMBEDDING
    return local_name


def _pad_vocab(tensor: torch.Tensor, padded: int) -> torch.Tensor:
    extra = padded - tensor.shape[0]
    return F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, extra)) if extra > 0 else tensor


def local_state_dict(canonical: dict, chunk: torch.nn.Module, ps: ParallelState, config: ModelConfig) -> dict:
    """The state dict ``chunk`` (built under ``ps``) needs, cut from a canonical state dict."""
    params = dict(chunk.named_parameters())
    out = {}
    for name, current in chunk.state_dict().items():
        param = params.get(name, current)
        full = canonical[canonical_name(name, param)]
        if name in VOCAB_DIM0:
            full = _pad_vocab(full, config.padded_vocab_size(ps.tp_size))
        if is_expert_parallel(param):  # the experts are stacked along dimension 0, ep_rank's block here
            full = shard(full, 0, ps.ep_rank, ps.ep_size)
        if is_tensor_parallel(param):
            full = shard(full, param.partition_dim, ps.tp_rank, ps.tp_size)
        out[name] = full.to(dtype=current.dtype, device=current.device)
    return out


def gather_tensor_parallel(tensor: torch.Tensor, param: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """The full tensor (e.g. a weight or its gradient) from every tensor rank's slice."""
    if not is_tensor_parallel(param) or ps.tp_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(ps.tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=ps.tp_group)
    return torch.cat(parts, dim=param.partition_dim)


def gather_experts(tensor: torch.Tensor, param: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Every expert rank's experts of an expert-parallel tensor, stacked along dimension 0 in expert order."""
    if not is_expert_parallel(param) or ps.ep_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(ps.ep_size)]
    dist.all_gather(parts, tensor.contiguous(), group=ps.ep_group)
    return torch.cat(parts)


def canonical_tensor(name: str, tensor: torch.Tensor, param: torch.Tensor, ps: ParallelState,
                     config: ModelConfig) -> tuple[str, torch.Tensor]:
    """Gather a chunk's tensor over the tensor and expert groups and trim vocabulary padding."""
    full = gather_experts(gather_tensor_parallel(tensor, param, ps), param, ps)
    if name in VOCAB_DIM0:
        full = full[: config.vocab_size]
    return canonical_name(name, param), full


def canonical_state_dict(chunks, ps: ParallelState, config: ModelConfig) -> dict:
    """This rank's part of the canonical state dict (collective over the tensor and expert groups)."""
    out = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for name, tensor in chunk.state_dict().items():
            key, full = canonical_tensor(name, tensor, params.get(name, tensor), ps, config)
            out[key] = full.detach().clone()
    return out
