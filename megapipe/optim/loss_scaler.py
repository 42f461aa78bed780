"""Loss scaling for fp16: keep small gradients representable, back off when they overflow.

The loss is multiplied by ``scale`` before backward and the gradients divided by it before
the update. ``DynamicLossScaler`` follows Megatron's rule: an overflow resets the growth count
and uses up one unit of hysteresis; once hysteresis is spent every overflow halves the scale
(never below the minimum); ``window`` overflow-free steps in a row double the scale and
restore the hysteresis.
"""

from __future__ import annotations

from typing import Optional

import torch

from megapipe.config.optimizer import OptimizerConfig


class _DeviceScale:
    """The scale as a tensor on the device the loss lives on (moved there at first use), so
    scaling, unscaling and updating never read it back to the host."""

    scale: torch.Tensor

    def scale_on(self, device: torch.device) -> torch.Tensor:
        if self.scale.device != device:
            self._move(device)
        return self.scale

    def _move(self, device: torch.device) -> None:
        self.scale = self.scale.to(device)


class ConstantLossScaler(_DeviceScale):
    """A fixed scale (``--loss-scale``): overflowing steps are still skipped, the scale never moves."""

    def __init__(self, scale: float):
        self.scale = torch.tensor(float(scale), dtype=torch.float32)

    def update(self, found_overflow: torch.Tensor) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": float(self.scale)}

    def load_state_dict(self, state: dict) -> None:
        self.scale = torch.tensor(float(state["scale"]), dtype=torch.float32, device=self.scale.device)


class DynamicLossScaler(_DeviceScale):
    """Megatron's dynamic scale: halve after ``hysteresis`` overflows, double after ``window`` clean steps.

    The counters live on the device next to the scale and ``update`` takes the overflow flag as a
    device tensor: the rule is applied with ``torch.where``, never by reading the flag.
    """

    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int):
        self.scale = torch.tensor(float(initial_scale), dtype=torch.float32)
        self.min_scale = float(min_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.clean_steps = torch.tensor(0, dtype=torch.int64)
        self.hysteresis_left = torch.tensor(hysteresis, dtype=torch.int64)

    def _move(self, device: torch.device) -> None:
        self.scale, self.clean_steps, self.hysteresis_left = (
            self.scale.to(device), self.clean_steps.to(device), self.hysteresis_left.to(device))

    def update(self, found_overflow: torch.Tensor) -> None:
        overflow = torch.as_tensor(found_overflow)
        self.scale_on(overflow.device)
        overflow = overflow.to(torch.bool)
        hysteresis_left = torch.where(overflow, self.hysteresis_left - 1, self.hysteresis_left)
        clean_steps = torch.where(overflow, 0, self.clean_steps + 1)
        scale = torch.where(overflow & (hysteresis_left <= 0), (self.scale / 2).clamp(min=self.min_scale), self.scale)
        grow = ~overflow & (clean_steps == self.window)
        self.scale = torch.where(grow, scale * 2, scale)
        self.clean_steps = torch.where(grow, 0, clean_steps)
        self.hysteresis_left = torch.where(grow, self.hysteresis, hysteresis_left)

    def state_dict(self) -> dict:
        return {"scale": float(self.scale), "clean_steps": int(self.clean_steps),
                "hysteresis_left": int(self.hysteresis_left)}

    def load_state_dict(self, state: dict) -> None:
        device = self.scale.device
        self.scale = torch.tensor(float(state["scale"]), dtype=torch.float32, device=device)
        self.clean_steps = torch.tensor(int(state["clean_steps"]), dtype=torch.int64, device=device)
        self.hysteresis_left = torch.tensor(int(state["hysteresis_left"]), dtype=torch.int64, device=device)


LossScaler = ConstantLossScaler | DynamicLossScaler


def build_loss_scaler(config: OptimizerConfig) -> Optional[LossScaler]:
    """The scaler fp16 needs (constant with ``--loss-scale``, else dynamic); None for bf16 and fp32."""
    if not config.fp16:
        return None
    if config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale)
    return DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
                             config.hysteresis)
