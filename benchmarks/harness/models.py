"""Model and data of a paired run: copies of one model with the same weights, the same batches for
every system, and what each side needs to train them (megapipe's engine step; for PyTorch's
schedules a tensors-only stage, the rest of megapipe's GPT head as a loss, and megapipe's AdamW)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megapipe.models import build_model_chunks
from megapipe.models.sequence_loss import sequence_mean
from megapipe.optim import OptimizerConfig, trainable_params, weight_decay_groups
from megapipe.optim.optimizer import build_inner_optimizer
from megapipe.parallel.state import ParallelState
from megapipe.schedules.analysis.timeline import Timeline
from megapipe.pipeline.engine import PipelineEngine
from megapipe.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

from .settings import Settings


def same_weights(config, ps: ParallelState, reference: list[nn.Module]) -> list[nn.Module]:
    """This rank's chunks of a fresh GPT of ``config`` holding ``reference``'s weights."""
    chunks = build_model_chunks("gpt", config, ps)
    for copy, original in zip(chunks, reference):
        copy.load_state_dict(original.state_dict())
    return chunks


def adamw(**overrides) -> OptimizerConfig:
    """The pairings' optimizer: AdamW, lr 1e-3, weight decay 0.01, no clipping."""
    return OptimizerConfig(**{"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01, "clip_grad": 0.0, **overrides})


def batch(settings: Settings, step: int, replicas: int = 1, replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels ``[m * b, s]`` of one step for data-parallel ``replica`` of ``replicas``: each its
    own rows of a global batch drawn from the step's seed, so every rank agrees on it."""
    g = torch.Generator().manual_seed(step)
    rows = settings.num_microbatches * settings.micro_batch_size
    shape = (replicas * rows, settings.seq_length)
    tokens, labels = (torch.randint(0, settings.vocab_size, shape, generator=g) for _ in range(2))
    return tokens[replica * rows:(replica + 1) * rows], labels[replica * rows:(replica + 1) * rows]


def microbatches(tokens: torch.Tensor, labels: torch.Tensor, micro_batch_size: int) -> list[dict]:
    """A step's rows as megapipe's microbatches, every token counted in the loss."""
    return [{"tokens": t, "labels": y, "loss_mask": torch.ones_like(y, dtype=torch.float32)}
            for t, y in zip(tokens.split(micro_batch_size), labels.split(micro_batch_size))]


def step_microbatches(settings: Settings, step: int) -> list[dict]:
    """One step's microbatches (``batch`` split into ``micro_batch_size`` rows)."""
    return microbatches(*batch(settings, step), settings.micro_batch_size)


class MegapipeRunner:
    """One training step with megapipe's ``PipelineEngine``, recording its timeline when asked."""

    def __init__(self, chunks, ps: ParallelState, settings: Settings, schedule, optimizer: OptimizerConfig,
                 record_timeline: bool = False):
        self.settings = settings
        self.timeline = Timeline()
        self.engine = PipelineEngine(chunks, ps, optimizer, schedule, settings.num_microbatches,
                                     settings.activation_shape, timeline=self.timeline if record_timeline else None)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[float]:
        return self.engine.train_batch(microbatches(tokens, labels, self.settings.micro_batch_size)).losses


class TensorStage(nn.Module):
    """A megapipe stage as PyTorch's ``PipelineStage`` wants it: tensors in, tensors out.

    The first stage takes token ids, the others the previous stage's ``[s, b, h]`` output;
    the last stage returns its logits ``[b, s, V]`` and ``loss_fn`` below finishes the head.
    """

    def __init__(self, chunk: nn.Module):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunk.pre_process:
            return self.chunk(None, {"tokens": x})
        return self.chunk(x, {})


def make_loss_fn(ps: ParallelState):
    """The rest of megapipe's GPT head (cross-entropy, mean over tokens) for PyTorch's schedules."""
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = vocab_parallel_cross_entropy(logits.transpose(0, 1), labels.transpose(0, 1), ps.tp_group, 0)
        return sequence_mean(losses.transpose(0, 1), torch.ones_like(labels, dtype=torch.float32), ps)
    return loss_fn


def megapipe_adamw_for(chunks, config: OptimizerConfig, params: Optional[list] = None):
    """megapipe's own parameter groups and AdamW kernel over ``chunks`` (or ``params``), for the other side."""
    params = trainable_params(chunks) if params is None else params
    optimizer, _ = build_inner_optimizer(weight_decay_groups(params, params, config.weight_decay), config,
                                         torch.device("cpu"))
    return optimizer
