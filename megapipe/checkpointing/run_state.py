"""What a training checkpoint saves and restores, handed to checkpointing explicitly by the trainer.

Checkpointing reads nothing else: not the trainer, not module globals. Loading writes back into
``progress`` (where training stands), the engine's optimizer and in-flight microbatches, the
learning-rate schedule and the random generators of ``ps``.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Callable

import torch

from megapipe.config import Config
from megapipe.data.tokenizer import Tokenizer
from megapipe.optim.lr_schedule import LRScheduler
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine


@dataclasses.dataclass
class TrainState:
    """Where training stands, besides weights and optimizer."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0


@dataclasses.dataclass(frozen=True)
class RunState:
    """One rank's run as a checkpoint sees it."""

    kind: str  # "gpt" or "bert": a checkpoint of one is refused by the other
    config: Config
    ps: ParallelState
    device: torch.device
    chunks: list  # this rank's model chunks, in chunk order
    engine: PipelineEngine  # its optimizer, weight versions and the microbatches in flight
    scheduler: LRScheduler
    progress: TrainState
    timeout: datetime.timedelta  # of the background writer's collectives (--async-save)
    log: Callable[[str], None]  # the run's logger: messages for the user about what was loaded
    tokenizer: Tokenizer  # saved with every checkpoint, so generation and export need no flags
