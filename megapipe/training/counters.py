"""Skipped and NaN iterations counted on the device, read once per log interval.

An optimizer step leaves its outcome on the device (``StepResult``); reading it every iteration
would stall the device queue once per step, so the training loop adds the flags up here and
reads the sums when it logs or saves.
"""

from __future__ import annotations

from typing import Optional

import torch


class StepCounters:
    """Running device sums of skipped updates and of NaN/inf gradient norms (fp16 overflows aside)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sums = torch.zeros(2, dtype=torch.int64, device=device)

    def add(self, step) -> None:
        """Count one ``StepResult`` (None: the call ran no step on this rank)."""
        if step is None:
            return
        bad_norm = ~torch.isfinite(step.norm) & ~step.overflow_flag
        self._sums += torch.stack([step.skipped_flag, bad_norm]).to(torch.int64)

    def read(self) -> tuple[int, int]:
        """(skipped, nan) since the last read; one host read for both."""
        skipped, nan = self._sums.tolist()
        self._sums.zero_()
        return skipped, nan


def skip_reason(step, loss_scale: Optional[float]) -> str:
    """Why the last update of a window was skipped (or what the window's skips were), as the log says it."""
    if loss_scale is None:
        return f"non-finite gradient (grad norm {float(step.norm)})"
    return f"gradient overflow, loss scale now {loss_scale}"
