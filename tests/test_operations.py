"""Operations flags as users run them: early exits that save, evaluation only, resuming with a longer
--train-iters, the learning-rate schedule on resume, and user errors printed once per job."""

import dataclasses
import os
import re

import pytest
import torch

from megapipe.cli.parse import parse_config
from megapipe.errors import CheckpointError, ConfigError
from megapipe.config.optimizer import OptimizerConfig
from megapipe.optim.lr_schedule import LRScheduler
from test_training_cli import TINY, losses, run

# a constant warm-up-free schedule decaying over 6 iterations whatever --train-iters is
SCHEDULE = ["--lr-decay-iters", "6", "--lr-warmup-iters", "0"]
LOSS_TEXT = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.unit
@pytest.mark.parametrize("argv, message", [
    (["--skip-train"], "--skip-train evaluates a checkpoint and needs --load DIR"),
    (["--exit-interval", "0"], "--exit-interval 0 must be at least 1"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes 0 must be above 0"),
    (["--distributed-timeout-minutes", "-2"], "--distributed-timeout-minutes -2 must be above 0"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins 0 must be above 0"),
    (["--exit-signal-grace-seconds", "0"], "--exit-signal-grace-seconds 0 must be above 0"),
    (["--exit-signal-grace-seconds", "30", "--no-exit-signal-handler"],
     "--exit-signal-grace-seconds needs the SIGTERM handler"),
    (["--load", "no/such/dir"], "--load no/such/dir does not exist"),
    (["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"],
     "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler exclude each other"),
    (["--mock-data"], "--mock-data needs --vocab-size N"),
    (["--vocab-size", "100"],
     "--vocab-size sets the vocabulary of --mock-data and --tokenizer-type NullTokenizer only"),
])
def test_bad_operations_flags_name_the_flag_in_one_sentence(argv, message):
    with pytest.raises(ConfigError) as error:
        parse_config("gpt", argv)
    text = str(error.value)
    assert text.startswith(message) and text.count(". ") == 0 and text.endswith("."), text


@pytest.mark.unit
def test_load_may_name_a_missing_save_directory_that_starts_the_job(tmp_path):
    directory = str(tmp_path / "new")
    assert parse_config("gpt", ["--load", directory, "--save", directory]).training.load == directory


def _scheduler(decay_iters: int) -> LRScheduler:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return LRScheduler(optimizer, OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style="linear", lr_warmup_iters=0,
                                                  lr_decay_iters=decay_iters), train_iters=decay_iters)


@pytest.mark.unit
def test_schedule_on_resume_follows_megatrons_two_flags():
    saved = _scheduler(6)
    saved.step(3)
    state = saved.state_dict()
    with pytest.raises(CheckpointError, match="--override-opt-param-scheduler;.* "
                                              "--use-checkpoint-opt-param-scheduler"):
        _scheduler(10).load_state_dict(state)
    flags = _scheduler(10)
    flags.load_state_dict(state, "flags")
    assert flags.iteration == 3 and flags.schedule.decay_iters == 10
    assert flags.optimizer.param_groups[0]["lr"] == pytest.approx(1.0 - 0.9 * 3 / 10)
    checkpoint = _scheduler(10)
    checkpoint.load_state_dict(state, "checkpoint")
    assert checkpoint.iteration == 3 and checkpoint.schedule == saved.schedule
    assert checkpoint.optimizer.param_groups[0]["lr"] == saved.lr


def _defaults_scheduler(train_iters: int, **flags) -> LRScheduler:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return LRScheduler(optimizer, OptimizerConfig(**flags), train_iters)


@pytest.mark.unit
def test_extending_train_iters_keeps_a_pinned_schedule_and_names_every_moved_flag_otherwise():
    """The recipe: --train-iters 300 --lr-decay-iters 600, resumed with --train-iters 600, is one 600-iteration
    schedule (the default warm-up follows the decay, not --train-iters). Unpinned, the refusal names the decay
    and the warm-up, each with the value that keeps the checkpoint's schedule."""
    saved = _defaults_scheduler(300, lr_decay_iters=600)
    saved.step(300)
    resumed = _defaults_scheduler(600)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.iteration == 300 and resumed.schedule == saved.schedule
    unpinned = _defaults_scheduler(300)
    with pytest.raises(CheckpointError) as refused:
        _defaults_scheduler(900).load_state_dict(unpinned.state_dict())
    text = str(refused.value)
    assert "(--lr-warmup-iters 30 -> 50, --lr-decay-iters 300 -> 900;" in text, text
    assert "to resume and extend the run on the flags' schedule, add --override-opt-param-scheduler;" in text, text
    assert "to keep the checkpoint's schedule, resume with --lr-warmup-iters 30 --lr-decay-iters 300" in text, text
    kept = _defaults_scheduler(900, lr_warmup_iters=30, lr_decay_iters=300)
    kept.load_state_dict(unpinned.state_dict())  # the flags the sentence names resume it
    assert kept.schedule == unpinned.schedule


@pytest.mark.system
def test_resuming_with_more_iterations_repeats_the_longer_run(tmp_path):
    """A run of 3 iterations saved, resumed with --train-iters 6, logs the uninterrupted 6-iteration
    run's losses for iterations 4-6 digit for digit: the sample order does not depend on --train-iters.
    The 3-iteration run's decay is pinned with --lr-decay-iters, and the resume changes the schedule
    flags only through --train-iters, so the schedule needs no override."""
    ckpt = str(tmp_path / "ckpt")
    whole = run(TINY + SCHEDULE, cache=tmp_path)
    assert whole.returncode == 0, whole.stderr
    first = run(TINY + SCHEDULE + ["--train-iters", "3", "--save", ckpt], cache=tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = run(TINY + ["--lr-warmup-iters", "0", "--train-iters", "6", "--load", ckpt], cache=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    expected = dict(LOSS_TEXT.findall(whole.stdout))
    assert sorted(expected, key=int) == [str(i) for i in range(1, 7)]
    assert dict(LOSS_TEXT.findall(resumed.stdout)) == {i: expected[i] for i in ("4", "5", "6")}
    longer = run(TINY + ["--lr-warmup-iters", "0", "--train-iters", "8", "--load", ckpt], cache=tmp_path)
    assert longer.returncode == 2 and "--override-opt-param-scheduler" in error_lines(longer.stderr)[0]
    overridden = run(TINY + ["--lr-warmup-iters", "0", "--train-iters", "8", "--load", ckpt,
                             "--override-opt-param-scheduler"], cache=tmp_path)
    assert overridden.returncode == 0 and sorted(losses(overridden.stdout)) == list(range(4, 9)), overridden.stderr


@pytest.mark.system
def test_exit_interval_and_duration_save_and_exit_then_skip_train_evaluates(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    stopped = run(TINY + ["--save", ckpt, "--exit-interval", "2"], cache=tmp_path)
    assert stopped.returncode == 0, stopped.stderr
    assert sorted(losses(stopped.stdout)) == [1, 2] and "exiting on --exit-interval 2 at iteration 2" in stopped.stdout
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    timed = run(TINY + ["--save", str(tmp_path / "timed"), "--exit-duration-in-mins", "1e-9"], cache=tmp_path)
    assert timed.returncode == 0 and "exiting on --exit-duration-in-mins 1e-09 at iteration 1" in timed.stdout
    assert os.path.isdir(os.path.join(tmp_path, "timed", "iter_0000001")), timed.stdout
    # another --train-iters moves the learning-rate schedule, which evaluation never uses
    evaluated = run(TINY + ["--load", ckpt, "--skip-train", "--train-iters", "9"], cache=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    assert not losses(evaluated.stdout)  # no training iteration
    for split in ("validation", "test"):
        line = re.search(rf" {split} loss at iteration 2 \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|",
                         evaluated.stdout)
        assert line and float(line[2]) == pytest.approx(torch.tensor(float(line[1])).exp().item(), rel=1e-6)


@pytest.mark.system
def test_user_errors_under_torchrun_are_printed_once(tmp_path):
    """Before the process group (a flag) rank 0 prints; after it (an empty --load directory, found by
    both ranks) the first rank to find it does; either way one line per job."""
    for argv in (["--skip-train"], ["--load", str(tmp_path)]):
        result = run(TINY + argv, nproc=2, cache=tmp_path)
        assert result.returncode != 0
        lines = error_lines(result.stderr)
        assert len(lines) == 1 and "--load" in lines[0] and "Traceback" not in lines[0], result.stderr


@pytest.mark.unit
def test_a_checkpoint_of_another_shape_names_use_checkpoint_args_and_another_vocabulary_the_tokenizer():
    from megapipe.checkpointing.validate import shape_differences

    saved = parse_config("gpt", []).model
    smaller = parse_config("gpt", ["--hidden-size", "64"]).model
    assert shape_differences(saved, smaller) == (" (checkpoint vs this run: --hidden-size 128 vs 64, --ffn-hidden-size "
                                                 "512 vs 256); add --use-checkpoint-args to take the model's shape "
                                                 "from the checkpoint")
    other_vocabulary = dataclasses.replace(saved, vocab_size=saved.vocab_size + 1)
    assert shape_differences(saved, other_vocabulary).endswith(
        "; pass the tokenizer flags (--tokenizer-type and its files) the checkpoint was trained with")
    assert shape_differences(saved, saved) == ""
