"""Finish a batch's gradients at the pipeline flush, before the optimizer step.

Three reductions turn each rank's local main gradients into the gradients of the whole model:
the data-parallel average, the sum of the tied word embedding's two copies (first and last
pipeline stage), and the sum over the tensor group of replicated parameters that saw only a
slice of the sequence (sequence parallelism).
"""

from __future__ import annotations

from typing import Iterable

import torch

from megapipe.collectives import all_reduce_coalesced
from megapipe.optim.grad_buffer import GradBuffers, trainable_params
from megapipe.parallel_state import ParallelState


def is_tied_embedding_copy(param: torch.Tensor) -> bool:
    """The first stage's word embedding (``tied_embedding``) or the last stage's copy (``shared_embedding``)."""
    return getattr(param, "tied_embedding", False) or getattr(param, "shared_embedding", False)


def reduce_tied_embedding_grads(params: list[torch.nn.Parameter], ps: ParallelState) -> None:
    """Sum the tied embedding's gradient over the first and last stage, so both copies step alike."""
    tied = [p.main_grad for p in params if is_tied_embedding_copy(p)]
    if ps.pp_size > 1 and tied:
        all_reduce_coalesced(tied, ps.embedding_group, len(ps.members["embedding"]))


def reduce_sequence_parallel_grads(params: list[torch.nn.Parameter], ps: ParallelState) -> None:
    """Sum over the tensor group the gradients of replicated params that each saw a sequence slice."""
    sliced = [p.main_grad for p in params if getattr(p, "sequence_parallel", False)]
    all_reduce_coalesced(sliced, ps.tp_group, ps.tp_size)


def finalize_model_grads(model_chunks: Iterable[torch.nn.Module], ps: ParallelState, grads: GradBuffers) -> None:
    """Average over data parallelism, then complete tied-embedding and sequence-parallel gradients."""
    grads.finish_data_parallel_reduce()
    params = trainable_params(model_chunks)
    reduce_tied_embedding_grads(params, ps)
    reduce_sequence_parallel_grads(params, ps)
