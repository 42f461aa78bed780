"""Contiguous main-gradient buffers: accumulate every microbatch's gradient in one flat tensor.

Each trainable parameter gets ``param.main_grad``, a view into one flat buffer (fp32 by
default). A post-accumulate-grad hook adds ``param.grad`` into ``main_grad`` and frees
``param.grad`` as soon as autograd has produced it, so bf16/fp16 parameters accumulate across
microbatches in fp32 and only one low-precision gradient lives at a time. Keeping every
gradient in one buffer lets the data-parallel all-reduce run as a few large collectives
(buckets) instead of one per parameter.
"""

from __future__ import annotations

from typing import Iterable

import torch

from megapipe.collectives import all_reduce
from megapipe.parallel_state import ParallelState

DEFAULT_BUCKET_SIZE = 40_000_000  # elements per data-parallel all-reduce, Megatron's default


def trainable_params(model_chunks: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Parameters that require a gradient, across all chunks, each once, in registration order."""
    seen: set[int] = set()
    params = []
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def bucket_boundaries(sizes: list[int], bucket_size: int) -> list[tuple[int, int]]:
    """Split consecutive tensors of ``sizes`` elements into ``[start, end)`` element ranges.

    A bucket closes after the tensor that brings it to ``bucket_size`` elements or more, so no
    tensor straddles two buckets and every bucket but the last holds at least ``bucket_size``.
    """
    bounds, start, end = [], 0, 0
    for size in sizes:
        end += size
        if end - start >= bucket_size:
            bounds.append((start, end))
            start = end
    if end > start or not bounds:
        bounds.append((start, end))
    return bounds


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


def _common_device(params: list[torch.nn.Parameter]) -> torch.device | None:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"model chunks of one rank hold parameters on several devices {sorted(map(str, devices))}; "
                         "move them to one device before building gradient buffers.")
    return devices.pop() if devices else None


class GradBuffers:
    """The main gradients of one rank's model chunks, with data-parallel averaging.

    Parameters are laid out in reverse registration order, roughly the order in which
    backward produces their gradients, so the first bucket is the first one complete.
    """

    def __init__(self, model_chunks: Iterable[torch.nn.Module], ps: ParallelState,
                 dtype: torch.dtype = torch.float32, bucket_size: int = DEFAULT_BUCKET_SIZE):
        self.ps = ps
        self.params = trainable_params(model_chunks)
        layout = list(reversed(self.params))
        self.buffer = torch.zeros(sum(p.numel() for p in layout), dtype=dtype, device=_common_device(layout))
        offset = 0
        for param in layout:
            param.main_grad = self.buffer[offset:offset + param.numel()].view_as(param)
            offset += param.numel()
        self.buckets = [self.buffer[start:end]
                        for start, end in bucket_boundaries([p.numel() for p in layout], bucket_size)]
        self._pending_reduces: list = []
        self._reduced = False  # True once this batch's gradients have been averaged
        for param in self.params:
            param.register_post_accumulate_grad_hook(_accumulate_into_main_grad)

    def zero(self) -> None:
        """Clear every main gradient before the next batch's first microbatch."""
        if self._pending_reduces:
            raise RuntimeError("zero() called while a data-parallel gradient all-reduce is in flight; "
                               "call finish_data_parallel_reduce() first.")
        self.buffer.zero_()
        self._reduced = False

    def start_data_parallel_reduce(self) -> None:
        """Begin averaging the buffer over the data-parallel group, one async all-reduce per bucket.

        Gradients are divided by d before a sum (Megatron's default), which keeps fp32 sums of
        large replicas in range and needs no AVG support from the backend. Only the first call
        after :meth:`zero` does anything, so the caller may start early and finalize later.
        """
        if self._reduced:
            return
        self._reduced = True
        if self.ps.dp_size == 1:
            return
        self.buffer.mul_(1.0 / self.ps.dp_size)
        self._pending_reduces = [all_reduce(bucket, self.ps.dp_group, self.ps.dp_size, async_op=True)
                                 for bucket in self.buckets]

    def finish_data_parallel_reduce(self) -> None:
        """Wait for the averaging started earlier, starting it first if nobody did."""
        self.start_data_parallel_reduce()
        for work in self._pending_reduces:
            work.wait()
        self._pending_reduces = []
