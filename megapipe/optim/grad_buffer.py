"""The main gradients of the model chunks one optimizer steps: one ``GradSync`` per chunk.

Each trainable parameter gets ``param.main_grad``, a view into its chunk's flat buffer (fp32
by default). A post-accumulate-grad hook adds ``param.grad`` into ``main_grad`` and frees
``param.grad`` as soon as autograd has produced it, so bf16/fp16 parameters accumulate across
microbatches in fp32 and only one low-precision gradient lives at a time. With
``gradient_accumulation_fusion`` (the default) the linears add their weight-gradient products
into ``main_grad`` themselves, in fp32 on devices that have such a product, where no
low-precision weight gradient is made at all (``tensor_parallel/grad_accumulation.py``).
Keeping a chunk's gradients in one buffer lets the data-parallel reduction run as a few large
collectives (buckets) instead of one per parameter; ``grad_sync.py`` holds the buckets, the
overlap with backward and the sharding levels.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from megapipe.optim.unit_weights import unit_of_parameters
from megapipe.optim.grad_sync import DEFAULT_BUCKET_SIZE, GradSync, ParamPiece, is_tied_embedding_copy
from megapipe.config.sharding import ShardingLevel
from megapipe.parallel.state import ParallelState


def trainable_params(model_chunks: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Parameters that require a gradient, across all chunks, each once, in registration order."""
    return [p for _, chunk_params in _params_by_chunk(model_chunks) for p in chunk_params]


def _params_by_chunk(model_chunks: Iterable[torch.nn.Module]) -> list[tuple[torch.nn.Module, list[torch.nn.Parameter]]]:
    """(chunk, the trainable parameters it holds that no earlier chunk holds), for the chunks that hold any."""
    seen: set[int] = set()
    out = []
    for chunk in model_chunks:
        params = []
        for param in chunk.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
        if params:
            out.append((chunk, params))
    return out


class GradBuffers:
    """The gradient syncs of one optimizer's chunks (all of a rank's chunks for a flush schedule,
    one chunk per optimizer for an asynchronous one), driven together."""

    def __init__(self, model_chunks: Iterable[torch.nn.Module], ps: ParallelState,
                 dtype: torch.dtype = torch.float32, bucket_size: int = DEFAULT_BUCKET_SIZE,
                 level: ShardingLevel = ShardingLevel(), overlap_grad_reduce: bool = False,
                 overlap_param_gather: bool = False, gradient_accumulation_fusion: bool = True):
        self.ps, self.level = ps, level
        by_chunk = _params_by_chunk(model_chunks)
        self.params = [p for _, params in by_chunk for p in params]
        self.syncs = [GradSync(params, ps, level, bucket_size, dtype, overlap_grad_reduce, overlap_param_gather,
                               gradient_accumulation_fusion, unit_of_parameters(chunk))
                      for chunk, params in by_chunk]
        # under the V placement the first and the last stage are chunks of one rank, each with a copy
        # of the tied word embedding: their gradients are summed here instead of over the embedding group
        self._tied_here = [p for p in self.params if is_tied_embedding_copy(p)]
        self._tied_summed = False

    @property
    def buffer(self) -> torch.Tensor:
        """The gradient buffer of a single-chunk optimizer (tests and simple loops)."""
        if len(self.syncs) != 1:
            raise ValueError(f"these gradient buffers span {len(self.syncs)} chunks; use .syncs[i].buffer")
        return self.syncs[0].buffer

    @property
    def device(self) -> torch.device:
        return self.syncs[0].buffer.device if self.syncs else torch.device("cpu")

    @property
    def buckets(self) -> list[torch.Tensor]:
        return [sync.buffer[b.start:b.end] for sync in self.syncs for b in sync.buckets]

    @property
    def pieces(self) -> list[ParamPiece]:
        return [piece for sync in self.syncs for piece in sync.pieces]

    def zero(self) -> None:
        """Clear every main gradient before the next batch's first microbatch."""
        for sync in self.syncs:
            sync.zero()
        self._tied_summed = False

    def start_data_parallel_reduce(self) -> None:
        """Start every reduction not yet started (only the first call after :meth:`zero` does anything)."""
        self._sum_tied_copies_here()
        for sync in self.syncs:
            sync.start_grad_sync()

    def finish_data_parallel_reduce(self) -> None:
        """Wait for the data-parallel average (starting what nobody started); tied-embedding and
        sequence-parallel sums included."""
        self.start_data_parallel_reduce()
        for sync in self.syncs:
            sync.finish_grad_sync()

    def _sum_tied_copies_here(self) -> None:
        """Give both copies of the tied embedding held by this rank their summed gradient (once per step),
        bit for bit the same, so the two copies stay equal after every update."""
        if len(self._tied_here) != 2 or self._tied_summed:
            return
        first, second = (param.main_grad for param in self._tied_here)
        total = first + second
        first.copy_(total)
        second.copy_(total)
        self._tied_summed = True

    def publish_weights(self) -> None:
        for sync in self.syncs:
            sync.publish_weights()

    @contextlib.contextmanager
    def whole_weights(self):
        """Inside, every chunk's weights are whole (gathered at ``optim_grads_params``), e.g. to save or compare them."""
        for sync in self.syncs:
            sync.gather_weights()
        try:
            yield
        finally:
            for sync in self.syncs:
                sync.release_weights()

    def gather_full(self, values: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Whole per-parameter tensors from one value per piece (``pieces`` order); collective over d."""
        out, start = {}, 0
        for sync in self.syncs:
            out.update(sync.gather_full(values[start:start + len(sync.pieces)]))
            start += len(sync.pieces)
        return out

    def held_bytes(self) -> dict[str, int]:
        totals = {"grads": 0, "weights": 0}
        for sync in self.syncs:
            for name, value in sync.held_bytes().items():
                totals[name] += value
        return totals
