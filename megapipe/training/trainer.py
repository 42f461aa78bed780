"""The pretraining loop behind ``pretrain_gpt.py`` and ``pretrain_bert.py``.

``pretrain(kind, argv)`` resolves the flags into a ``RunPlan`` (every check before any process group), and
the ``Trainer`` of that plan joins the process group, builds the parallel state, this rank's model chunks, the pipeline engine
(optimizer included), the LR schedule and the data, then trains, evaluates, logs and
checkpoints. Every rank loads the same microbatches of its data-parallel slice; the losses
live on the last pipeline stage, which logs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from megapipe import fusions
from megapipe.cli.parse import parse_run
from megapipe.cli.resolve import with_vocabulary
from megapipe.checkpointing.run_state import RunState, TrainState
from megapipe.config import Config
from megapipe.config.run_plan import RunPlan
from megapipe.data.rank_data import BatchSource, build_rank_data, check_tokenizer_flags
from megapipe.data.splits import SPLIT_NAMES
from megapipe.errors import CheckpointError
from megapipe.fusions.fp8_mode import select_fp8
from megapipe.tensor_parallel.collective_matmul import use_symmetric_memory
from megapipe.tensor_parallel.column_input import overlap_tensor_parallel_communication
from megapipe.parallel import exposure
from megapipe.parallel.launch import count_synchronisations, device_name, init_distributed, peak_memory_gib
from megapipe.models.flops import device_peak_tflops
from megapipe.models import build_model_chunks
from megapipe.models.moe import moe_layer_stats
from megapipe.training.exits import ExitConditions
from megapipe.replicas.group import ReplicaLost
from megapipe.training.hang_watchdog import HangWatchdog
from megapipe.training.replica_steps import ReplicaSteps
from megapipe.training.sigterm import SigtermNotice
from megapipe.training.stragglers import StragglerCheck
from megapipe.checkpointing.paths import read_latest
from megapipe.optim import LRScheduler
from megapipe.parallel.state import ParallelState
from megapipe.schedules.analysis.schedule_search import comparison
from megapipe.cli.selection import stage_costs
from megapipe.pipeline.engine import PipelineEngine
from megapipe.training.counters import StepCounters, skip_reason
from megapipe.training.logger import IterationStats, TrainLogger, amended_text
from megapipe.training.non_finite import NonFiniteWatch
from megapipe.training.startup import startup_line, where_losses_are_logged
from megapipe.training.timeline_file import save_run_timeline
from megapipe.schedules.analysis.timeline import Timeline


class Trainer:
    """Owns one rank's engine, schedule, data iterators and logger for one run."""

    def __init__(self, plan: RunPlan, notice: Optional[SigtermNotice] = None):
        kind, config = plan.kind, plan.config
        self.kind = kind
        self.exit_conditions = ExitConditions(config, notice=notice)  # --exit-duration-in-mins counts from here
        self.timeout = timeout = plan.timeout  # of every collective, side groups' too
        self.device = init_distributed(timeout, plan.device)
        select_fp8(config.training.fp8_format, config.training.fp8_recipe, self.device)  # refused if it cannot run
        overlap_tensor_parallel_communication(config.parallel.async_tensor_model_parallel_allreduce)
        use_symmetric_memory(config.parallel.async_tensor_parallel, self.device)  # refused where it cannot run
        if config.training.cluster_lease and (not dist.is_initialized() or dist.get_rank() == 0):
            from megapipe.lease.client import ClusterLease

            self.exit_conditions.lease = ClusterLease(config.training.cluster_lease, self.exit_conditions.lag)
        par, t = config.parallel, config.training
        self.ps = ParallelState.build(plan.layout, plan.virtual_pipeline, timeout=timeout, placement=plan.placement,
                                      cp_comm_type=par.cp_comm_type)
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.watchdog = (HangWatchdog(self.ps.rank, dist.get_world_size(), t.hang_watchdog, t.hang_report).start()
                         if t.hang_watchdog and distributed else None)
        self.stragglers = (StragglerCheck(self.ps.pp_rank, t.straggler_check_interval, t.straggler_threshold)
                           if t.straggler_check_interval and distributed else None)
        eval_samples = t.eval_iters * t.global_batch_size
        self.data = build_rank_data(kind, config, self.ps, (0 if t.skip_train else t.train_iters * t.global_batch_size,
                                                             eval_samples, eval_samples))
        self.tokenizer = self.data.tokenizer
        self.plan = plan = with_vocabulary(plan, self.tokenizer.vocab_size)
        self.config = config = plan.config
        self.search = plan.search  # with --pipeline-schedule auto: what the search found
        self.ps.seed(t.seed, self.device)
        self.fusion_backend = fusions.select_backend(t.fusion_backend, self.device)
        self.m = plan.microbatches
        # a stage boundary holds this rank's s/c tokens of each sequence, split over t with sequence parallelism
        seq = config.model.seq_length // self.ps.cp_size // (par.tensor if par.sequence_parallel else 1)
        self.chunks = build_model_chunks(kind, config.model, self.ps, plan.layer_ranges, seed=t.seed,
                                         sequence_parallel=par.sequence_parallel, device=self.device,
                                         split_backward=plan.split_backward)
        # with --record-timeline: when each pipeline action ran, one row per pipeline rank
        self.timeline = Timeline(meta={"p": self.ps.pp_size, "v": self.ps.virtual_pipeline, "m": self.m}) \
            if t.record_timeline else None
        self.engine = PipelineEngine(self.chunks, self.ps, config.optimizer, plan.schedule, self.m,
                                     (seq, t.micro_batch_size, config.model.hidden_size),
                                     dtype=config.model.params_dtype, device=self.device,
                                     scatter_gather=par.scatter_gather_tensors_in_pipeline and not par.sequence_parallel,
                                     timeout=timeout, vertical_sync=par.pipedream_vertical_sync,
                                     timeline=self.timeline, skip_non_finite_loss=t.check_for_nan_in_loss_and_grad,
                                     overlap_moe_comm=par.overlap_moe_expert_parallel_comm,
                                     gradient_accumulation_fusion=config.model.gradient_accumulation_fusion)
        self.scheduler = LRScheduler(self.engine.optimizer, config.optimizer, t.train_iters)
        self.state = TrainState()
        self.saved_iteration: Optional[int] = None  # of the last checkpoint saved (or, asynchronous, started)
        self.counters, self.nan_iterations = StepCounters(self.device), 0
        # with --check-for-nan-in-loss-and-grad: the iterations whose loss or gradient norm was NaN/Inf
        self.watch = NonFiniteWatch(self.device, t.non_finite_action) if t.check_for_nan_in_loss_and_grad else None
        self.validated_iteration = 0  # the iteration of the last step counted (``_count``)
        self.save_seconds: Optional[float] = None  # how long the last checkpoint save took (``_checkpoint``)
        self.amended: list[int] = []  # under post-validation: the iterations whose steps it redid
        # BERT with its binary head trains on the sum and logs each part, as Megatron does
        self.loss_names = plan.family.losses(config.model)
        self.logs_loss = self.ps.rank == self.ps.loss_rank
        self.logger = TrainLogger(t, enabled=self.logs_loss, run_config=_plain(config))
        self.run_state = RunState(kind, config, self.ps, self.device, self.chunks, self.engine, self.scheduler,
                                  self.state, timeout, self.logger.print,
                                  self.tokenizer)  # what checkpoints save and load
        self.batches = BatchSource(self.data, self.ps, self.device, t.micro_batch_size, config.model.seq_length,
                                   self.m)
        # with --fault-tolerant-replicas: the quorum before each step, the gradients averaged across replicas
        self.replica_steps = ReplicaSteps(self) if t.fault_tolerant_replicas else None
        self.flops = plan.family.flops(config.model, t.global_batch_size,
                                                         recompute=config.model.recompute_granularity == "full")
        self.peak_tflops = t.device_peak_tflops or device_peak_tflops(device_name(self.device))

    # ---- loop ---------------------------------------------------------------------------------
    def train(self) -> None:
        t = self.config.training
        if t.load and not (self.peer_checkpoints is not None and self.peer_checkpoints.restore(t.load)):
            self.checkpointer.load(t.load)
        lease = self.exit_conditions.lease
        if lease is not None:
            lease.start(self.state.iteration)
        if self.logs_loss:
            self.logger.print(startup_line(
                self.kind, self.ps, self.engine.schedule.name, self.m, t.micro_batch_size,
                self.config.optimizer.sharding.strategy, _plain_value(self.config.model.params_dtype),
                f"{self.fusion_backend.name} ({self.fusion_backend.reason})", self.tokenizer.vocab_size,
                self.data.description()))  # a reader: it opens the dataset
        elsewhere = where_losses_are_logged(self.ps, int(os.environ.get("LOCAL_RANK", "0")), _ranks_per_node())
        if elsewhere:
            print(elsewhere, flush=True)
        if self.search is not None:
            costs_for = functools.partial(stage_costs, self.kind, self.config, self.ps.pp_size)
            limit = self.config.parallel.schedule_search.memory_limit or self.ps.pp_size
            self.logger.print("> --pipeline-schedule auto, predicted for the stage costs:\n" +
                              "\n".join(comparison(self.search, costs_for, limit)))
        if t.skip_train:
            self.logger.print(f"> --skip-train: evaluating the checkpoint of iteration {self.state.iteration}")
            self.evaluate("validation")
            self.evaluate("test")
            self._close()
            return
        reason = self.exit_conditions.reason_at_start(self.state.iteration)
        if reason is not None:  # nothing trained yet: the checkpoint loaded (if any) is where the run stands
            self.logger.print(f"exiting on {reason}")
            self._close()
            return
        batches = self.train_batches()
        while reason is None and self.state.iteration < t.train_iters:
            if self.replica_steps is not None:
                batches = self.replica_steps.before_step(batches)
            reason = self.train_iteration(batches)
        self._finish(reason)

    def train_batches(self) -> Iterator[list[dict]]:
        """The training batches from where the run stands; the logging window starts now."""
        self._window = _LogWindow(self._no_losses(), len(self.amended))
        self.validated_iteration = self.state.iteration
        return self.batches.batches("train", self.state.consumed_samples)

    def train_iteration(self, batches: Iterator[list[dict]]) -> Optional[str]:
        """Train on the next batch of ``batches`` (``train_batches``) and log where the interval says;
        unless the run stops here, evaluate and save where their intervals say. The reason to stop
        after this iteration (the same on every rank; ``_finish`` then saves), or None."""
        t = self.config.training
        if self.stragglers is not None:
            self.stragglers.begin()
        try:
            result = self.engine.train_batch(next(batches))
        except ReplicaLost as lost:  # only with --fault-tolerant-replicas: the step runs again (``replica_steps``)
            self.replica_steps.discard(lost)
            return None
        self.state.iteration += 1
        if self.stragglers is not None:
            self._check_stragglers()
        self.state.consumed_samples += t.global_batch_size
        self.scheduler.step()
        if self.watch is not None:
            self.watch.note_losses(self.state.iteration, result.batch.loss_tensors)
        self._count(result)
        self._window.losses += (self.loss_sums(result.batch) if self.replica_steps is None
                                else self.replica_steps.step_losses)
        self._window.iterations += 1
        if t.logs_after(self.state.iteration):
            self._log(result)
            self._window = _LogWindow(self._no_losses(), len(self.amended))
        reason = self.exit_conditions.reason(self.state.iteration)
        if reason is not None:  # the exit saves (``_finish``), in the time a preemption leaves
            return reason
        if self.state.iteration % t.eval_interval == 0:
            self.evaluate("validation")
        if self._saves_after(self.state.iteration):
            self._checkpoint(t.save)
        if t.local_checkpoint_interval and self.state.iteration % t.local_checkpoint_interval == 0:
            self._count(self.engine.settle())  # as for a disk checkpoint (``save``)
            self._count_steps()
            self.peer_checkpoints.save()
        return None

    def _check_stragglers(self) -> None:
        """Note this step and, at the check's interval, name the ranks slower than their peers (``stragglers.py``)."""
        self.stragglers.end()
        for sentence in self.stragglers.check(self.state.iteration):
            self.logger.print(f"straggler: {sentence}")
        lease = self.exit_conditions.lease
        if lease is not None:
            lease.stragglers = [straggler.to_json() for straggler in self.stragglers.current]

    def count_synchronisations(self, iterations: int, warmup: int = 1) -> int:
        """How often the host waits for the device in ``iterations`` training iterations (everything
        ``train_iteration`` does) after ``warmup`` iterations that make lazy state; 0 when the loop
        keeps its values on the device, as it must between log intervals. On a GPU CUDA's sync debug
        mode counts, on the CPU every host read of a tensor (``distributed.counting_synchronisations``).
        The iterations train the model from where the run stands; none of the counted ones may be
        a log, evaluation, save or exit iteration, whose host reads are meant::

            trainer = Trainer(parse_run("gpt", flags))   # e.g. --log-interval 100
            assert trainer.count_synchronisations(10) == 0
        """
        t = self.config.training
        first, last = self.state.iteration + warmup + 1, self.state.iteration + warmup + iterations
        for flag, interval in (("--log-interval", t.log_interval), ("--eval-interval", t.eval_interval),
                               ("--save-interval", t.save_interval if t.save else None),
                               ("--exit-interval", t.exit_interval)):
            if interval and (last // interval) * interval >= first:
                raise ValueError(f"{flag} {interval} falls within iterations {first}-{last}, whose host "
                                 f"synchronisations are counted; raise it above {last} or count fewer iterations.")
        if first <= t.train_iters <= last:
            raise ValueError(f"the last iteration, --train-iters {t.train_iters}, logs and falls within iterations "
                             f"{first}-{last}, whose host synchronisations are counted; raise --train-iters.")
        batches = self.train_batches()
        for _ in range(warmup):
            self.train_iteration(batches)
        return count_synchronisations(lambda: self.train_iteration(batches), iterations, self.device)

    def exposed_communication(self, iterations: int, warmup: int = 1) -> dict[str, float]:
        """Seconds per iteration in which this rank computed nothing while it waited on communication, per
        kind (tensor, context, expert, pipeline, data, other; ``parallel/exposure.py``), over ``iterations``
        training iterations after ``warmup`` ones; they train the model from where the run stands."""
        batches = self.train_batches()
        for _ in range(warmup):
            self.train_iteration(batches)
        with exposure.on_device(self.device):  # on a GPU the streams' stalls, read from CUDA events
            before = exposure.totals()
            for _ in range(iterations):
                self.train_iteration(batches)
            after = exposure.totals()
        return {kind: (seconds - before.get(kind, 0.0)) / iterations for kind, seconds in after.items()}

    def _saves_after(self, iteration: int) -> bool:
        """Whether ``--save-interval`` saves a checkpoint after ``iteration``."""
        t = self.config.training
        return bool(t.save and t.save_interval and iteration % t.save_interval == 0) and self._writes_checkpoints

    @property
    def _writes_checkpoints(self) -> bool:
        """Whether this run writes its disk checkpoints: of fault-tolerant replicas, only the quorum's first."""
        return self.replica_steps is None or self.replica_steps.saves

    def _finish(self, reason: Optional[str]) -> None:
        """End the run, at --train-iters (``reason`` None) or early on an exit condition.

        The last checkpoint is written unless this iteration just wrote one, or, on an early exit
        after SIGTERM, when a rank has less time left before SIGKILL (``--exit-signal-grace-seconds``)
        than the last save took (``ExitConditions.time_for``). Early, it is written
        before the pipeline drains, so that an asynchronous schedule's checkpoint keeps the
        microbatches in flight and a resumed run continues as if it never stopped; at the end
        the pipeline drains first (a post-validated step is validated too), so that the last
        checkpoint and the final evaluation see every update. An asynchronous save overlaps the
        final evaluation.
        """
        t = self.config.training
        if reason is None:
            self._count(self.engine.drain())
            self._count_steps()
        if t.save and self.saved_iteration != self.state.iteration and self._writes_checkpoints:
            self._checkpoint(t.save, last=True)
        if reason is None:
            if self.state.iteration % t.eval_interval:
                self.evaluate("validation")
            self.evaluate("test")
        else:
            self._count(self.engine.drain())
            self.logger.print(f"exiting on {reason}")
        self._report_amended()
        if t.save:
            self.checkpointer.wait()
        if self.peer_checkpoints is not None:
            self.peer_checkpoints.wait()
        if self.replica_steps is not None:
            self.replica_steps.close()
        self._close()

    def _close(self) -> None:
        """Complete the exit agreement, stop the hang watchdog, complete the weight gathers in flight, save the
        timeline, close the logger and give the cluster lease back."""
        self.exit_conditions.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.engine.complete_communication()
        if self.timeline is not None:
            self.timeline.meta["schedule"] = self.engine.schedule.name
            save_run_timeline(self.timeline, self.ps, self.config.training.record_timeline)
            self.logger.print(f"timeline of the training iterations written to {self.config.training.record_timeline}")
        self.logger.close()
        if self.exit_conditions.lease is not None:
            self.exit_conditions.lease.finish(self.state.iteration)

    @functools.cached_property
    def checkpointer(self):
        """Saves and loads ``run_state`` (made on first use: torch.distributed.checkpoint loads only when needed)."""
        from megapipe.checkpointing.save import Checkpointer

        return Checkpointer(self.run_state)

    @functools.cached_property
    def peer_checkpoints(self):
        """This rank's peer-memory checkpoints (``--local-checkpoint-interval``), or None."""
        t = self.config.training
        if not t.local_checkpoint_interval:
            return None
        from megapipe.checkpointing.peer_memory import PeerCheckpoints

        return PeerCheckpoints(self.run_state, t.local_checkpoint_dir, _ranks_per_node() or 1)

    def _checkpoint(self, directory: str, last: bool = False) -> None:
        """``save``, timed, unless a rank has less time left before SIGKILL (``--exit-signal-grace-seconds``
        after its SIGTERM) than the last save took: the previous checkpoint then stays. Without a save
        so far it is tried: one cut off by SIGKILL publishes nothing. Every rank calls it."""
        needed = self.save_seconds or 0.0
        if not self.exit_conditions.time_for(needed):
            latest = read_latest(directory)
            kept = "there is no earlier one" if latest is None else f"the checkpoint of iteration {latest} stays"
            self.logger.print(f"> no checkpoint at iteration {self.state.iteration}: less time is left before SIGKILL "
                              f"(--exit-signal-grace-seconds {self.config.training.exit_signal_grace_seconds:g}) "
                              f"than the last save took ({needed:.1f} s) and the exit; {kept}")
            return
        started = time.monotonic()
        self.save(directory, last)
        self.save_seconds = time.monotonic() - started

    def save(self, directory: str, last: bool = False) -> None:
        """Save a checkpoint of this iteration. A failed save (this one, or the asynchronous one before it)
        stops the run, or with --no-exit-on-save-failure is warned and the next save tries again; the
        ``last`` save of a run has no next one, so its failure stops the run either way."""
        self._count(self.engine.settle())  # a post-validated step is validated (and redone if needed) first
        self._count_steps()  # the checkpoint's train state counts every skipped iteration so far
        retry = not (last or self.config.training.exit_on_save_failure)
        self._saving(self.checkpointer.wait, retry)  # the asynchronous save before this one ends (or fails) here
        if self._saving(lambda: self.checkpointer.save(directory), retry):
            self.saved_iteration = self.state.iteration

    def _saving(self, step, retry: bool) -> bool:
        """Run a step of saving; whether it succeeded (a failure raises unless ``retry``)."""
        try:
            step()
            return True
        except CheckpointError as error:
            if not retry:
                raise
            self.logger.print(f"warning: {error} Training goes on (--no-exit-on-save-failure): the next save tries "
                              "again.")
            return False

    def _no_losses(self) -> torch.Tensor:
        """Per loss name (rows): [sum, count] on the device; read once per log interval (no host sync per step)."""
        return torch.zeros(len(self.loss_names), 2, dtype=torch.float64, device=self.device)

    def loss_sums(self, batch) -> torch.Tensor:
        """A call's microbatch losses as ``_no_losses`` rows: under their names when the model reports parts,
        else under the first name."""
        sums = self._no_losses()
        if batch.part_tensors:
            for row, name in enumerate(self.loss_names):
                sums[row, 0] = torch.stack([parts[name] for parts in batch.part_tensors]).double().sum()
                sums[row, 1] = len(batch.part_tensors)
        elif batch.loss_tensors:
            sums[0, 0] = torch.stack(batch.loss_tensors).double().sum()
            sums[0, 1] = len(batch.loss_tensors)
        return sums

    def _data_parallel_means(self, totals: torch.Tensor, across_replicas: bool) -> dict[str, float]:
        """Per name, the mean of ``totals`` (``_no_losses`` rows, summed in place) over all data-parallel ranks
        (last stage), and over the replicas when ``across_replicas`` (the training losses are summed over them
        with each step's gradients, ``replica_steps``)."""
        if self.ps.is_last_stage and self.ps.dp_size > 1:
            dist.all_reduce(totals, group=self.ps.dp_group)
        if across_replicas and self.logs_loss and not self.replica_steps.sum_(totals):
            self.logger.print("> replicas: a replica was lost during the evaluation: its losses are this "
                              "replica's share of the batches only")
        means = totals[:, 0] / totals[:, 1].clamp(min=1)
        return dict(zip(self.loss_names, means.tolist()))

    def _count(self, result) -> None:
        """Add the steps that became final in an engine call to the device counters (no host read),
        one per iteration in order, and note the iterations whose steps post-validation redid."""
        for step in result.settled:
            self.counters.add(step)
            self.validated_iteration += 1
            if self.watch is not None:
                self.watch.note_step(self.validated_iteration, step)
            if step.amended:
                self.amended.append(self.validated_iteration)

    def _report_amended(self) -> None:
        """Under post-validation, the run's summary of the steps it redid."""
        if self.engine.validation is not None:
            self.logger.print(f"post-validation amended {len(self.amended)} of {self.validated_iteration} steps: "
                              f"iterations {amended_text(self.amended)}")

    def _count_steps(self, last_step=None) -> None:
        """Read the device counters of skipped and NaN iterations into the train state; with
        --check-for-nan-in-loss-and-grad, say which iteration went NaN/Inf where (or stop there)."""
        message = self.watch.read() if self.watch is not None else None
        if message:
            self.logger.print(message)
        skipped, nan = self.counters.read()
        self.state.skipped_iterations += skipped
        self.nan_iterations += nan
        if skipped and last_step is not None:
            self.logger.print(f"skipped {skipped} iteration(s) up to iteration {self.state.iteration}: "
                              f"{skip_reason(last_step, self.engine.optimizer.loss_scale)}")

    def _log(self, result) -> None:
        t = self.config.training
        self._count_steps(result.step)
        losses = self._data_parallel_means(self._window.losses, across_replicas=False)
        seconds = (time.time() - self._window.start) / self._window.iterations
        tflops = self.flops / seconds / self.ps.world_size / 1e12
        step = result.step
        self.logger.log(IterationStats(
            iteration=self.state.iteration, train_iters=t.train_iters, consumed_samples=self.state.consumed_samples,
            ms_per_iteration=1000 * seconds, learning_rate=self.scheduler.lr, global_batch_size=t.global_batch_size,
            losses=losses, loss_scale=self.engine.optimizer.loss_scale,
            grad_norm=None if step is None or step.grad_norm is None else float(step.grad_norm),
            skipped_iterations=self.state.skipped_iterations, nan_iterations=self.nan_iterations,
            tokens_per_second=t.global_batch_size * self.config.model.seq_length / seconds,
            tflops_per_device=tflops, mfu=tflops / self.peak_tflops if self.peak_tflops else None,
            memory_gib=peak_memory_gib(self.device),
            amended=self.amended[self._window.amended_from:] if self.engine.validation is not None else None,
            moe=self._moe_stats()))

    def _moe_stats(self) -> dict:
        """Every pipeline stage's MoE routing statistics by layer (collective over the pipeline group)."""
        if self.config.model.num_experts is None:
            return {}
        own = moe_layer_stats(self.chunks)
        if self.ps.pp_size == 1:
            return own
        stages = [None] * self.ps.pp_size
        dist.all_gather_object(stages, own, group=self.ps.pp_group)
        return {layer: stats for stage in stages for layer, stats in stage.items()}

    def evaluate(self, split: str) -> Optional[dict[str, float]]:
        """Mean losses (by name) over ``--eval-iters`` global batches of ``split`` ("validation" or "test");
        logged with perplexity. None when the split is empty."""
        data_split = "valid" if split == "validation" else split
        if not self.data.split_exists[SPLIT_NAMES.index(data_split)]:
            return None
        t = self.config.training
        batches = self.batches.batches(data_split)
        named = self._no_losses()
        for _ in tqdm(range(t.eval_iters), desc=f"{split}", disable=not self.logs_loss, leave=False):
            result = self.engine.evaluate(next(batches))
            named += self.loss_sums(result)
        losses = self._data_parallel_means(named, across_replicas=self.replica_steps is not None)
        self.logger.log_evaluation(split, self.state.iteration, losses)
        return losses


@dataclasses.dataclass
class _LogWindow:
    """The iterations since the last log line: per loss name [sum, count] (a device tensor), where the amended
    iterations noted since start (``Trainer.amended[amended_from:]``), start time, count."""

    losses: torch.Tensor
    amended_from: int
    start: float = dataclasses.field(default_factory=time.time)
    iterations: int = 0


def _plain_value(value):
    """A configuration value as plain data: a dtype by its name (``bfloat16``), anything else as it is."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def _plain(config: Config) -> dict:
    """The run's configuration as plain values (for W&B and checkpoints)."""
    return {section: {k: _plain_value(v) for k, v in dataclasses.asdict(getattr(config, section)).items()}
            for section in ("model", "parallel", "data", "training", "optimizer")}


def _ranks_per_node():
    """torchrun's processes per node (``LOCAL_WORLD_SIZE``), or None outside torchrun."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else None


def pretrain(kind: str, argv: Optional[list[str]] = None, notice: Optional[SigtermNotice] = None) -> Trainer:
    plan = parse_run(kind, argv, world_size=int(os.environ.get("WORLD_SIZE", "1")), ranks_per_node=_ranks_per_node())
    check_tokenizer_flags(plan.config)
    trainer = Trainer(plan, notice)
    trainer.train()
    return trainer
