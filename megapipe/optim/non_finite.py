"""A non-finite loss made to skip its step like a non-finite gradient, without a host read.

The optimizer skips an update whose gradient norm is NaN or Inf on every rank alike (the norm
is reduced over the model-parallel group, and the gradients over the data-parallel one). A
non-finite loss need not give non-finite gradients (cross-entropy's gradient does not depend on
the loss's value), so, under ``--check-for-nan-in-loss-and-grad``, the backward of such a loss is
multiplied by NaN: every gradient it reaches becomes NaN and the step is skipped everywhere. The
guard is two element-wise operations per microbatch on the device; nothing is read on the host.
"""

from __future__ import annotations

from typing import Callable

import torch


def poisoning_non_finite(scale_loss: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``scale_loss`` whose result, for a non-finite loss, makes the backward's gradients NaN."""
    def scale(loss: torch.Tensor) -> torch.Tensor:
        guard = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
        return scale_loss(loss) * guard
    return scale
