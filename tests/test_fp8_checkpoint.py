"""FP8 is a compute mode, not a storage format: an FP8 run's checkpoint is a bf16 run's, and a run without
``--fp8-format`` resumes from it.

The tiny GPT trains 2 iterations in bf16 with ``--fp8-format hybrid --fp8-recipe rowwise`` (the FP8 products
emulated in fp32 on this CPU, the switch tests use) and saves; a bf16 run of the same flags saves too. The
two checkpoints hold the same files, and a bf16 run that loads the FP8 one starts from the FP8 run's
weights bit for bit (the word embedding's padding rows aside, which no checkpoint holds) and trains on with
finite losses.
"""

import os

import pytest
import torch

from checkpoint_helpers import train
from megapipe.fusions import fp8
from megapipe.testing.worlds import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

FLAGS = ["--bf16", "--train-iters", "2", "--lr-decay-iters", "4"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"]


def _files(directory: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, name), directory)
                  for root, _, names in os.walk(directory) for name in names)


def _save_fp8_then_resume_in_bf16(rank, world_size, root, cache):
    with fp8.emulated():
        fp8_run, fp8_losses = train(FLAGS + FP8 + ["--save", os.path.join(root, "fp8")], cache)
    saved = _weights(fp8_run)
    train(FLAGS + ["--save", os.path.join(root, "bf16")], cache)
    loaded = []
    _, resumed = train(["--bf16", "--train-iters", "4", "--lr-decay-iters", "4", "--load", os.path.join(root, "fp8")],
                       cache, after_load=lambda trainer: loaded.append(_weights(trainer)))
    return (_files(os.path.join(root, "fp8")) == _files(os.path.join(root, "bf16")),
            saved.keys() == loaded[0].keys() and all(torch.equal(saved[k], loaded[0][k]) for k in saved),
            fp8_losses, resumed)


def _weights(trainer) -> dict:
    """The model's weights, the word embedding without its padding rows (which checkpoints do not hold)."""
    vocabulary = trainer.tokenizer.vocab_size
    return {name: (p[:vocabulary] if name.endswith("word_embeddings.weight") else p).detach().clone()
            for name, p in trainer.chunks[0].named_parameters()}


def test_a_bf16_run_resumes_from_an_fp8_runs_checkpoint(tmp_path):
    same_files, same_weights, fp8_losses, resumed = run_distributed(
        1, _save_fp8_then_resume_in_bf16, str(tmp_path), str(tmp_path / "cache"), timeout=240)[0]
    assert same_files and same_weights
    assert len(fp8_losses) == 2 and len(resumed) == 2
    assert all(torch.isfinite(torch.tensor(losses)).all() for losses in resumed)
