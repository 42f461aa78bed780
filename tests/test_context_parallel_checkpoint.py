"""A checkpoint saved under context parallelism loads at any context size, with equal losses.

Through the real Trainer (``pretrain_gpt.py``'s path: data read by each context rank and cut to its
chunks, the model, the whole sequence's loss) on the embedded corpus with packed documents
(``--eod-mask-loss --reset-position-ids --reset-attention-mask``, its documents end in eod tokens): 4
iterations at c = 2 (d = 2) saving at iteration 2; the checkpoint of iteration 2 then resumes at c = 1
(d = 4) and c = 4 (d = 1), and iterations 3 and 4 must give the saving run's mean losses within 1e-5
relative. Checkpoints hold whole tensors with nothing split over the context ranks, so c is free on load.
"""

import os

import pytest

from checkpoint_helpers import session_cache, train
from megapipe.testing.worlds import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

FLAGS = ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "4", "--eod-mask-loss",
         "--reset-position-ids", "--reset-attention-mask", "--position-embedding-type", "rope"]


def _reported(trainer, losses):
    """The microbatch losses of each iteration on one rank per data replica (a context group reports
    the same numbers on each of its ranks); None elsewhere."""
    ps = trainer.ps
    return losses if ps.is_last_stage and ps.tp_rank == 0 and ps.cp_rank == 0 else None


def _step_means(runs, context):
    """The mean loss of each iteration over every replica's microbatches."""
    reported = [r[context] for r in runs if r[context] is not None]
    return [sum(sum(step, [])) / sum(len(part) for part in step) for step in zip(*reported)]


def _world(rank, world_size, root, cache):
    saving, losses = train(FLAGS + ["--context-parallel-size", "2", "--save", root, "--save-interval", "2"], cache)
    runs = {2: _reported(saving, losses[2:])}
    for context in (1, 4):
        trainer, losses = train(FLAGS + ["--context-parallel-size", str(context),
                                         "--load", os.path.join(root, "iter_0000002")], cache)
        assert trainer.ps.cp_size == context
        runs[context] = _reported(trainer, losses)
    return runs


def test_checkpoint_of_c2_resumes_at_c1_and_c4_with_equal_losses(tmp_path, tmp_path_factory):
    runs = run_distributed(4, _world, str(tmp_path), session_cache(tmp_path_factory), timeout=600)
    expected = _step_means(runs, 2)
    assert len(expected) == 2
    for context in (1, 4):
        assert _step_means(runs, context) == pytest.approx(expected, rel=1e-5, abs=0), f"c = {context}"
