"""Megatron-style iteration lines, and the same figures to Weights & Biases and TensorBoard.

Losses are printed with seven significant digits (``%.6E``) so that two runs can be compared
exactly from their logs.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

from megapipe.config import TrainingConfig
from megapipe.models.loss_parts import LM_LOSS
from megapipe.models.moe import moe_stats_scalars, moe_stats_text
from megapipe.optional import require


@dataclass
class IterationStats:
    iteration: int
    train_iters: int
    consumed_samples: int
    ms_per_iteration: float
    learning_rate: float
    global_batch_size: int
    losses: dict  # name -> value
    loss_scale: Optional[float]
    grad_norm: Optional[float]
    skipped_iterations: int
    nan_iterations: int
    tokens_per_second: float
    tflops_per_device: float
    mfu: Optional[float]
    memory_gib: float
    amended: Optional[list[int]] = None  # under post-validation: the iterations whose steps it redid
    moe: dict = field(default_factory=dict)  # MoE layer -> its routing statistics (``models/moe/stats.py``)
    extra: dict = field(default_factory=dict)

    def line(self) -> str:
        width = len(str(self.train_iters))
        parts = [f" iteration {self.iteration:>{width}}/{self.train_iters}",
                 f"consumed samples: {self.consumed_samples:>10}",
                 f"elapsed time per iteration (ms): {self.ms_per_iteration:.1f}",
                 f"learning rate: {self.learning_rate:.6E}",
                 f"global batch size: {self.global_batch_size:>5}"]
        parts += [f"{name}: {value:.6E}" for name, value in self.losses.items()]
        if self.loss_scale is not None:
            parts.append(f"loss scale: {self.loss_scale:.1f}")
        if self.grad_norm is not None:
            parts.append(f"grad norm: {self.grad_norm:.6f}")
        parts += [f"number of skipped iterations: {self.skipped_iterations:>3}",
                  f"number of nan iterations: {self.nan_iterations:>3}",
                  f"tokens/s: {self.tokens_per_second:.0f}",
                  f"TFLOP/s/device: {self.tflops_per_device:.3f}"]
        if self.mfu is not None:
            parts.append(f"MFU: {100 * self.mfu:.1f}%")
        parts.append(f"peak memory (GiB): {self.memory_gib:.2f}")
        if self.amended is not None:
            parts.append(f"amended steps: {amended_text(self.amended)}")
        if self.moe:
            parts.append(moe_stats_text(self.moe))
        return " | ".join(parts) + " |"

    def scalars(self) -> dict:
        values = {"learning-rate": self.learning_rate, "samples": self.consumed_samples,
                  "ms-per-iteration": self.ms_per_iteration, "tokens-per-second": self.tokens_per_second,
                  "tflops-per-device": self.tflops_per_device, "memory-gib": self.memory_gib,
                  "skipped-iterations": self.skipped_iterations}
        values.update(self.losses)
        values.update(moe_stats_scalars(self.moe))
        for name, value in (("loss-scale", self.loss_scale), ("grad-norm", self.grad_norm), ("mfu", self.mfu)):
            if value is not None:
                values[name] = value
        return values


def amended_text(iterations: list[int]) -> str:
    """The iterations whose steps post-validation redid, as the log lists them: ``3, 4`` or ``none``."""
    return ", ".join(map(str, iterations)) or "none"


def losses_in_log(text: str, name: str = LM_LOSS) -> dict[int, float]:
    """{iteration: loss} read back from the iteration lines of a training log (``IterationLog.line``)."""
    pattern = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?" + re.escape(name) + r": ([0-9.E+-]+)")
    return {int(i): float(value) for i, value in pattern.findall(text)}


class TrainLogger:
    """Prints on the one rank that holds the loss and mirrors to W&B / TensorBoard when asked."""

    def __init__(self, config: TrainingConfig, enabled: bool, run_config: dict):
        self.enabled = enabled
        self.wandb = None
        self.tensorboard = None
        if not enabled:
            return
        if config.wandb_project:
            wandb = require("wandb", "--wandb-project")
            os.environ.setdefault("WANDB_MODE", "offline")  # no network here: runs sync later with `wandb sync`
            self.wandb = wandb.init(project=config.wandb_project, name=config.wandb_exp_name,
                                    dir=config.wandb_save_dir, config=run_config)
        if config.tensorboard_dir:
            require("tensorboard", "--tensorboard-dir")
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=config.tensorboard_dir)

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def log(self, stats: IterationStats) -> None:
        if not self.enabled:
            return
        print(stats.line(), flush=True)
        self._scalars(stats.scalars(), stats.iteration, prefix="train/")

    def log_evaluation(self, split: str, iteration: int, losses: dict[str, float]) -> None:
        """Megatron's evaluation block: each loss (``lm loss``, BERT's ``sop loss``) with its perplexity."""
        if not self.enabled:
            return
        scalars, parts = {}, []
        for name, loss in losses.items():
            ppl = math.exp(min(20.0, loss))
            parts.append(f"{name} value: {loss:.6E} | {name} PPL: {ppl:.6E}")
            key = f"{split}-{name.replace(' ', '-')}"
            scalars.update({key: loss, f"{key}-ppl": ppl})
        text = f" {split} loss at iteration {iteration} | " + " | ".join(parts) + " |"
        bar = "-" * len(text)
        print(f"{bar}\n{text}\n{bar}", flush=True)
        self._scalars(scalars, iteration, prefix="eval/")

    def _scalars(self, values: dict, step: int, prefix: str) -> None:
        if self.wandb is not None:
            self.wandb.log({prefix + k: v for k, v in values.items()}, step=step)
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(prefix + key, value, step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
