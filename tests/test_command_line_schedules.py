"""Through the command line's loop (``Trainer.train_iteration``), the zero-bubble schedules and
``--pipeline-schedule auto`` (no cost flags: the stages' FLOPs) train the same model as 1F1B, bit for bit
(a V within an ulp).

One world of two processes runs ``pretrain_gpt.py``'s defaults (embedded corpus, byte-level vocabulary,
tied embeddings, clipping at 1.0, AdamW, the LR schedule, a log line every iteration) at p = 2 and
m = 8, the flags of ``benchmarks/bench_trainer_overhead.py`` on a smaller model. Each weight's
gradient is summed over the microbatches in the same order under every schedule (a BW runs the
products a B would have run, ``tensor_parallel/split_backward.py``), so the losses of every
iteration and the weights after them are equal exactly, not within a tolerance. A twin engine
stepping on the same microbatches outside the loop (with the LR schedule's step) gets the same losses
too: the loop adds no maths.
"""

from __future__ import annotations

import pytest
import torch

from megapipe.cli.parse import parse_run
from megapipe.testing.worlds import run_distributed
from megapipe.training.trainer import Trainer

pytestmark = pytest.mark.distributed

ITERATIONS = 3
SCHEDULES = {"1f1b": [], "zb-h1": [], "zbv": ["--num-layers-per-virtual-pipeline-stage", "1"],
             "interleaved-zb": ["--num-layers-per-virtual-pipeline-stage", "1"],
             "auto": ["--num-layers-per-virtual-pipeline-stage", "1"]}


def flags(schedule: str) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--train-iters", str(ITERATIONS + 1), "--log-interval", "1", "--eval-iters", "0",
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule, *SCHEDULES[schedule]]


def losses_and_weights(trainer: Trainer) -> tuple[list, dict]:
    """Each iteration's microbatch losses (last stage) through ``train_iteration``, and the weights after."""
    engine, losses = trainer.engine, []
    train_batch = engine.train_batch

    def recorded(microbatches):
        result = train_batch(microbatches)
        losses.append(result.losses)
        return result

    engine.train_batch = recorded
    batches = trainer.train_batches()
    for _ in range(ITERATIONS):
        assert trainer.train_iteration(batches) is None
    weights = {name: p.detach().clone() for chunk in trainer.chunks for name, p in chunk.state_dict().items()}
    return losses, weights


def world(rank: int, world_size: int) -> dict:
    results = {}
    for schedule in SCHEDULES:
        trainer = Trainer(parse_run("gpt", flags(schedule), world_size=world_size))
        results[schedule] = losses_and_weights(trainer)
    twin = Trainer(parse_run("gpt", flags("1f1b"), world_size=world_size))
    batches = twin.train_batches()
    engine_losses = []
    for _ in range(ITERATIONS):  # the engine's step and the LR schedule's, no more
        engine_losses.append(twin.engine.train_batch(next(batches)).losses)
        twin.scheduler.step()
    results["engine"] = (engine_losses, None)
    picked = Trainer(parse_run("gpt", flags("auto"), world_size=world_size)).engine.schedule
    return {"results": results, "auto_splits": any(a.kind.name == "BW" for actions in picked.actions
                                                  for a in actions)}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(2, world, timeout=600)


def losses_of(runs, schedule: str) -> list:
    """The iterations' losses from the rank that holds them (rank 1 under looped schedules, rank 0 under a V)."""
    last = runs[1]["results"][schedule][0]
    return last if any(last) else runs[0]["results"][schedule][0]


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved-zb", "auto"])
def test_zero_bubble_and_auto_give_1f1b_losses_bit_for_bit(runs, schedule):
    reference = losses_of(runs, "1f1b")
    assert len(reference) == ITERATIONS and all(len(step) == 8 for step in reference)
    assert losses_of(runs, schedule) == reference


def test_a_v_gives_1f1b_losses_within_rounding(runs):
    """A V holds both copies of the tied embedding on rank 0 and adds their gradients there, where a looped
    schedule all-reduces them between two ranks: the same sum, rounded once differently (1 ulp seen)."""
    reference = losses_of(runs, "1f1b")
    losses = losses_of(runs, "zbv")
    assert losses[0] == reference[0]  # the first forward runs on the same weights
    assert torch.allclose(torch.tensor(losses), torch.tensor(reference), rtol=1e-6, atol=0)


def test_the_loop_adds_no_maths_to_the_engines_step(runs):
    assert runs[1]["results"]["engine"][0] == runs[1]["results"]["1f1b"][0]


def test_zb_h1_weights_equal_1f1b_s_bit_for_bit(runs):
    """Same chunks on the same ranks as 1F1B, so every tensor compares (a V's later losses show its weights)."""
    for rank in range(2):
        mine, reference = runs[rank]["results"]["zb-h1"][1], runs[rank]["results"]["1f1b"][1]
        assert mine.keys() == reference.keys()
        for key in reference:
            assert torch.equal(mine[key], reference[key]), (rank, key)


def test_auto_without_cost_flags_picks_a_split_backward(runs):
    assert runs[0]["auto_splits"] and runs[1]["auto_splits"]
