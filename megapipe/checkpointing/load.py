"""Loading a checkpoint written with any parallel layout: a whole training state, or weights only.

Order: find the checkpoint, read its JSON part and index, check that every shard file is
whole, decide what to load from the flags, check on every rank that the blocks it needs
exist with the right global shapes, read everything into fresh buffers, and only then copy
into the model, the optimizer, the schedule and the random generators.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megapipe.checkpointing.common import Common, SavedLayout, optimizer_family, plain
from megapipe.checkpointing.paths import LATEST, find_checkpoint
from megapipe.checkpointing.run_state import RunState
from megapipe.checkpointing.state import (LoadTargets, apply_optimizer, apply_rng, apply_weights, load_targets,
                                          param_entries, precision_optimizers)
from megapipe.checkpointing.storage import read_metadata, read_shards, saved_tensors
from megapipe.checkpointing.validate import agree_on_fit
from megapipe.config import ModelConfig
from megapipe.config.operations import same_path
from megapipe.errors import CheckpointError
from megapipe.optim.lr_schedule import schedule_source
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.in_flight import InFlight


def open_checkpoint(directory: str, kind: str) -> tuple[str, Common, dict]:
    """(checkpoint directory, its JSON part, its tensor index), or CheckpointError."""
    path = find_checkpoint(directory)
    if path is None:
        raise CheckpointError(f"{directory} holds no checkpoint: it has no {LATEST} and is not an iter_* "
                              "directory; check --load.")
    common = Common.read(path)
    if common.kind != kind:
        raise CheckpointError(f"checkpoint {path} holds a {common.kind.upper()} model, not {kind.upper()}.")
    return path, common, saved_tensors(read_metadata(path))


def _targets(source: str, common: Common, saved: dict, entries, ps: ParallelState, config: ModelConfig,
             with_optimizer: bool, with_rng: bool, with_in_flight: bool = False) -> LoadTargets:
    """This rank's buffers to read into, once every rank agreed that the checkpoint fits (collective)."""
    targets = load_targets(entries, saved, ps, config, with_optimizer, with_rng, with_in_flight)
    agree_on_fit(source, targets.shards, [entry.key(ps, config) for entry in entries], saved, common.model_config,
                 config)
    return targets


def load_weights(directory: str, kind: str, chunks, ps: ParallelState, config: ModelConfig) -> Common:
    """Load only the weights of a checkpoint into ``chunks`` (any layout; collective over all ranks)."""
    path, common, saved = open_checkpoint(directory, kind)
    targets = _targets(f"checkpoint {path}", common, saved, param_entries(chunks), ps, config, False, False)
    read_shards(targets.shards, path)
    apply_weights(targets)
    return common


def load_checkpoint(directory: str, run: RunState) -> None:
    """Load ``directory`` (``--load``) into ``run``, honouring --finetune / --no-load-optim / --no-load-rng.

    A directory that is also ``--save`` and holds no checkpoint yet starts the run from
    scratch, so one command line both starts and resumes a job (not with ``--skip-train``,
    which needs a checkpoint to evaluate).
    """
    t = run.config.training
    if same_path(directory, t.save) and not t.skip_train and (not os.path.isdir(directory)
                                                               or find_checkpoint(directory) is None):
        run.log(f"> no checkpoint in {directory} yet: starting from iteration 0")
        return
    started = time.perf_counter()
    path, common, saved = open_checkpoint(directory, run.kind)
    load_state(f"checkpoint {path}", common, saved, run, lambda shards: read_shards(shards, path), started)


def load_state(source: str, common: Common, saved: dict, run: RunState, read: Callable[[dict], None],
               started: float) -> None:
    """Load a training state into ``run`` (collective): ``common`` and ``saved`` (key -> the tensor's
    metadata) describe it, ``read(shards)`` fills this rank's blocks; ``source`` names it in messages
    (``checkpoint <path>``, or ``peer_memory``'s copies)."""
    with run.engine.whole_weights():  # optim_grads_params releases them between passes
        _load(source, common, saved, run, read, started)


def _load(source: str, common: Common, saved: dict, run: RunState, read: Callable[[dict], None],
          started: float) -> None:
    t = run.config.training
    with_optimizer = not (t.finetune or t.no_load_optim)
    layout = SavedLayout.of_run(run)
    restore_rng = not (t.finetune or t.no_load_rng) and common.has_rng and common.layout == layout
    has_in_flight = any(key.startswith("inflight/") for key in saved)
    drop_reason = _in_flight_mismatch(common, run, layout) if has_in_flight else None
    entries = param_entries(run.chunks, run.engine.optimizer)
    targets = _targets(source, common, saved, entries, run.ps, run.config.model, with_optimizer, restore_rng,
                       with_in_flight=has_in_flight and drop_reason is None)
    if with_optimizer:
        _check_optimizer_fits(source, common, run)
    read(targets.shards)

    apply_weights(targets, run.engine.optimizer)
    if with_optimizer:
        apply_optimizer(targets, run.engine.optimizer)
        if common.loss_scaler is not None:
            for optimizer in precision_optimizers(run.engine.optimizer):
                optimizer.loss_scaler.load_state_dict(common.loss_scaler)
    if not t.finetune:
        run.progress.iteration = common.iteration
        run.progress.consumed_samples = common.consumed_samples
        run.progress.skipped_iterations = common.skipped_iterations
        if with_optimizer:
            run.scheduler.load_state_dict(common.scheduler, _schedule_source(t))
        else:
            run.scheduler.step(common.iteration - run.scheduler.iteration)
    if targets.in_flight:  # replayed before the random states come back
        snapshot = InFlight.from_tensors(targets.in_flight, run.device)
        run.engine.restore_in_flight(snapshot)
        passes = torch.tensor([len(snapshot.forwards)], device=run.device)
        dist.all_reduce(passes)
        run.log(f"> continuing the pipeline as it was saved: {int(passes.item())} forward passes in "
                             "flight across the ranks, replayed on their weight versions")
    elif drop_reason is not None:
        run.log(f"> the microbatches in flight at the save are dropped ({drop_reason}): the pipeline "
                             "starts empty, without their updates")
    _restore_or_reseed_rng(run, targets.rng, common, layout, restore_rng)
    what = "weights and optimizer state" if with_optimizer else "weights only"
    run.log(f"> loaded {source} ({what}, written with {common.layout}) at iteration {common.iteration} in "
            f"{time.perf_counter() - started:.2f} s; continuing at iteration {run.progress.iteration} with {layout}")


def _in_flight_mismatch(common: Common, run: RunState, layout: SavedLayout) -> Optional[str]:
    """Why this run cannot continue the checkpoint's in-flight microbatches (they belong to one
    layout, schedule and batch split), or None when it can."""
    if run.config.training.finetune:
        return "--finetune"
    if common.layout != layout:
        return f"they belong to the layout {common.layout}, not {layout}"
    ours, theirs = plain(run.config), common.config
    for section, name in (("parallel", "pipeline_schedule"), ("parallel", "pipedream_vertical_sync"),
                          ("training", "micro_batch_size"), ("training", "global_batch_size")):
        if theirs[section][name] != ours[section][name]:
            return f"they belong to {section} {name} {theirs[section][name]}, not {ours[section][name]}"
    return None


def _check_optimizer_fits(source: str, common: Common, run: RunState) -> None:
    """Optimizer state, loss scaling and learning-rate schedule of the checkpoint suit this run."""
    fix = "load weights only with --no-load-optim (or --finetune)"
    if not common.has_optimizer:
        raise CheckpointError(f"{source} has no optimizer state (saved with --no-save-optim or imported); "
                              f"{fix}.")
    ours = optimizer_family(run.config.optimizer.optimizer)
    if common.optimizer_family != ours:
        raise CheckpointError(f"{source} holds {common.optimizer_family} optimizer state but this run uses "
                              f"{ours}; {fix}.")
    if (common.loss_scaler is None) != (precision_optimizers(run.engine.optimizer)[0].loss_scaler is None):
        raise CheckpointError(f"{source} was written {'with' if common.loss_scaler else 'without'} fp16 "
                              f"loss scaling and this run is the other way; resume with the same --fp16/--bf16 "
                              f"setting or {fix}.")
    if _schedule_source(run.config.training) == "match":  # raises, naming the flags that differ
        run.scheduler.check_matches(common.scheduler)


def _schedule_source(t) -> str:
    """--skip-train uses no learning rate, so it takes the checkpoint's schedule whatever the flags say."""
    if t.skip_train:
        return "checkpoint"
    return schedule_source(t.override_opt_param_scheduler, t.use_checkpoint_opt_param_scheduler)


def _restore_or_reseed_rng(run: RunState, rng: dict, common: Common, layout: SavedLayout, restore: bool) -> None:
    t = run.config.training
    if restore:
        apply_rng(rng, run.ps, run.device)
        return
    if t.finetune or t.no_load_rng:
        reason = "--finetune" if t.finetune else "--no-load-rng"
    elif not common.has_rng:
        reason = "the checkpoint has none"
    else:
        reason = f"they belong to the layout {common.layout}, not {layout}"
    seed = t.seed + run.progress.iteration
    run.ps.seed(seed, run.device)
    run.log(f"> random states not restored ({reason}): reseeded with --seed + iteration = {seed}")
