"""One rank's share of pipelined training: model chunks, gradients, optimizer, weight versions, schedule.

``PipelineEngine.train_batch(microbatches)`` runs one call of the rank's program for one batch
of m microbatches. With a flush schedule the STEP action finalises gradients (data-parallel
average, tied embedding, sequence parallel) and updates the weights. With an asynchronous
schedule (PipeDream, 2BW) every chunk is a stage with its own optimizer, which each UPDATE
steps on its own: gradients are averaged over the stage's replicas and the norm and overflow
check cover the stage only, since meeting the other stages would be a flush. The pipeline
then stays full between calls; ``drain()`` empties it (at the end of training; ``evaluate``
drains first), and a checkpoint records what is in flight instead (``in_flight``). With
optimizer post-validation (``optim/post_validation.py``) a flush's STEP steps eagerly, reads
the verdict on the previous step, and when that step is amended the batch runs again
(``train_batch``); ``settle`` validates the last step. The training loop, the benchmarks and
the tests all drive training through this one class.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Optional, Union

import torch

from megapipe.errors import ConfigError
from megapipe.models.moe import main_loss_gradient_scale, set_aux_loss_scale, update_expert_biases
from megapipe.optim import GradBuffers, OptimizerConfig, StepResult, build_optimizer, finalize_model_grads
from megapipe.optim.grad_sync import GradSync
from megapipe.optim.non_finite import poisoning_non_finite
from megapipe.optim.passes import SyncPasses
from megapipe.optim.post_validation import PostValidation
from megapipe.parallel.state import ParallelState
from megapipe.schedules.actions import Schedule
from megapipe.pipeline.executor import BatchResult, PipelineExecutor
from megapipe.pipeline.in_flight import InFlight
from megapipe.pipeline.optimizer_group import OptimizerGroup
from megapipe.schedules.program import FlushProgram, PeriodicProgram
from megapipe.schedules.catalog import build_schedule, overlapped_schedule, schedule_descriptor
from megapipe.schedules.catalog.forward_only import forward_only_schedule
from megapipe.schedules.analysis.timeline import Timeline
from megapipe.schedules.weight_policy import WeightPolicy
from megapipe.pipeline.weights import WeightVersionStore
from megapipe.parallel.random import capture_rng, restore_rng
from megapipe.config.schema import COLLECTIVE_TIMEOUT


@dataclass
class TrainStepResult:
    """One call's losses (per microbatch the last stage forwarded; none on other stages), kept on
    the device in ``batch`` and read as numbers through ``losses`` and ``loss_parts``."""

    batch: BatchResult
    step: Optional[StepResult]  # the last optimizer step of this call on this rank, if any
    peak_in_flight: int
    updates: list[StepResult] = field(default_factory=list)  # every step of this call (one per UPDATE)
    # what the training loop counts, one per iteration: the call's last step, or under
    # post-validation the earlier eager step validated in this call (its full state, or its redo)
    settled: list[StepResult] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return self.batch.losses

    @property
    def loss_parts(self) -> list[dict[str, float]]:
        return self.batch.parts


@lru_cache(maxsize=32)
def periodic_program(name: str, p: int, m: int, v: int, replicas: Optional[tuple[int, ...]],
                     vertical_sync: bool) -> PeriodicProgram:
    """The (cached) program of an asynchronous schedule: building one replays a few unrolled forms."""
    return PeriodicProgram(name, p, m, v, replicas, vertical_sync)


class PipelineEngine:
    """Trains ``chunks`` (this rank's model chunks) with the named schedule.

    ``vertical_sync`` applies to ``pipedream``; a state built from a stage plan with replicated
    stages (``ps.stage_replicas``) gives 1F1B-RR. ``versions_used`` (a dict) records the weight
    version of every pass, as in ``PipelineExecutor``. ``skip_non_finite_loss``: a NaN/Inf loss skips
    its step like a NaN/Inf gradient (``optim/non_finite.py``). ``overlap_moe_comm``
    (``--overlap-moe-expert-parallel-comm``): the schedule's forward/backward pairs run overlapped, one
    microbatch's expert all-to-all beside the other's compute (``schedules/overlap.py``).
    ``gradient_accumulation_fusion``: the linears add their weight-gradient products into the main
    gradients themselves (``tensor_parallel/grad_accumulation.py``).

    Its inputs are a checked run's (``megapipe.cli.resolve``: a ``RunPlan``); it checks none of them again.
    """

    def __init__(self, chunks: list[torch.nn.Module], ps: ParallelState, optimizer_config: OptimizerConfig,
                 schedule: Union[str, Schedule], num_microbatches: int, boundary_shape: tuple[int, ...],
                 dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                 scatter_gather: bool = True, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
                 timeline: Optional[Timeline] = None, vertical_sync: bool = False,
                 versions_used: Optional[dict] = None, skip_non_finite_loss: bool = False,
                 overlap_moe_comm: bool = False, gradient_accumulation_fusion: bool = True):
        self.chunks, self.ps = chunks, ps
        named = isinstance(schedule, str)
        policy = schedule_descriptor(schedule).weight_policy if named else WeightPolicy.SINGLE  # a file flushes
        asynchronous = policy is not WeightPolicy.SINGLE
        sizes = (ps.pp_size, num_microbatches, ps.virtual_pipeline)
        if overlap_moe_comm:
            built = schedule if isinstance(schedule, Schedule) else build_schedule(schedule, *sizes)
            schedule = overlapped_schedule(built)
        if isinstance(schedule, Schedule):
            self.program = FlushProgram(schedule)
            self._groups = [(chunks, ps)]
        elif asynchronous:
            self.program = periodic_program(schedule, *sizes, ps.stage_replicas, vertical_sync)
            stage_ps = ps.stage_view()
            self._groups = [([chunk], stage_ps) for chunk in chunks]
        else:
            self.program = FlushProgram(build_schedule(schedule, *sizes, replicas=ps.stage_replicas,
                                                       vertical_sync=vertical_sync))
            self._groups = [(chunks, ps)]
        self.schedule = self.program.schedule
        if self.schedule.placement is not ps.placement:
            wanted = self.schedule.placement.value
            raise ConfigError(f"--pipeline-schedule {self.schedule.name} places its stages {wanted}, but the model "
                              f"chunks were built for the {ps.placement.value} placement; build the ParallelState "
                              f"with placement={wanted!r}.")
        params_dtype = next(p.dtype for chunk in chunks for p in chunk.parameters())
        self.grads = [GradBuffers(group, group_ps, optimizer_config.grad_dtype(params_dtype),
                                  optimizer_config.bucket_size(ps.dp_cp_size), optimizer_config.sharding,
                                  optimizer_config.overlap_grad_reduce, optimizer_config.overlap_param_gather,
                                  gradient_accumulation_fusion)
                      for group, group_ps in self._groups]
        self.optimizers = [build_optimizer(group, optimizer_config, group_ps, grads)
                           for (group, group_ps), grads in zip(self._groups, self.grads)]
        self.optimizer = self.optimizers[0] if len(self.optimizers) == 1 else OptimizerGroup(self.optimizers)
        self.stores = [WeightVersionStore(chunk, policy) for chunk in chunks]
        self._steps: list[StepResult] = []
        self._settled: list[StepResult] = []
        self.validation = None  # with --enable-optimizer-post-validation (``optim/post_validation.py``)
        if optimizer_config.enable_optimizer_post_validation:
            self.validation = PostValidation(self.optimizer, ps, timeout)
        self._redo_iteration = False  # the previous step is being amended: this call's list runs again
        # with --fault-tolerant-replicas: averages the gradients with the other replicas before each step, or
        # raises when one is lost (``replicas/group.py``)
        self.replica_sync: Optional[Callable[[GradBuffers], None]] = None
        scale_loss = self.optimizer.scale_loss
        if skip_non_finite_loss:
            scale_loss = poisoning_non_finite(scale_loss)
        self._executor_args = dict(boundary_shape=boundary_shape, dtype=dtype, device=device,
                                   scatter_gather=scatter_gather, timeout=timeout)
        self._train_args = dict(step=self._step, update=self._update, scale_loss=scale_loss, timeline=timeline,
                                stores=self.stores, versions_used=versions_used, overlap_pairs=overlap_moe_comm)
        self._build_executors(num_microbatches)

    def _build_executors(self, m: int) -> None:
        """The training and evaluation executors of ``self.program`` for batches of ``m`` microbatches."""
        ps, chunks = self.ps, self.chunks
        self.passes = SyncPasses([self._sync_of(chunk) for chunk in chunks], self.program.loss_divisor, chunks)
        self.executor = PipelineExecutor(chunks, ps, self.program, **self._executor_args, **self._train_args,
                                         passes=self.passes)
        evaluation = forward_only_schedule(ps.pp_size, m, ps.virtual_pipeline, replicas=ps.stage_replicas,
                                           placement=ps.placement)
        self.eval_executor = PipelineExecutor(chunks, ps, evaluation, **self._executor_args, step=lambda: None,
                                              passes=self.passes)

    def use_microbatches(self, m: int) -> None:
        """Run batches of ``m`` microbatches from now on, or start the current size afresh after a discarded
        step (``discard_step``): the flush schedule rebuilt for m; model, gradients and optimizer kept.
        Fault-tolerant replicas call it when their number changes (``replicas/``)."""
        schedule = build_schedule(self.schedule.name, self.ps.pp_size, m,
                                  self.ps.virtual_pipeline)
        self.program = FlushProgram(overlapped_schedule(schedule) if self._train_args["overlap_pairs"] else schedule)
        self.schedule = self.program.schedule
        self._build_executors(m)

    def discard_step(self) -> None:
        """Forget the step that was running when ``replica_sync`` raised: its gradients are cleared and the
        optimizer did not step; ``use_microbatches`` must follow before the next batch."""
        self._steps = []
        self.optimizer.zero_grad()
        self.passes.updated(list(range(len(self.chunks))))

    def complete_communication(self) -> None:
        """Wait for the data-parallel weight gathers still in flight (``--overlap-param-gather`` leaves
        the last step's to the next forward), so that no work is pending when the run's groups close;
        every other message and collective is completed where it was issued."""
        for sync in self.syncs:
            sync.wait_for_weights()

    def _sync_of(self, chunk: torch.nn.Module) -> Optional[GradSync]:
        """The gradient sync that owns ``chunk``'s parameters (None when it trains none)."""
        params = {id(p) for p in chunk.parameters()}
        return next((sync for grads in self.grads for sync in grads.syncs if id(sync.params[0]) in params), None)

    @property
    def syncs(self) -> list[GradSync]:
        """Every chunk's gradient sync on this rank."""
        return [sync for grads in self.grads for sync in grads.syncs]

    def whole_weights(self):
        """A context in which every chunk's weights are whole (``optim_grads_params`` releases them between passes)."""
        return _all_whole(self.grads)

    def _step(self) -> Optional[StepResult]:
        if self.validation is None:
            return self._update(0)
        finalize_model_grads(self.chunks, self.ps, self.grads[0])
        if self._settle():  # the weights this list ran on are being amended: no step, the list runs again
            self._redo_iteration = True
            return None
        result = self.validation.step()
        self._after_step(0, result)
        return result

    def _update(self, group: int) -> StepResult:
        """Finalise the gradients of one optimizer's chunks (all of them for a flush) and step it."""
        chunks, group_ps = self._groups[group]
        finalize_model_grads(chunks, group_ps, self.grads[group])
        if self.replica_sync is not None:
            self.replica_sync(self.grads[group])
        result = self.optimizers[group].step()
        self._after_step(group, result)
        return result

    def _after_step(self, group: int, result: StepResult) -> None:
        self.optimizers[group].zero_grad()
        update_expert_biases(self._groups[group][0], self._groups[group][1].dp_cp_group)
        self.passes.updated([self.chunks.index(chunk) for chunk in self._groups[group][0]])
        self._steps.append(result)

    def _settle(self) -> bool:
        """Post-validation: read the verdict on the last eager step and redo it if needed (True then)."""
        amend, validated = self.validation.settle()
        if amend:
            validated = self.validation.redo()._replace(amended=True)
            self.optimizer.zero_grad()
            self.passes.updated(list(range(len(self.chunks))))
        if validated is not None:
            self._settled.append(validated)
        return amend

    def settle(self) -> TrainStepResult:
        """Make the weights final: under post-validation, validate (and redo if needed) the last
        eager step; before a checkpoint, an evaluation or the end of training. Collective."""
        if self.validation is not None:
            self._settle()
        return self._result(BatchResult([], 0))

    def _result(self, batch) -> TrainStepResult:
        steps, self._steps = self._steps, []
        settled, self._settled = (self._settled, []) if self.validation is not None else (steps[-1:], [])
        return TrainStepResult(batch, steps[-1] if steps else None, batch.peak_in_flight, steps, settled)

    def train_batch(self, microbatches: list[dict]) -> TrainStepResult:
        """Run one batch. Under post-validation, when its STEP finds the previous eager step
        amended, its forwards ran on weights that are gone: it runs again on the same
        microbatches and random states, and every message of the first run was matched."""
        for chunk in self.chunks:
            chunk.train()
        rng = capture_rng(self.ps.rng_tracker, self.executor.p2p.device) if self.validation is not None else None
        scale = main_loss_gradient_scale(self.optimizer.scale_loss, self.program.loss_divisor, self.executor.p2p.device)
        for chunk in self.chunks:  # the MoE routers' auxiliary losses get the main loss's gradient scale
            set_aux_loss_scale(chunk, scale)
        batch = self.executor.run(microbatches)
        if self._redo_iteration:
            self._redo_iteration = False
            self._steps = []
            restore_rng(rng, self.ps.rng_tracker, self.executor.p2p.device)
            batch = self.executor.run(microbatches)
        return self._result(batch)

    def drain(self) -> TrainStepResult:
        """Finish the microbatches still in flight (asynchronous schedules) and, under
        post-validation, validate the last step: afterwards the weights are final."""
        if self.validation is not None:
            self._settle()
        return self._result(self.executor.drain())

    def in_flight(self) -> Optional[InFlight]:
        """This rank's share of an asynchronous pipeline's state between batches (a checkpoint
        holds it, so a resumed run continues the same trajectory); None when the pipeline is empty.
        Collective over the pipeline ranks."""
        snapshot = self.executor.in_flight()
        if snapshot is not None:
            snapshot.grads = [sync.grad_state() for sync in self.syncs]
        return snapshot

    def restore_in_flight(self, snapshot: InFlight) -> None:
        """Continue from ``in_flight``'s record (after the weights and optimizer state are loaded)."""
        for chunk in self.chunks:
            chunk.train()
        for sync, saved in zip(self.syncs, snapshot.grads):
            sync.load_grad_state(saved)
        self.executor.restore_in_flight(snapshot)

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict]) -> BatchResult:
        """Per-microbatch losses and their parts (last stage; empty elsewhere) without dropout or gradients.

        An asynchronous pipeline is drained first, so evaluation sees every update applied and
        no training message is in flight between the ranks.
        """
        if self.executor.calls:
            with torch.enable_grad():
                self.drain()
        if self.validation is not None:  # evaluate final weights; the outcome is reported with the next call's
            self._settle()
        for chunk in self.chunks:
            chunk.eval()
        return self.eval_executor.run(microbatches)


@contextlib.contextmanager
def _all_whole(grads: list[GradBuffers]):
    with contextlib.ExitStack() as stack:
        for buffers in grads:
            stack.enter_context(buffers.whole_weights())
        yield
