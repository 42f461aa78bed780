"""Learning-rate schedule with Megatron's meaning of the flags, counted in iterations.

The rate rises linearly from 0 to ``--lr`` over the warm-up (``--lr-warmup-iters``, or
``--lr-warmup-fraction`` of the decay iterations), then follows ``--lr-decay-style`` down to
``--min-lr`` at ``--lr-decay-iters`` (default: the training iterations) and stays there.
Iteration 0 of a warm-up uses rate 0, as in Megatron. ``inverse-square-root`` is
``lr * sqrt(warmup) / sqrt(iteration)``, floored at ``--min-lr``. Weight decay stays constant.
Without either warm-up flag the warm-up is min(50, decay iterations / 10): it moves with the decay
only, so a run whose decay ``--lr-decay-iters`` pins keeps its whole schedule when ``--train-iters``
grows on resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megapipe.errors import CheckpointError, ConfigError
from megapipe.config.optimizer import OptimizerConfig


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate as a pure function of the iteration."""

    max_lr: float
    min_lr: float
    style: str
    warmup_iters: float  # fractional when given by --lr-warmup-fraction, as in Megatron
    decay_iters: int

    @staticmethod
    def from_config(config: OptimizerConfig, train_iters: int) -> "LRSchedule":
        decay_iters = config.lr_decay_iters if config.lr_decay_iters is not None else train_iters
        if decay_iters < 1:
            raise ConfigError(f"--lr-decay-iters (or --train-iters) {decay_iters} must be at least 1.")
        if config.lr_warmup_fraction is not None:
            warmup = config.lr_warmup_fraction * decay_iters
        elif config.lr_warmup_iters is not None:
            warmup = config.lr_warmup_iters
        else:  # unset: a tenth of the decay, at most 50 iterations
            warmup = min(50, decay_iters // 10)
        if warmup >= decay_iters:
            raise ConfigError(f"the warm-up of {warmup:g} iterations must be shorter than --lr-decay-iters "
                              f"{decay_iters}; shorten the warm-up or decay for longer.")
        return LRSchedule(config.lr, config.min_lr, config.lr_decay_style, warmup, decay_iters)

    def lr_at(self, iteration: int) -> float:
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if iteration > self.decay_iters:
            return self.min_lr
        if self.style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * math.sqrt(max(self.warmup_iters, 1)) / math.sqrt(max(iteration, 1)))
        progress = (iteration - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.style == "linear":
            coefficient = 1.0 - progress
        else:  # cosine
            coefficient = 0.5 * (math.cos(math.pi * progress) + 1.0)
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)


class LRScheduler:
    """Sets the learning rate of every param group of ``optimizer`` for the current iteration.

    Call :meth:`step` once after each optimizer step (skipped steps included, as Megatron does).
    """

    def __init__(self, optimizer, config: OptimizerConfig, train_iters: int):
        self.optimizer = optimizer
        self.schedule = LRSchedule.from_config(config, train_iters)
        self.iteration = 0
        self._apply()

    @property
    def lr(self) -> float:
        return self.schedule.lr_at(self.iteration)

    def step(self, increment: int = 1) -> None:
        self.iteration += increment
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "schedule": vars(self.schedule).copy()}

    def load_state_dict(self, state: dict, source: str = "match") -> None:
        """Resume at the saved iteration with the schedule ``source`` picks, as Megatron does:
        ``"match"`` (default) the flags' schedule, which must equal the checkpoint's; ``"flags"``
        (--override-opt-param-scheduler) the flags' schedule; ``"checkpoint"``
        (--use-checkpoint-opt-param-scheduler) the checkpoint's."""
        if source == "checkpoint":
            self.schedule = LRSchedule(**state["schedule"])
        elif source == "match":
            self.check_matches(state)
        self.iteration = state["iteration"]
        self._apply()

    def check_matches(self, state: dict) -> None:
        """Raise CheckpointError when the checkpoint's schedule differs from the flags', naming every flag
        that moved and the flags that restore the checkpoint's values."""
        saved = LRSchedule(**state["schedule"])
        moved = [name for name in SCHEDULE_FLAGS if getattr(saved, name) != getattr(self.schedule, name)]
        if not moved:
            return
        changes = ", ".join(f"{SCHEDULE_FLAGS[name]} {_text(getattr(saved, name))} -> "
                            f"{_text(getattr(self.schedule, name))}" for name in moved)
        restore = " ".join(_restoring_flag(name, saved) for name in moved)
        # a moved decay is most often a longer --train-iters: the user is extending the run
        follow = "to resume and extend the run on the flags' schedule" if "decay_iters" in moved else \
            "to follow the flags' schedule"
        raise CheckpointError(f"the learning-rate schedule differs from the checkpoint's ({changes}; --train-iters "
                              "sets the decay unless --lr-decay-iters does, and the decay sets the default warm-up); "
                              f"{follow}, add --override-opt-param-scheduler; to keep the checkpoint's schedule, "
                              f"resume with {restore} or add --use-checkpoint-opt-param-scheduler.")


SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "style": "--lr-decay-style",
                  "warmup_iters": "--lr-warmup-iters", "decay_iters": "--lr-decay-iters"}
"""The flag that sets each field of ``LRSchedule``."""


def _text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _restoring_flag(name: str, saved: LRSchedule) -> str:
    """The flag and value that give ``saved``'s field ``name`` back (a fractional warm-up as a fraction)."""
    value = getattr(saved, name)
    if name == "warmup_iters" and not float(value).is_integer():
        return f"--lr-warmup-fraction {value / saved.decay_iters:g}"
    return f"{SCHEDULE_FLAGS[name]} {_text(int(value) if name == 'warmup_iters' else value)}"


def schedule_source(override_opt_param_scheduler: bool, use_checkpoint_opt_param_scheduler: bool) -> str:
    """The ``source`` of :meth:`LRScheduler.load_state_dict` that Megatron's two flags choose."""
    if override_opt_param_scheduler:
        return "flags"
    return "checkpoint" if use_checkpoint_opt_param_scheduler else "match"
