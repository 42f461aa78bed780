"""Loss scaling for fp16: keep small gradients representable, back off when they overflow.

The loss is multiplied by ``scale`` before backward and the gradients divided by it before
the update. ``DynamicLossScaler`` follows Megatron's rule: an overflow resets the growth count
and uses up one unit of hysteresis; once hysteresis is spent every overflow halves the scale
(never below the minimum); ``window`` overflow-free steps in a row double the scale and
restore the hysteresis.
"""

from __future__ import annotations

from typing import Optional

from megapipe.optim.config import OptimizerConfig


class ConstantLossScaler:
    """A fixed scale (``--loss-scale``): overflowing steps are still skipped, the scale never moves."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """Megatron's dynamic scale: halve after ``hysteresis`` overflows, double after ``window`` clean steps."""

    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.clean_steps = 0
        self.hysteresis_left = hysteresis

    def update(self, found_overflow: bool) -> None:
        if found_overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])


LossScaler = ConstantLossScaler | DynamicLossScaler


def build_loss_scaler(config: OptimizerConfig) -> Optional[LossScaler]:
    """The scaler fp16 needs (constant with ``--loss-scale``, else dynamic); None for bf16 and fp32."""
    if not config.fp16:
        return None
    if config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale)
    return DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
                             config.hysteresis)
