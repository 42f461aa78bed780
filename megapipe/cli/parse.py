"""Command-line flags with Megatron-LM's names, parsed once into ``Config``.

``parse_config(kind, argv, world_size)`` reads the flags (``megapipe.cli.flags``, generated
from the dataclasses), fills the dataclasses and checks every combination that can be checked
before a process group exists; each mistake is one sentence naming the flags and the fix. With
no flags at all a small model trains on the embedded corpus.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from megapipe.cli.checkpoint_args import use_checkpoint_args
from megapipe.cli.flags import apply_preset, build_parser, section_values
from megapipe.config.notes import tell
from megapipe.config.operations import validate_operations
from megapipe.config.optimizer import OptimizerConfig
from megapipe.config.unread import check_unread_flags
from megapipe.config.schema import (Config, DataConfig, ModelConfig, ParallelConfig, ScheduleSearchConfig,
                                    TrainingConfig)
from megapipe.errors import ConfigError
from megapipe.fusions.fp8_mode import check_fp8_flags
from megapipe.context_parallel import check_context_parallel
from megapipe.models.compiled_layers import check_compiled_layers
from megapipe.models.families import FAMILIES, kind_family
from megapipe.models.flops import check_device_peak
from megapipe.schedules.overlap import check_overlap_flags
from megapipe.schedules.catalog import build_schedule, overlapped_schedule

__all__ = ["build_parser", "config_from_args", "config_from_argv", "parse_config", "validate_config"]


def _virtual_pipeline_size(args) -> int:
    if args.num_layers_per_virtual_pipeline_stage is None:
        return 1
    per_chunk, p = args.num_layers_per_virtual_pipeline_stage, args.pipeline_model_parallel_size
    if per_chunk < 1 or args.num_layers % (p * per_chunk):
        raise ConfigError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {p} x "
                          f"--num-layers-per-virtual-pipeline-stage {per_chunk}; every model chunk must hold the "
                          "same number of layers.")
    return args.num_layers // (p * per_chunk)


def _one_chunk_note(args) -> Optional[str]:
    """The line saying that --num-layers-per-virtual-pipeline-stage leaves one model chunk per rank.

    Megatron-LM accepts v = 1 (its interleaved code then runs one chunk, 1F1B's order), so a script
    that carries over is run, not refused; but a user who asked for virtual stages is told."""
    per_chunk, p = args.num_layers_per_virtual_pipeline_stage, args.pipeline_model_parallel_size
    if per_chunk is None or _virtual_pipeline_size(args) != 1:
        return None
    schedule = "the schedule is plain 1f1b" if args.pipeline_schedule is None else \
        f"--pipeline-schedule {args.pipeline_schedule} interleaves nothing"
    return (f"note: --num-layers-per-virtual-pipeline-stage {per_chunk} gives v = --num-layers {args.num_layers} / "
            f"(--pipeline-model-parallel-size {p} x {per_chunk}) = 1 model chunk per rank, so {schedule}; "
            f"--num-layers {2 * p * per_chunk} gives v = 2")


def config_from_args(kind: str, args: argparse.Namespace, family=None) -> Config:
    """The dataclasses of parsed flags; ``family`` is the model family (default: the one named as ``kind``)."""
    family = family or kind_family(kind)
    optimizer = OptimizerConfig(**section_values(args, "optimizer"))
    model_fields = {**family.defaults, **section_values(args, "model")}
    for f in FAMILIES.values():  # every family's own flags are on every parser
        if f.model_options is not None:
            f.model_options(args, model_fields)
    model_fields["params_dtype"] = (torch.bfloat16 if optimizer.bf16 else torch.float16 if optimizer.fp16
                                    else torch.float32)
    parallel = ParallelConfig(**section_values(args, "parallel"), virtual_pipeline=_virtual_pipeline_size(args),
                              schedule_search=ScheduleSearchConfig(**section_values(args, "parallel.schedule_search")))
    data = DataConfig(**section_values(args, "data"))
    training = TrainingConfig(**section_values(args, "training"))
    return Config(model=ModelConfig(**model_fields), parallel=parallel, data=data, training=training,
                  optimizer=optimizer)


def validate_config(config: Config, world_size: int, kind: str = "gpt", ranks_per_node: Optional[int] = None) -> int:
    """Check everything knowable before process groups exist; returns the data-parallel size.

    ``ranks_per_node`` (torchrun's LOCAL_WORLD_SIZE) adds the checks of how the layout sits on
    nodes; a tensor-parallel group across nodes is warned about on stderr by rank 0."""
    from megapipe.layout.nodes import check_nodes
    from megapipe.layout.ranks import RankLayout
    from megapipe.layout.plan import PlanLayout
    from megapipe.schedules.catalog import check_schedule
    from megapipe.cli.selection import AUTO, check_profile, check_search_flags, searched_schedule

    par, train = config.parallel, config.training
    warning = check_nodes(world_size, ranks_per_node, par.tensor, par.pipeline, par.context_parallel_size)
    if warning:
        tell(warning)
    plan = par.stage_plan()
    if plan is None:
        par.validate()
        layout = RankLayout.for_world(world_size, par.tensor, par.pipeline, expert=par.expert,
                                      expert_tensor=par.expert_tensor, context=par.context_parallel_size,
                                      hierarchical=par.hierarchical_context_parallel_sizes)
        config.model.validate(par.tensor, par.pipeline, par.virtual_pipeline, par.expert)
        data, pipeline, replicas = layout.data, par.pipeline, None
    else:
        par.validate(world_size, config.model.num_layers)
        config.model.validate(par.tensor, expert_parallel=par.expert)  # stages need not hold equal numbers of layers
        layout = PlanLayout(plan, par.tensor, par.expert, par.expert_tensor, par.context_parallel_size,
                            par.hierarchical_context_parallel_sizes)
        layout.folds()  # checks the experts' degrees against each stage's ranks
        data, pipeline, replicas = layout.data_size, layout.pipeline_size, layout.stage_replicas
    config.optimizer.validate()
    config.optimizer.check_post_validation(pipeline, replicas is not None and max(replicas) > 1)
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
    check_device_peak(train.device_peak_tflops)
    check_fp8_flags(train.fp8_format, config.optimizer.bf16, config.model.num_experts)
    check_compiled_layers(train.fusion_backend, config.model.num_experts)
    validate_operations(kind, config)
    check_unread_flags(kind, config)
    m = train.num_microbatches(data)
    check_search_flags(config, pipeline)
    if par.pipeline_schedule == AUTO:
        if par.overlap_moe_expert_parallel_comm:
            raise ConfigError("--overlap-moe-expert-parallel-comm needs a named flush schedule with forward/backward "
                              "pairs, not --pipeline-schedule auto; use 1f1b or dualpipev.")
        if par.schedule_search.profile is None:
            searched_schedule(kind, config, pipeline, m, par.virtual_pipeline)
        else:  # searched once the tokenizer has given the vocabulary the profile must match
            check_profile(kind, config)
        config.optimizer.check_pipeline_schedule(AUTO, False)
        return data
    # m vs p rules, unknown names, replicas that only an asynchronous schedule can run
    descriptor = check_schedule(par.pipeline_schedule, pipeline, m, par.virtual_pipeline, replicas,
                                par.pipedream_vertical_sync)
    config.optimizer.check_pipeline_schedule(par.pipeline_schedule, descriptor.asynchronous)
    if par.overlap_moe_expert_parallel_comm:
        check_overlap_moe_comm(config, descriptor.asynchronous, pipeline, m)
    return data


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


def check_overlap_moe_comm(config: Config, asynchronous: bool, pipeline: int, m: int) -> None:
    """``--overlap-moe-expert-parallel-comm``: expert parallelism over all-to-alls, no recomputation (its
    replay would draw random numbers beside the other pass), and a schedule with pairs it can overlap."""
    par = config.parallel
    check_overlap_flags(par.expert, config.model.moe_token_dispatcher_type)
    if config.model.recompute_granularity is not None:
        raise ConfigError(f"--overlap-moe-expert-parallel-comm cannot be combined with --recompute-granularity "
                          f"{config.model.recompute_granularity} yet; drop one of them.")
    if asynchronous:
        raise ConfigError(f"--overlap-moe-expert-parallel-comm needs a flush schedule's forward/backward pairs; "
                          f"--pipeline-schedule {par.pipeline_schedule} has none: use 1f1b or dualpipev.")
    overlapped_schedule(build_schedule(par.pipeline_schedule, pipeline, m, par.virtual_pipeline))


def config_from_argv(kind: str, argv: Optional[Sequence[str]] = None) -> Config:
    """The dataclasses of a training command line (presets applied), not yet checked against a world:
    what a tool that needs only the run's model and data reads from the run's own flags."""
    parser = build_parser(kind)
    args = parser.parse_args(argv)
    given = parser.given(argv)
    family, overridden = apply_preset(args, given, kind)
    for note in (overridden, _one_chunk_note(args)):  # before any refusal they may explain
        if note:
            tell(note)
    config = config_from_args(kind, args, family)
    if config.training.use_checkpoint_args:
        use_checkpoint_args(config, given)
        args.num_layers = config.model.num_layers  # what --num-layers-per-virtual-pipeline-stage divides
        config.parallel.virtual_pipeline = _virtual_pipeline_size(args)
    return config


def parse_config(kind: str, argv: Optional[Sequence[str]] = None, world_size: int = 1,
                 ranks_per_node: Optional[int] = None) -> Config:
    config = config_from_argv(kind, argv)
    validate_config(config, world_size, kind, ranks_per_node)
    return config
