"""Only the first and last pipeline stages read data: a real p = 3 run (GPT and BERT) where the middle
stage opens no dataset file and builds no index, the index is built once per node, and the losses
equal a one-process run's."""

import builtins
import glob
import os
import shutil

import numpy as np
import pytest
import torch.distributed as dist

from megapipe.cli.parse import parse_run
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

FLAGS = ["--num-layers", "3", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "6", "--train-iters", "2", "--log-interval", "1",
         "--eval-interval", "100", "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--fusion-backend", "eager", "--lr-warmup-iters", "0"]
DATASET_SUFFIXES = (".bin", ".idx", ".npy")


def _record_dataset_access(opened: list, built: list) -> None:
    """Note every dataset file opened (open, the indexed dataset's memory maps, np.load) and every index built."""
    import megapipe.data.bert_dataset as bert_dataset
    import megapipe.data.gpt_dataset as gpt_dataset
    import megapipe.data.indexed_dataset as indexed_dataset

    def noting(function, path_of):
        def wrapper(*args, **kwargs):
            path = str(path_of(*args, **kwargs))
            if path.endswith(DATASET_SUFFIXES):
                opened.append(path)
            return function(*args, **kwargs)
        return wrapper

    builtins.open = noting(builtins.open, lambda file, *a, **k: file)
    indexed_dataset._memory_map = noting(indexed_dataset._memory_map, lambda path, *a, **k: path)
    np.load = noting(np.load, lambda file, *a, **k: file)
    for module, name in ((gpt_dataset, "build_sample_index"), (bert_dataset, "build_sample_map")):
        original = getattr(module, name)
        setattr(module, name, lambda *a, _original=original, **k: built.append(name) or _original(*a, **k))


def _train(kind: str, cache: str, pipeline: int) -> list:
    from megapipe.training.trainer import Trainer

    plan = parse_run(kind, FLAGS + ["--pipeline-model-parallel-size", str(pipeline), "--data-cache-path", cache],
                          world_size=dist.get_world_size())
    trainer = Trainer(plan)
    record = []
    original = trainer.engine.train_batch

    def train_batch(microbatches):
        result = original(microbatches)
        record.append(list(result.losses))
        return result

    trainer.engine.train_batch = train_batch
    trainer.train()
    return record


def check_ranks(rank, world_size, cache):
    opened, built, results = [], [], {}
    _record_dataset_access(opened, built)
    for kind in ("gpt", "bert"):
        losses = _train(kind, cache, world_size)
        results[kind] = (losses, list(opened), list(built))
        opened.clear()
        built.clear()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("rank-data"))
    reference = run_distributed(1, check_ranks, cache, timeout=240)[0]
    # the same corpus (BERT's trained vocabulary may differ between builds) without the sample indices
    pipelined_cache = str(tmp_path_factory.mktemp("rank-data-p3"))
    for corpus in glob.glob(os.path.join(cache, "pydoc-topics-*")):
        shutil.copytree(corpus, os.path.join(pipelined_cache, os.path.basename(corpus)))
    pipelined = run_distributed(3, check_ranks, pipelined_cache, timeout=300)
    return reference, pipelined


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_middle_stage_opens_no_dataset_and_losses_equal_one_process(runs, kind):
    reference, pipelined = runs
    (_, first_opened, first_built), (_, middle_opened, middle_built), (losses, last_opened, last_built) = (
        pipelined[rank][kind] for rank in range(3))
    assert middle_opened == [] and middle_built == []
    assert any(path.endswith(".bin") for path in first_opened) and any(path.endswith(".bin") for path in last_opened)
    # one node: its first reader (rank 0) builds the train, validation and test indices; rank 2 reads them
    assert len(first_built) == 3 and last_built == []
    # the same samples and arithmetic as one process: equal to fp32 rounding of the pipelined sums
    expected = reference[kind][0]
    assert len(losses) == len(expected) == 2
    for got, want in zip(losses, expected):
        assert got == pytest.approx(want, rel=1e-6)
