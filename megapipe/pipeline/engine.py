"""One rank's share of pipelined training: model chunks, gradients, optimizer and schedule.

``PipelineEngine.train_batch(microbatches)`` runs the rank's action list for one batch; the
STEP action finalises gradients (data-parallel average, tied embedding, sequence parallel)
and updates the weights. The training loop, the benchmarks and the tests all drive
training through this one class.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch

from megapipe.optim import GradBuffers, OptimizerConfig, StepResult, build_optimizer, finalize_model_grads
from megapipe.parallel_state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.schedules import build_schedule
from megapipe.pipeline.schedules.forward_only import forward_only_schedule
from megapipe.pipeline.timeline import Timeline


@dataclass
class TrainStepResult:
    losses: list[float]  # per microbatch, on the last pipeline stage; empty elsewhere
    step: Optional[StepResult]
    peak_in_flight: int


class PipelineEngine:
    """Trains ``chunks`` (this rank's model chunks) with the named schedule."""

    def __init__(self, chunks: list[torch.nn.Module], ps: ParallelState, optimizer_config: OptimizerConfig,
                 schedule: str, num_microbatches: int, boundary_shape: tuple[int, ...],
                 dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                 scatter_gather: bool = True, timeout: datetime.timedelta = datetime.timedelta(seconds=300),
                 timeline: Optional[Timeline] = None):
        self.chunks, self.ps = chunks, ps
        self.schedule = build_schedule(schedule, ps.pp_size, num_microbatches, ps.virtual_pipeline)
        self.grads = GradBuffers(chunks, ps)
        self.optimizer = build_optimizer(chunks, optimizer_config, ps, self.grads)
        self._last_step: Optional[StepResult] = None
        self.executor = PipelineExecutor(chunks, ps, self.schedule, boundary_shape, dtype, device, step=self._step,
                                         scale_loss=self.optimizer.scale_loss, scatter_gather=scatter_gather,
                                         timeout=timeout, timeline=timeline)
        self.eval_executor = PipelineExecutor(chunks, ps, forward_only_schedule(ps.pp_size, num_microbatches,
                                                                                ps.virtual_pipeline),
                                              boundary_shape, dtype, device, step=lambda: None,
                                              scatter_gather=scatter_gather, timeout=timeout)

    def _step(self) -> None:
        finalize_model_grads(self.chunks, self.ps, self.grads)
        self._last_step = self.optimizer.step()
        self.optimizer.zero_grad()

    def train_batch(self, microbatches: list[dict]) -> TrainStepResult:
        for chunk in self.chunks:
            chunk.train()
        self._last_step = None
        result = self.executor.run(microbatches)
        return TrainStepResult(result.losses, self._last_step, result.peak_in_flight)

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict]) -> list[float]:
        """Per-microbatch losses (last stage; empty elsewhere) without dropout or gradients."""
        for chunk in self.chunks:
            chunk.eval()
        return self.eval_executor.run(microbatches).losses
