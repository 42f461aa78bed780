"""Command-line flags with Megatron-LM's names, parsed once into ``Config`` and resolved into a ``RunPlan``.

``parse_run(kind, argv, world_size)`` reads the flags (``megapipe.cli.flags``, generated from the
dataclasses), fills the dataclasses and resolves the run (``resolve.py``: every combination that can be
checked before a process group exists, one sentence naming the flags and the fix per mistake);
``parse_config`` gives just its configuration. With no flags at all a small model trains on the
embedded corpus.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from megapipe.cli.checkpoint_args import use_checkpoint_args
from megapipe.cli.flags import apply_preset, build_parser, section_values
from megapipe.cli.resolve import resolve_run
from megapipe.config.notes import tell
from megapipe.config.optimizer import OptimizerConfig
from megapipe.config.run_plan import RunPlan
from megapipe.config.schema import (Config, DataConfig, ModelConfig, ParallelConfig, ScheduleSearchConfig,
                                    TrainingConfig)
from megapipe.errors import ConfigError
from megapipe.models.families import FAMILIES, kind_family

__all__ = ["build_parser", "config_from_args", "config_from_argv", "parse_config", "parse_run"]


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


def parse_run(kind: str, argv: Optional[Sequence[str]] = None, world_size: int = 1,
              ranks_per_node: Optional[int] = None) -> RunPlan:
    """The checked plan of a training command line on ``world_size`` processes (``megapipe.cli.resolve``)."""
    return resolve_run(kind, config_from_argv(kind, argv), world_size, ranks_per_node)


def parse_config(kind: str, argv: Optional[Sequence[str]] = None, world_size: int = 1,
                 ranks_per_node: Optional[int] = None) -> Config:
    """The checked configuration of a training command line: what a tool that runs no training reads."""
    return parse_run(kind, argv, world_size, ranks_per_node).config
