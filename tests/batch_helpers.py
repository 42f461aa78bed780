"""Random GPT and BERT microbatches for the pipeline tests (any seed, any size).

BERT batches pad the tail of their first sequence, so the padding mask and the masked loss
are exercised; the values themselves do not matter, only that a reference sees the same ones.
"""

from __future__ import annotations

import torch


def random_microbatch(kind: str, vocab_size: int, micro: int, seq: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {"tokens": torch.randint(0, vocab_size, (micro, seq), generator=g),
             "labels": torch.randint(0, vocab_size, (micro, seq), generator=g),
             "loss_mask": (torch.rand(micro, seq, generator=g) > 0.1).float()}
    if kind == "bert":
        padding = torch.ones(micro, seq, dtype=torch.long)
        padding[0, seq - 1:] = 0
        batch.update(types=torch.randint(0, 2, (micro, seq), generator=g), padding_mask=padding,
                     is_random=torch.randint(0, 2, (micro,), generator=g))
        batch["loss_mask"] = batch["loss_mask"] * padding
    return batch
