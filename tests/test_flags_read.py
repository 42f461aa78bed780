"""How a command line is read: a flag given beats the preset even at the script's default, and that is
said once; a flag that changes nothing is said; an unknown flag is one sentence naming the closest
ones; every run logs a loss line, however short."""

from __future__ import annotations

import pytest

from megapipe.cli.parse import parse_config
from megapipe.config import TrainingConfig
from megapipe.errors import ConfigError

pytestmark = pytest.mark.unit

# each value equals pretrain_gpt.py's default, none llama-1b's
SCRIPT_DEFAULTS = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128"]


def notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("note:")]


def test_flags_given_at_the_script_default_beat_the_preset_and_say_so_once(capsys):
    model = parse_config("gpt", ["--model-preset", "llama-1b", *SCRIPT_DEFAULTS, "--num-query-groups", "2"]).model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.seq_length) == (4, 128, 4, 128)
    assert model.num_query_groups == 2 and model.ffn_hidden_size == 8192 and model.swiglu  # the rest is the preset's
    [line] = notes(capsys.readouterr().err)
    assert line == ("note: the flags given win over --model-preset llama-1b: --num-layers 4, --hidden-size 128, "
                    "--num-attention-heads 4, --num-query-groups 2, --seq-length 128 (the preset's --num-layers 16, "
                    "--hidden-size 2048, --num-attention-heads 32, --num-query-groups 8, --seq-length 2048); it still "
                    "sets --ffn-hidden-size 8192")
    parse_config("gpt", ["--model-preset", "llama-tiny", "--num-layers", "4", "--swiglu"])  # agreeing: nothing said
    assert not notes(capsys.readouterr().err)


def test_virtual_stages_that_make_one_chunk_per_rank_are_said(capsys):
    """The ZeRO-3 interleaved example: 4 layers / (p = 2 x 2 per chunk) is v = 1, plain 1F1B."""
    zero3 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
             "--data-parallel-sharding-strategy", "optim_grads_params"]
    with pytest.raises(ConfigError, match="m=1 microbatches, fewer than --pipeline-model-parallel-size 2"):
        parse_config("gpt", zero3, world_size=8)
    [line] = notes(capsys.readouterr().err)
    assert line == ("note: --num-layers-per-virtual-pipeline-stage 2 gives v = --num-layers 4 / "
                    "(--pipeline-model-parallel-size 2 x 2) = 1 model chunk per rank, so the schedule is plain 1f1b; "
                    "--num-layers 8 gives v = 2")
    corrected = parse_config("gpt", zero3 + ["--num-layers", "8", "--micro-batch-size", "4"], world_size=8)
    assert (corrected.parallel.virtual_pipeline, corrected.parallel.pipeline_schedule) == (2, "interleaved")
    assert not notes(capsys.readouterr().err)


def test_zbv_example_runs_on_four_processes():
    """The V-placement example, shrunk to run on a CPU: v = 8 / (4 x 1) = 2 chunks, m = 8 >= 2p - 1."""
    config = parse_config("gpt", ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
                                  "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "zbv",
                                  "--hidden-size", "64", "--seq-length", "64", "--micro-batch-size", "1",
                                  "--global-batch-size", "8", "--train-iters", "2"], world_size=4)
    assert config.parallel.virtual_pipeline == 2 and config.training.num_microbatches(1) == 8


def test_a_flag_typo_is_one_sentence_naming_the_closest_flag(capsys):
    from megapipe.training.cli import _run

    assert _run("gpt", ["--num-layer", "4", "--tensor-parallel-size=2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "error: unknown flags --num-layer (did you mean --num-layers?), --tensor-parallel-size (did you mean "
        "--tensor-model-parallel-size or --expert-tensor-parallel-size?); pretrain_gpt.py --help lists the flags.\n")
    with pytest.raises(ConfigError, match=r"^argument --lr: invalid float value: 'x'; pretrain_bert.py --help"):
        parse_config("bert", ["--lr", "x"])


@pytest.mark.parametrize("train_iters, given, logged", [
    (4, [], [1, 2, 3, 4]),  # the README's short runs: every iteration
    (30, [], [3, 6, 9, 12, 15, 18, 21, 24, 27, 30]),
    (5000, [], list(range(100, 5001, 100))),  # long runs: Megatron-LM's 100
    (30, ["--log-interval", "20"], [20, 30]),  # the last iteration logs whatever the interval
])
def test_every_run_logs_a_loss_line(train_iters, given, logged):
    training = parse_config("gpt", ["--train-iters", str(train_iters), *given]).training
    assert [i for i in range(1, train_iters + 1) if training.logs_after(i)] == logged
    if not given:  # a library caller of the dataclass gets the same default
        assert TrainingConfig(train_iters=train_iters).log_interval == training.log_interval
