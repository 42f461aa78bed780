"""Packed documents under context parallelism reach every rank's attention as the whole sequence's
document ids on the host (``sequence_documents``), so each block runs one unmasked call per document
piece: readers keep them from the samples they read, and the tensor ranks that receive their batches
get them with the rest (one copy to the host per batch).

One world of 4 at t = 2, c = 2 with packed documents (``--reset-attention-mask``): every rank's
microbatches hold them on the host, whole, and equal to its own chunks' ids where they overlap; and
4 iterations train to the losses the dense mask gives at c = 1 (t = 2, d = 2) within 1e-5 relative
(fp32: only the blocks' summation order differs).
"""

import pytest
import torch

from checkpoint_helpers import build, session_cache, train
from megapipe.layout.context import local_positions
from megapipe.testing.worlds import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

FLAGS = ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "4", "--eod-mask-loss",
         "--reset-position-ids", "--reset-attention-mask", "--position-embedding-type", "rope",
         "--tensor-model-parallel-size", "2", "--seq-length", "64"]  # the corpus's paragraphs: ~180 bytes


def _world(rank, world_size, cache):
    trainer = build(FLAGS + ["--context-parallel-size", "2"], cache)
    ps = trainer.ps
    mine = torch.tensor(local_positions(trainer.config.model.seq_length, 2, ps.cp_rank))
    held = []
    for microbatch in next(trainer.train_batches()):
        whole = microbatch["sequence_documents"]
        held.append((whole.device.type, tuple(whole.shape),
                     torch.equal(whole[:, mine], microbatch["document_ids"].cpu()), int(whole.max())))
    trainer.exit_conditions.close()
    losses = {}
    for c in (2, 1):
        trainer, losses[c] = train(FLAGS + ["--context-parallel-size", str(c)], cache)
        if trainer.ps.tp_rank or trainer.ps.cp_rank:  # one rank per data replica reports its microbatches
            losses[c] = None
    return ps.tp_rank, held, losses


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_distributed(4, _world, session_cache(tmp_path_factory), timeout=280)


def test_every_rank_holds_the_whole_sequences_documents_on_the_host(world):
    assert {tp_rank for tp_rank, _, _ in world} == {0, 1}  # readers and the ranks they send to
    for _, held, _ in world:
        assert held and all(entry[:3] == ("cpu", (2, 64), True) for entry in held), held
        assert any(documents > 0 for *_, documents in held)  # a sequence holds two documents or more


def _iteration_means(world, c: int) -> torch.Tensor:
    """The mean loss of each iteration over every replica's microbatches."""
    reported = [losses[c] for _, _, losses in world if losses[c] is not None]
    return torch.tensor([sum(sum(step, [])) / sum(len(part) for part in step) for step in zip(*reported)])


def test_unmasked_document_calls_train_as_the_dense_mask_does(world):
    at_c2, at_c1 = _iteration_means(world, 2), _iteration_means(world, 1)
    assert len(at_c2) == 4 and torch.allclose(at_c2, at_c1, rtol=1e-5, atol=0), (at_c2, at_c1)
