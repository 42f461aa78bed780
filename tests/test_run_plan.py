"""A run is resolved once from its flags (``megapipe.cli.resolve``) into a ``RunPlan`` that the Trainer and the
engine read: the flags' configuration is never changed, an equal split is one more list of stage layer
ranges with the same layout as the stage plan that writes it out, a flush schedule's lists are built
there once, and the collective timeout has one default."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from megapipe.cli.parse import config_from_argv, parse_run
from megapipe.cli.resolve import resolve_run
from megapipe.config.schema import COLLECTIVE_TIMEOUT, TrainingConfig
from megapipe.pipeline.engine import PipelineEngine
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.schedules.actions import Schedule
from megapipe.schedules.catalog import build_schedule

pytestmark = pytest.mark.unit

MODEL = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--mock-data", "--vocab-size", "64"]
GROUPS = ("tensor_groups", "data_groups", "pipeline_groups", "model_parallel_groups", "context_groups",
          "expert_groups")


def test_resolving_leaves_the_flags_configuration_as_it_was():
    config = config_from_argv("gpt", MODEL + ["--pipeline-model-parallel-size", "2"])
    before = dataclasses.asdict(config)
    plan = resolve_run("gpt", config, world_size=4).with_vocabulary(300)
    assert dataclasses.asdict(config) == before
    assert plan.config.model.vocab_size == 300 != config.model.vocab_size


def test_an_equal_split_is_the_stage_plan_that_writes_it_out():
    equal = parse_run("gpt", MODEL + ["--pipeline-model-parallel-size", "2"], world_size=4)
    planned = parse_run("gpt", MODEL + ["--pipeline-stages", "0:2x2,2:4x2"], world_size=4)
    assert equal.layer_ranges == planned.layer_ranges == ((0, 2), (2, 4))
    for groups in GROUPS:
        assert getattr(equal.layout, groups)() == getattr(planned.layout, groups)(), groups
    assert (equal.microbatches, equal.layout.stage_replicas) == (planned.microbatches, None) == (4, None)


def test_a_flush_schedule_is_built_once_and_an_asynchronous_one_left_to_its_program():
    flush = parse_run("gpt", MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"],
                      world_size=2)
    assert isinstance(flush.schedule, Schedule) and flush.split_backward
    assert flush.schedule.actions == build_schedule("zb-h1", 2, 8, 1).actions
    asynchronous = parse_run("gpt", MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
                                             "--untie-embeddings-and-output-weights"], world_size=2)
    assert asynchronous.schedule == "2bw" and not asynchronous.split_backward


def test_one_default_collective_timeout():
    """The flag's default, the engine's and the executor's are one constant; the plan carries the flag's."""
    assert TrainingConfig().collective_timeout == COLLECTIVE_TIMEOUT
    for runner in (PipelineEngine, PipelineExecutor):
        assert inspect.signature(runner).parameters["timeout"].default == COLLECTIVE_TIMEOUT
    plan = parse_run("gpt", MODEL + ["--distributed-timeout-minutes", "3"])
    assert plan.timeout.total_seconds() == 180
