"""Data-parallel microbatches: each rank's slice, exact resume at consumed_samples, tensors out."""

import numpy as np
import pytest
import torch

from data_helpers import write_dataset
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.samplers import PretrainingSampler, build_pretraining_data_loader
from megapipe.errors import ConfigError, DataError

pytestmark = pytest.mark.unit


def all_ranks(total, consumed, micro_batch_size, dp):
    return [list(PretrainingSampler(total, consumed, micro_batch_size, r, dp)) for r in range(dp)]


def test_ranks_split_each_global_step_in_order():
    ranks = all_ranks(total=50, consumed=0, micro_batch_size=3, dp=4)
    assert ranks[0][:2] == [[0, 1, 2], [12, 13, 14]] and ranks[3][0] == [9, 10, 11]
    served = [i for step in zip(*ranks) for batch in step for i in batch]
    assert served == list(range(48))  # 4 full steps of 12; the incomplete last step is dropped
    assert all(len(r) == len(PretrainingSampler(50, 0, 3, 0, 4)) == 4 for r in ranks)


@pytest.mark.parametrize("consumed", [0, 12, 24, 36, 48])
def test_resume_continues_at_the_exact_sample(consumed):
    full = all_ranks(total=60, consumed=0, micro_batch_size=3, dp=4)
    resumed = all_ranks(total=60, consumed=consumed, micro_batch_size=3, dp=4)
    steps_done = consumed // 12
    assert resumed == [r[steps_done:] for r in full]


def test_bad_sampler_arguments():
    with pytest.raises(DataError, match="consumed_samples 61 lies outside the dataset's 60 samples"):
        PretrainingSampler(60, 61, 1, 0, 1)
    with pytest.raises(ConfigError, match="--micro-batch-size 0 must be at least 1"):
        PretrainingSampler(60, 0, 0, 0, 1)
    with pytest.raises(ConfigError, match="data-parallel rank 2 is not in a data-parallel group of 2"):
        PretrainingSampler(60, 0, 1, 2, 2)


def test_loader_yields_tensor_microbatches_and_resumes(tmp_path):
    prefix = write_dataset(str(tmp_path / "ds"), [[list(range(d, d + 25))] for d in range(40)])
    ds = GPTDataset(IndexedDataset(prefix), np.arange(40), 30, 8, seed=2, cache_dir=str(tmp_path / "c"))
    batches = list(build_pretraining_data_loader(ds, 0, micro_batch_size=2, data_parallel_rank=1,
                                                 data_parallel_size=3))
    assert len(batches) == 5
    first = batches[0]
    assert set(first) == {"tokens", "labels", "loss_mask"}
    assert first["tokens"].shape == (2, 8) and first["tokens"].dtype == torch.int64
    assert first["loss_mask"].dtype == torch.float32
    assert torch.equal(first["tokens"], torch.from_numpy(np.stack([ds[2]["tokens"], ds[3]["tokens"]])))
    resumed = list(build_pretraining_data_loader(ds, 12, 2, 1, 3))
    assert len(resumed) == 3
    for a, b in zip(resumed, batches[2:]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert build_pretraining_data_loader(None, 0, 2, 0, 1) is None
