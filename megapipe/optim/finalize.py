"""Finish a batch's gradients at the pipeline flush, before the optimizer step.

Three reductions turn each rank's local main gradients into the gradients of the whole model:
the data-parallel average, the sum of the tied word embedding's two copies (first and last
pipeline stage), and the sum over the tensor group of replicated parameters that saw only a
slice of the sequence (sequence parallelism). Each chunk's ``GradSync`` runs all three for
its own parameters (``grad_sync.py``), so this waits for them.
"""

from __future__ import annotations

from typing import Iterable

import torch

from megapipe.optim.grad_buffer import GradBuffers
from megapipe.parallel.state import ParallelState


def finalize_model_grads(model_chunks: Iterable[torch.nn.Module], ps: ParallelState, grads: GradBuffers) -> None:
    """Complete the data-parallel average and the tied-embedding and sequence-parallel sums of ``grads``."""
    grads.finish_data_parallel_reduce()
