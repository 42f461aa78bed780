"""Activation recomputation: keep a block's input, run it again in the backward pass.

``checkpoint(run, ps, *inputs)`` saves only the inputs; the backward pass restores the random
streams of the forward (the CPU and accelerator default generators and the tensor-parallel
dropout stream of ``ps.rng_tracker``), runs the block again and differentiates it, so the
recomputed dropout masks are the forward's and the gradients are bit-for-bit those without
recomputation. (An explicit autograd function rather than ``torch.utils.checkpoint``: its
saved tensors are ordinary ones, visible to saved-tensor hooks and memory accounting.)

Which layers: ``full`` granularity with method ``uniform`` checkpoints groups of
``recompute_num_layers`` consecutive layers (seed 002 4.3.5: c = l / group checkpoints hold
c A_input, one group's intermediates (l / c) A_intermediate are live in the backward);
``block`` checkpoints the first ``recompute_num_layers`` layers of the stage one by one and
keeps the rest. ``selective`` keeps every layer's matrix-product and attention outputs and recomputes
only norms, activations and dropout masks (``models/selective.py``).
"""

from __future__ import annotations

import torch

from megapipe.config import ModelConfig
from megapipe.parallel.state import ParallelState
from megapipe.parallel.random import capture_rng, restore_rng


class _Recompute(torch.autograd.Function):
    """Forward without keeping intermediates; backward runs the block again, then differentiates it."""

    @staticmethod
    def forward(ctx, run, ps, *inputs):
        ctx.run, ctx.ps, ctx.device = run, ps, inputs[0].device
        ctx.forward_rng = capture_rng(ps.rng_tracker, ctx.device)
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return run(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        now = capture_rng(ctx.ps.rng_tracker, ctx.device)
        restore_rng(ctx.forward_rng, ctx.ps.rng_tracker, ctx.device)  # the same dropout masks as the forward
        with torch.enable_grad():
            output = ctx.run(*inputs)
        restore_rng(now, ctx.ps.rng_tracker, ctx.device)
        torch.autograd.backward(output, grad_output)
        return (None, None) + tuple(x.grad if x.requires_grad else None for x in inputs)


def checkpoint(run, ps: ParallelState, *inputs: torch.Tensor) -> torch.Tensor:
    """``run(*inputs)`` (one tensor out) keeping only ``inputs``; recomputed in the backward pass."""
    return _Recompute.apply(run, ps, *inputs)


def recompute_groups(config: ModelConfig, num_layers: int) -> list[tuple[int, int, bool]]:
    """Split a stage's ``num_layers`` layers into ``(start, end, recompute)`` runs (local indices)."""
    if config.recompute_granularity != "full":
        return [(0, num_layers, False)]
    size = config.recompute_num_layers or 1
    if config.recompute_method == "block":
        size = min(size, num_layers)
        return [(i, i + 1, True) for i in range(size)] + ([(size, num_layers, False)] if size < num_layers else [])
    return [(i, min(i + size, num_layers), True) for i in range(0, num_layers, size)]

