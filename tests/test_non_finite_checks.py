"""``--check-for-nan-in-loss-and-grad``: a NaN loss or gradient is named (iteration, rank) and stops or skips.

A NaN is injected into one iteration's loss (added to it, so that its gradients stay finite and only
the check's guard skips the update) or into a gradient (a hook on one weight). In one process:
``skip`` leaves every weight as it was for that iteration, logs the iteration and the rank, and the
next iteration trains again; ``stop`` raises one sentence naming them, and the CLI exits 2 with it;
the check adds no host read to an iteration. In a 2-stage pipeline: a NaN loss on the last stage
makes both stages skip the update and names rank 1, and a NaN gradient on the first stage stops
both ranks at the same iteration with the same sentence.
"""

import contextlib
import io
import os

import pytest
import torch

from megapipe.cli.parse import parse_run
from megapipe.errors import NonFiniteError
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data", "--vocab-size", "128",
         "--train-iters", "6", "--log-interval", "2", "--eval-interval", "100", "--eval-iters", "1",
         "--lr-warmup-iters", "0", "--check-for-nan-in-loss-and-grad"]
POISONED = 2  # the iteration whose loss or gradient is NaN; it logs (--log-interval 2)


@contextlib.contextmanager
def nan_in(trainer, what: str):
    """A NaN in this rank's loss (on the last stage) or in a gradient of its first layer."""
    if what == "loss":
        handles = [trainer.chunks[-1].register_forward_hook(lambda module, args, out: out + float("nan"))] \
            if trainer.ps.is_last_stage else []
    else:
        weight = next(trainer.chunks[0].parameters())
        handles = [weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def weights(trainer) -> list:
    return [p.detach().clone() for p in trainer.engine.optimizer.main_params]


def unchanged(before, trainer) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, trainer.engine.optimizer.main_params))


def poisoned_run(action: str, what: str, extra=()) -> dict:
    """Train to iteration POISONED with a NaN in it, then one more iteration unless it stopped."""
    from megapipe.training.trainer import Trainer

    trainer = Trainer(parse_run("gpt", FLAGS + ["--non-finite-action", action, *extra],
                                          world_size=torch.distributed.get_world_size()))
    batches = trainer.train_batches()
    for _ in range(POISONED - 1):
        trainer.train_iteration(batches)
    before, log, error = weights(trainer), io.StringIO(), None
    with contextlib.redirect_stdout(log), nan_in(trainer, what):
        try:
            trainer.train_iteration(batches)
        except NonFiniteError as stopped:
            error = str(stopped)
    outcome = {"error": error, "kept": unchanged(before, trainer), "log": log.getvalue()}
    if error is None:
        after = weights(trainer)
        trainer.train_iteration(batches)
        outcome["trains on"] = not unchanged(after, trainer)
    trainer.engine.drain()
    trainer.exit_conditions.close()
    return outcome


def cli_exit(what: str) -> tuple:
    """The training CLI's exit status and stderr with a NaN in iteration POISONED."""
    from megapipe.training.cli import _run

    original, calls = PipelineEngine.train_batch, []

    def train_batch(engine, microbatches):
        calls.append(1)
        if len(calls) != POISONED:
            return original(engine, microbatches)
        with nan_in(SimpleTrainer(engine), what):
            return original(engine, microbatches)

    PipelineEngine.train_batch, stderr = train_batch, io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            code = _run("gpt", FLAGS)
    finally:
        PipelineEngine.train_batch = original
    return code, stderr.getvalue()


class SimpleTrainer:
    """What ``nan_in`` reads of a trainer, from its engine."""

    def __init__(self, engine):
        self.chunks, self.ps = engine.chunks, engine.ps


def one_process(rank, world_size, cache):
    os.environ["MEGAPIPE_CACHE"] = cache
    from megapipe.training.trainer import Trainer

    runs = {(action, what): poisoned_run(action, what) for action in ("skip", "stop") for what in ("loss", "grad")}
    checked = Trainer(parse_run("gpt", FLAGS + ["--train-iters", "100", "--log-interval", "100"]))
    syncs = checked.count_synchronisations(3)
    checked.engine.drain()
    checked.exit_conditions.close()
    return runs, syncs, cli_exit("loss")


def two_stages(rank, world_size, cache):
    os.environ["MEGAPIPE_CACHE"] = cache
    pipeline = ("--pipeline-model-parallel-size", "2")
    return poisoned_run("skip", "loss", pipeline), poisoned_run("stop", "grad", pipeline)


def expected(rank: int, what: str) -> str:
    return f"rank {rank} found a NaN/Inf {what} at iteration {POISONED}; "


STOP = ("stopping as --check-for-nan-in-loss-and-grad asks, with the update of each such iteration skipped: lower "
        "--lr, check the data or resume from an earlier checkpoint (--non-finite-action skip trains on, skipping such "
        "updates).")
SKIP = "skipped the update of each such iteration (--non-finite-action skip)."


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_one_process_names_the_iteration_and_skips_or_stops(tmp_path):
    [(runs, syncs, (code, stderr))] = run_distributed(1, one_process, str(tmp_path), timeout=280)
    for what, seen in (("loss", "loss and gradient norm"), ("grad", "gradient norm")):
        skipped = runs[("skip", what)]
        assert skipped["error"] is None and skipped["kept"] and skipped["trains on"], (what, skipped)
        assert expected(0, seen) + SKIP in skipped["log"]
        stopped = runs[("stop", what)]
        assert stopped["error"] == expected(0, seen) + STOP and stopped["kept"], (what, stopped)
    assert syncs == 0  # the check reads the device only where the loop logs
    assert code == 2 and stderr == f"error: {expected(0, 'loss and gradient norm')}{STOP}\n"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_two_stage_pipeline_skips_on_both_stages_and_stops_both_alike(tmp_path):
    first, last = run_distributed(2, two_stages, str(tmp_path), timeout=280)
    for stage in (first, last):
        skipped, stopped = stage
        assert skipped["error"] is None and skipped["kept"] and skipped["trains on"], skipped
        assert stopped["error"] == expected(0, "gradient norm") + STOP and stopped["kept"], stopped
    assert expected(1, "loss and gradient norm") + SKIP in last[0]["log"]  # the last stage logs
