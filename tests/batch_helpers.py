"""Random GPT and BERT microbatches for the pipeline tests (any seed, any size), and GPT microbatches of
packed documents.

BERT batches pad the tail of their first sequence, so the padding mask and the masked loss
are exercised; the values themselves do not matter, only that a reference sees the same ones.
"""

from __future__ import annotations

import numpy as np
import torch

from megapipe.data.packing import Packing


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


def packed_microbatch(vocab_size: int, micro: int, seq: int, seed: int) -> dict:
    """A GPT microbatch of several documents per sequence: token 0 ends a document, and the fields of
    ``--eod-mask-loss --reset-position-ids --reset-attention-mask`` come with it."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab_size, (micro, seq), generator=g)
    tokens[torch.rand(micro, seq, generator=g) < 0.2] = 0
    packing = Packing(0, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    batch = {"tokens": tokens, "labels": torch.randint(0, vocab_size, (micro, seq), generator=g),
             "loss_mask": torch.ones(micro, seq)}
    fields = [packing.fields(row.numpy(), mask.numpy()) for row, mask in zip(tokens, batch["loss_mask"])]
    batch.update({key: torch.from_numpy(np.stack([f[key] for f in fields])) for key in ("position_ids", "document_ids")})
    return batch
