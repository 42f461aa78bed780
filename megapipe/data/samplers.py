"""Microbatches for one data-parallel rank, resumable at any ``consumed_samples`` (Megatron's sampler)."""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import numpy as np
import torch

from megapipe.data.hf_stream import StreamedGPTDataset
from megapipe.errors import ConfigError, DataError


class PretrainingSampler:
    """Yields the sample indices of this rank's microbatches, in order, from ``consumed_samples`` on.

    The global order is ``0, 1, 2, ...``; each step of ``micro_batch_size * data_parallel_size``
    samples gives rank ``r`` the ``r``-th slice of ``micro_batch_size``. Resuming with the
    ``consumed_samples`` saved in a checkpoint therefore continues at exactly the next sample.
    An incomplete last step is dropped.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if micro_batch_size < 1:
            raise ConfigError(f"--micro-batch-size {micro_batch_size} must be at least 1.")
        if data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ConfigError(f"data-parallel rank {data_parallel_rank} is not in a data-parallel group of "
                              f"{data_parallel_size}; check the parallel layout.")
        if not 0 <= consumed_samples <= total_samples:
            raise DataError(f"consumed_samples {consumed_samples} lies outside the dataset's {total_samples} "
                            "samples; the checkpoint was made with other data or more training samples.")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.size = data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        """Microbatches this rank will get."""
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.size
        first = self.consumed_samples + self.rank * self.micro_batch_size
        for start in range(first, first + len(self) * step, step):
            yield list(range(start, start + self.micro_batch_size))


def collate_samples(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack a list of dataset items into a dict of tensors with a leading batch dimension."""
    return {key: torch.from_numpy(np.stack([sample[key] for sample in samples])) for key in samples[0]}


def streamed_microbatches(dataset: StreamedGPTDataset, sampler: PretrainingSampler) -> Iterator[dict]:
    """The microbatches of ``sampler`` from a dataset read in order: its windows from this rank's first
    sample on, the other ranks' windows passed over (every rank follows the one global stream)."""
    first = sampler.consumed_samples + sampler.rank * sampler.micro_batch_size
    windows, position = dataset.windows(first), first
    for indices in sampler:
        samples = []
        for index in indices:
            for _ in range(index - position):
                next(windows)
            samples.append(dataset.item(next(windows)))
            position = index + 1
        yield collate_samples(samples)


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                                  data_parallel_size: int, num_workers: int = 0) -> Optional[Iterable[dict]]:
    """A DataLoader of this rank's microbatches (dicts of tensors); ``None`` for a ``None`` dataset.

    Items are cheap memory-mapped slices, so ``num_workers=0`` is usually fastest. The loader
    draws its worker seed from a generator of its own: starting an iterator must not advance
    the global generator that dropout uses, or a resumed run would not repeat the original.
    A ``StreamedGPTDataset`` (read in order, tokenised by its own workers) gives a generator instead.
    """
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
                                 data_parallel_size)
    if isinstance(dataset, StreamedGPTDataset):
        return streamed_microbatches(dataset, sampler)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=collate_samples, persistent_workers=num_workers > 0,
                                       generator=torch.Generator())
