"""Flags to a ``RunPlan``: every check knowable before a process group exists, made once.

``resolve_run`` checks the combination of flags against the world size (the layout, the model's split,
the schedule and what it can run, the optimizer, context and expert parallelism, the kernels) and returns
the run's plan; the Trainer and the engine read that plan and check nothing again. ``with_vocabulary``
finishes it once the tokenizer has given the vocabulary: ``--pipeline-schedule auto`` with a profile
searches then, since the profile must match the model it prices.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megapipe.cli.fault_tolerance import check_fault_tolerant_replicas
from megapipe.cli.selection import AUTO, check_profile, check_search_flags, searched_schedule
from megapipe.config.notes import tell
from megapipe.config.operations import validate_operations
from megapipe.config.run_plan import RunPlan
from megapipe.config.schema import Config
from megapipe.config.unread import check_unread_flags
from megapipe.context_parallel import check_context_parallel
from megapipe.errors import ConfigError
from megapipe.fusions.fp8_mode import check_fp8_flags
from megapipe.layout.nodes import check_nodes
from megapipe.layout.run_layout import run_layout
from megapipe.models.compiled_layers import check_compiled_layers
from megapipe.models.families import family_of
from megapipe.models.flops import check_device_peak
from megapipe.parallel.launch import default_device
from megapipe.schedules.actions import Schedule
from megapipe.schedules.catalog import build_schedule, overlapped_schedule, schedule_descriptor
from megapipe.schedules.overlap import check_overlap_flags
from megapipe.schedules.schedule_file import load_training_schedule


def resolve_run(kind: str, config: Config, world_size: int, ranks_per_node: Optional[int] = None) -> RunPlan:
    """The plan of ``config`` run on ``world_size`` processes, every flag checked; one sentence per mistake.

    ``ranks_per_node`` (torchrun's LOCAL_WORLD_SIZE) adds the checks of how the layout sits on
    nodes; a tensor-parallel group across nodes is warned about on stderr by rank 0."""
    par, train, model = config.parallel, config.training, config.model
    warning = check_nodes(world_size, ranks_per_node, par.tensor, par.pipeline, par.context_parallel_size)
    if warning:
        tell(warning)
    stage_plan = par.stage_plan()
    par.validate(world_size, model.num_layers)
    layout = run_layout(world_size, par.tensor, par.pipeline, expert=par.expert, expert_tensor=par.expert_tensor,
                        context=par.context_parallel_size, comm_type=par.cp_comm_type,
                        hierarchical=par.hierarchical_context_parallel_sizes, plan=stage_plan)
    if stage_plan is None:  # an equal split needs the layers to divide evenly over p x v stages
        model.validate(par.tensor, par.pipeline, par.virtual_pipeline, par.expert)
    else:  # a plan's stages need not hold equal numbers of layers
        model.validate(par.tensor, expert_parallel=par.expert)
    pipeline, data, replicas = layout.pipeline_size, layout.data_size, layout.stage_replicas
    config.optimizer.validate()
    config.optimizer.check_post_validation(pipeline, replicas is not None and max(replicas) > 1)
    _check_training_flags(kind, config)
    check_fault_tolerant_replicas(config, pipeline, data)
    m = train.num_microbatches(data * (train.fault_tolerant_replicas or 1))  # every replica alive
    check_search_flags(config, pipeline)
    plan = RunPlan(kind, family_of(kind, model), config, layout, par.layer_ranges(model.num_layers), m,
                   _schedule(kind, config, pipeline, m, replicas), train.collective_timeout, default_device())
    if par.pipeline_schedule == AUTO and par.schedule_search.forward_time is not None:  # given times: search now
        search = searched_schedule(kind, config, pipeline, m, par.virtual_pipeline)
        plan = dataclasses.replace(plan, schedule=search.schedule, search=search)
    _check_asynchronous_training(plan)
    return plan


def with_vocabulary(plan: RunPlan, vocab_size: int) -> RunPlan:
    """``plan`` for the tokenizer's ``vocab_size``; ``--pipeline-schedule auto`` priced by a profile or by the
    stages' FLOPs (the logit layer's among them) searched now."""
    plan = plan.with_vocabulary(vocab_size)
    if plan.schedule != AUTO:
        return plan
    search = searched_schedule(plan.kind, plan.config, plan.layout.pipeline_size, plan.microbatches,
                               plan.virtual_pipeline)
    return dataclasses.replace(plan, schedule=search.schedule, search=search)


def _schedule(kind: str, config: Config, p: int, m: int, replicas: Optional[tuple[int, ...]]):
    """The run's schedule as far as the flags give it: a flush schedule's lists (a file's, or a named one built),
    an asynchronous schedule's checked name, or ``auto``."""
    par = config.parallel
    if par.schedule_file is not None:
        schedule = load_training_schedule(par.schedule_file, p, m, par.virtual_pipeline)  # a flush schedule
        config.optimizer.check_pipeline_schedule("from a file", False)
        if par.overlap_moe_expert_parallel_comm:
            check_overlap_flags(par.expert, config.model.moe_token_dispatcher_type)
        return schedule
    if par.pipeline_schedule == AUTO:
        if par.overlap_moe_expert_parallel_comm:
            raise ConfigError("--overlap-moe-expert-parallel-comm needs a named flush schedule with forward/backward "
                              "pairs, not --pipeline-schedule auto; use 1f1b or dualpipev.")
        if par.schedule_search.profile is not None:
            check_profile(kind, config)  # searched once the tokenizer has given the vocabulary (``with_vocabulary``)
        config.optimizer.check_pipeline_schedule(AUTO, False)
        return AUTO
    # built once, which checks m against p, the name, replicas that only an asynchronous schedule can run
    lists = build_schedule(par.pipeline_schedule, p, m, par.virtual_pipeline, replicas=replicas,
                           vertical_sync=par.pipedream_vertical_sync)
    asynchronous = schedule_descriptor(par.pipeline_schedule).asynchronous
    config.optimizer.check_pipeline_schedule(par.pipeline_schedule, asynchronous)
    if par.overlap_moe_expert_parallel_comm:
        check_overlap_moe_comm(config, None if asynchronous else lists)
    # an asynchronous schedule runs as a periodic program, which the engine builds from its name
    return par.pipeline_schedule if asynchronous else lists


def _check_training_flags(kind: str, config: Config) -> None:
    par, train = config.parallel, config.training
    for flag, value in (("--micro-batch-size", train.micro_batch_size), ("--train-iters", train.train_iters),
                        ("--log-interval", train.log_interval), ("--eval-interval", train.eval_interval)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1.")
    check_context(config)
    if par.sequence_parallel and config.model.seq_length % par.tensor:
        raise ConfigError(f"--seq-length {config.model.seq_length} is not divisible by --tensor-model-parallel-size "
                          f"{par.tensor}, which --sequence-parallel needs.")
    if train.save_interval is not None and not train.save:
        raise ConfigError("--save-interval needs --save DIR to know where to write checkpoints.")
    if train.local_checkpoint_interval is not None and train.local_checkpoint_interval < 1:
        raise ConfigError(f"--local-checkpoint-interval {train.local_checkpoint_interval} must be at least 1 "
                          "(iterations between copies in peer memory); leave it out to keep none.")
    if train.straggler_check_interval is not None and train.straggler_check_interval < 1:
        raise ConfigError(f"--straggler-check-interval {train.straggler_check_interval} must be at least 1 "
                          "(iterations between comparisons); leave it out to turn the check off.")
    if train.straggler_threshold <= 0:
        raise ConfigError(f"--straggler-threshold {train.straggler_threshold:g} must be above 0 (0.2 names a rank "
                          "20% slower than its peers).")
    watchdog, timeout = train.hang_watchdog_seconds, train.collective_timeout.total_seconds()
    if watchdog is not None and (watchdog < 0 or watchdog >= timeout):
        raise ConfigError(f"--hang-watchdog-seconds {watchdog:g} must be below --distributed-timeout-minutes "
                          f"({timeout:g} s), so that it reports before the collectives fail, and not negative "
                          "(0 turns it off).")
    check_device_peak(train.device_peak_tflops)
    check_fp8_flags(train.fp8_format, config.optimizer.bf16, config.model.num_experts)
    check_compiled_layers(train.fusion_backend, config.model.num_experts)
    validate_operations(kind, config)
    check_unread_flags(kind, config)


def check_context(config: Config) -> None:
    """The checks context parallelism adds: the attention's (``check_context_parallel``: the sequence
    splits into 2c chunks, an all-to-all's heads divide, no attention dropout) and, with sequence
    parallelism, each rank's s / c tokens split over t."""
    par, model = config.parallel, config.model
    c = par.context_parallel_size
    check_context_parallel(context=c, comm_type=par.cp_comm_type, seq_length=model.seq_length,
                           heads=model.num_attention_heads, query_groups=model.query_groups,
                           tensor_parallel=par.tensor, hierarchical_sizes=par.hierarchical_context_parallel_sizes,
                           attention_dropout=model.attention_dropout)
    if c > 1 and par.sequence_parallel and (model.seq_length // c) % par.tensor:
        raise ConfigError(f"--seq-length {model.seq_length} / --context-parallel-size {c} is not divisible by "
                          f"--tensor-model-parallel-size {par.tensor}, which --sequence-parallel needs; choose a "
                          f"multiple of {2 * c * par.tensor}.")


def check_overlap_moe_comm(config: Config, lists: Optional[Schedule]) -> None:
    """``--overlap-moe-expert-parallel-comm``: expert parallelism over all-to-alls, no recomputation (its
    replay would draw random numbers beside the other pass), and a flush schedule (``lists``; None: an
    asynchronous one) with pairs it can overlap."""
    par = config.parallel
    check_overlap_flags(par.expert, config.model.moe_token_dispatcher_type)
    if config.model.recompute_granularity is not None:
        raise ConfigError(f"--overlap-moe-expert-parallel-comm cannot be combined with --recompute-granularity "
                          f"{config.model.recompute_granularity} yet; drop one of them.")
    if lists is None:
        raise ConfigError(f"--overlap-moe-expert-parallel-comm needs a flush schedule's forward/backward pairs; "
                          f"--pipeline-schedule {par.pipeline_schedule} has none: use 1f1b or dualpipev.")
    overlapped_schedule(lists)


def _check_asynchronous_training(plan: RunPlan) -> None:
    """What asynchronous schedules (weight updates without flushes) cannot run, as one-sentence errors."""
    if not isinstance(plan.schedule, str) or plan.schedule == AUTO:
        return  # lists: a flush schedule's (named, from a file or searched)
    name, model, optimizer = plan.schedule, plan.config.model, plan.config.optimizer
    if len(plan.layer_ranges) > 1 and not model.untie_embeddings_and_output_weights:
        raise ConfigError(f"--pipeline-schedule {name} needs --untie-embeddings-and-output-weights: the tied word "
                          "embedding lives on the first and last stage, which update at different times without "
                          "flushes, so its two copies would need a flush to stay equal.")
    if model.recompute_granularity == "full":
        raise ConfigError(f"--pipeline-schedule {name} cannot use --recompute-granularity full: recomputing a layer "
                          "would re-run it on the live weights instead of the version the microbatch used; use "
                          "selective (it recomputes with the weights the forward ran on) or no recomputation.")
    if optimizer.fp16 and optimizer.loss_scale is None:
        raise ConfigError(f"--pipeline-schedule {name} with --fp16 needs a constant --loss-scale: every stage "
                          "updates on its own, so dynamic scaling would change the scale on each stage at different "
                          "times while the gradients between stages carry one scale.")
