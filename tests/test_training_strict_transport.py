"""PipeDream and 2BW through the training loop with gloo held to NCCL's rules (``MEGAPIPE_STRICT_TRANSPORT``):
every iteration runs the loop's agreements (a world collective) while the pipeline stays full. With messages
in transit between calls, or one group waiting on the next call, this would hang here as on NCCL; the strict
and the relaxed transport give the same losses, per microbatch and bit for bit.

Each run is what ``pretrain_gpt.py`` runs on its ranks (the flags parsed, the Trainer built and trained, as in
``checkpoint_helpers.train``); one world per pipeline size runs every case of that size in turn, so its
processes start once (torchrun itself is covered by ``test_training_cli.py``).
"""

import os

import pytest

from checkpoint_helpers import session_cache, train
from megapipe.testing.worlds import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

CASES = [("pipedream", 2, 1), ("2bw", 2, 1), ("2bw", 2, 2), ("pipedream", 4, 1), ("2bw", 4, 1), ("2bw", 4, 2)]
RELAXED_TOO = ("2bw", 2, 2)  # also run on the relaxed transport, which must give the same losses
ITERATIONS = 4


def _flags(schedule: str, p: int, v: int) -> list[str]:
    flags = ["--num-layers", str(4 * v), "--pipeline-model-parallel-size", str(p), "--pipeline-schedule", schedule,
             "--untie-embeddings-and-output-weights", "--train-iters", str(ITERATIONS)]
    if v > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", "1" if p == 4 else "2"]
    if (p, v) == (4, 2):
        flags += ["--global-batch-size", "16"]  # interleaved 2BW at p = 4 needs m >= 8
    return flags


def _train_each(rank, world_size, runs, cache):
    """Per run (schedule, p, v, strict): the microbatch losses of each training call on this rank."""
    recorded = []
    for schedule, p, v, strict in runs:
        os.environ["MEGAPIPE_STRICT_TRANSPORT"] = "1" if strict else "0"  # read when the transport is built
        recorded.append(train(_flags(schedule, p, v), cache)[1])
    return recorded


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(schedule, p, v, strict) -> per-rank losses; one world of p ranks for each pipeline size."""
    cache, results = session_cache(tmp_path_factory), {}
    for p in sorted({p for _, p, _ in CASES}):
        runs = [(*case, True) for case in CASES if case[1] == p]
        runs += [(*RELAXED_TOO, False)] if RELAXED_TOO[1] == p else []
        ranks = run_distributed(p, _train_each, runs, cache, timeout=600)
        results.update({run: [recorded[index] for recorded in ranks] for index, run in enumerate(runs)})
    return results


@pytest.mark.parametrize("schedule,p,v", CASES)
def test_asynchronous_schedules_train_under_the_strict_transport(runs, schedule, p, v):
    ranks = runs[(schedule, p, v, True)]
    assert [len(calls) for calls in ranks] == [ITERATIONS] * p
    assert any(all(calls) for calls in ranks), "no rank logged the losses of every iteration"  # the last stage


def test_the_strict_and_the_relaxed_transport_give_the_same_losses(runs):
    assert runs[(*RELAXED_TOO, False)] == runs[(*RELAXED_TOO, True)]
