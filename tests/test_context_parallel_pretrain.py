"""The training scripts under context parallelism: a checkpoint loads at any context size with equal
losses, and BERT trains at c = 2 exactly as at c = 1.

Through the real Trainer (``pretrain_gpt.py``'s path: data read by each context rank and cut to its
chunks, the model, the whole sequence's loss) on the embedded corpus with packed documents
(``--eod-mask-loss --reset-position-ids --reset-attention-mask``, its documents end in eod tokens): 4
iterations at c = 2 (d = 2) saving at iteration 2; the checkpoint of iteration 2 then resumes at c = 1
(d = 4) and c = 4 (d = 1), and iterations 3 and 4 must give the saving run's mean losses within 1e-5
relative. Checkpoints hold whole tensors with nothing split over the context ranks, so c is free on load.
In the same world, ``pretrain_bert.py``'s Trainer (padding masks cut to each rank's chunks, the
sentence-order label per sample, its head on context rank 0's [CLS]) runs 2 iterations at c = 2
(d = 2) and at c = 1 (d = 4): equal lm and sop losses, iteration by iteration.
"""

import os

import pytest

import torch.distributed as dist

from checkpoint_helpers import TINY_GPT, session_cache, train
from megapipe.cli.parse import parse_run
from megapipe.training.trainer import Trainer
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


def _bert(context: int, cache: str) -> list:
    """Per iteration, (mean lm loss, mean sop loss) over every replica's microbatches, on every rank."""
    flags = TINY_GPT + ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "2",
                        "--context-parallel-size", str(context), "--data-cache-path", cache]
    trainer = Trainer(parse_run("bert", flags, world_size=dist.get_world_size()))
    parts, train_batch = [], trainer.engine.train_batch

    def recording(microbatches):
        result = train_batch(microbatches)
        parts.append(result.loss_parts)
        return result
    trainer.engine.train_batch = recording
    trainer.train()
    ps = trainer.ps
    mine = parts if ps.is_last_stage and ps.tp_rank == 0 and ps.cp_rank == 0 else [[] for _ in parts]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    steps = [sum((rank[i] for rank in gathered), []) for i in range(len(parts))]
    return [tuple(sum(p[name] for p in step) / len(step) for name in ("lm loss", "sop loss")) for step in steps]


def _world(rank, world_size, root, cache):
    bert = {context: _bert(context, cache) for context in (2, 1)}
    saving, losses = train(FLAGS + ["--context-parallel-size", "2", "--save", root, "--save-interval", "2"], cache)
    runs = {2: _reported(saving, losses[2:])}
    for context in (1, 4):
        trainer, losses = train(FLAGS + ["--context-parallel-size", str(context),
                                         "--load", os.path.join(root, "iter_0000002")], cache)
        assert trainer.ps.cp_size == context
        runs[context] = _reported(trainer, losses)
    return runs, bert


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("context-pretrain"), session_cache(tmp_path_factory)
    return run_distributed(4, _world, str(root), cache, timeout=600)


def test_bert_trains_at_c2_as_at_c1(worlds):
    bert = worlds[0][1]
    assert len(bert[2]) == 2
    for step, (at_2, at_1) in enumerate(zip(bert[2], bert[1])):
        assert at_2 == pytest.approx(at_1, rel=1e-5, abs=0), f"iteration {step + 1}"


def test_checkpoint_of_c2_resumes_at_c1_and_c4_with_equal_losses(worlds):
    runs = [runs for runs, _ in worlds]
    expected = _step_means(runs, 2)
    assert len(expected) == 2
    for context in (1, 4):
        assert _step_means(runs, context) == pytest.approx(expected, rel=1e-5, abs=0), f"c = {context}"
