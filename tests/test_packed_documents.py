"""Packed documents (``--eod-mask-loss``, ``--reset-position-ids``, ``--reset-attention-mask``), as Megatron-LM.

The sample's fields are checked against Megatron's own formulation (a loop over the end-of-document
tokens that masks ``[i+1:, :i+1]`` and subtracts from the positions after each), and the model
against the reference that cannot be wrong in the same way: every document of a packed sample run
on its own, as its own sequence from position 0. GPT (learned positions) and a Llama-shaped GPT
(RoPE, grouped-query attention) give the same logits for every token either way.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from model_families import MODEL_KIND, family_config
from megapipe.cli.parse import parse_config
from megapipe.data.packing import Packing
from megapipe.errors import ConfigError
from megapipe.models import build_model_chunks
from megapipe.models.masking import dense_mask
from megapipe.parallel.state import ParallelState

pytestmark = pytest.mark.unit

EOD = 9


def megatron_fields(tokens: np.ndarray):
    """Megatron's loop: the [s, s] attention mask (True = allowed, causal) and the position ids."""
    s = len(tokens)
    allowed = np.tril(np.ones((s, s), dtype=bool))
    positions = np.arange(s)
    previous = 0
    for i in np.flatnonzero(tokens == EOD):
        allowed[i + 1:, :i + 1] = False
        positions[i + 1:] -= i + 1 - previous
        previous = i + 1
    return allowed, positions


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([EOD, 1, 2, 3]), min_size=1, max_size=24))
def test_fields_are_megatrons(tokens):
    tokens = np.array(tokens, dtype=np.int64)
    loss_mask = np.ones(len(tokens), dtype=np.float32)
    fields = Packing(EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True).fields(
        tokens, loss_mask)
    allowed, positions = megatron_fields(tokens)
    assert fields["position_ids"].tolist() == positions.tolist()
    documents = torch.from_numpy(fields["document_ids"])[None]
    mask = dense_mask(None, documents)[0, 0].numpy()  # True = other document
    assert (~mask & np.tril(np.ones_like(mask))).tolist() == allowed.tolist()
    assert loss_mask.tolist() == [0.0 if t == EOD else 1.0 for t in tokens]


def test_switches_are_independent():
    tokens = np.array([1, EOD, 2, 3])
    mask = np.ones(4, dtype=np.float32)
    assert Packing(EOD).fields(tokens, mask) == {} and mask.tolist() == [1, 1, 1, 1]
    only_positions = Packing(EOD, reset_position_ids=True).fields(tokens, mask)
    assert list(only_positions) == ["position_ids"] and only_positions["position_ids"].tolist() == [0, 1, 0, 1]
    assert Packing(EOD, reset_attention_mask=True).fields(tokens, mask)["document_ids"].tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_packed_sample_equals_each_document_run_alone(kind):
    """Logits of a packed sample with reset positions and masks equal those of its documents run one by one."""
    seq = 16
    config = family_config(kind, num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=37, seq_length=seq,
                           hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
    torch.manual_seed(0)
    model = build_model_chunks(MODEL_KIND[kind], config, ParallelState.single())[0].eval()
    rows = [[3, 5, EOD, 7, 7, 2, 1, EOD, 4, 4, 4, 4, 4, 6, EOD, 8],
            [EOD, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, EOD, 14, 15]]
    tokens = torch.tensor(rows)
    packing = Packing(EOD, reset_position_ids=True, reset_attention_mask=True)
    fields = [packing.fields(np.array(row), np.ones(seq, dtype=np.float32)) for row in rows]
    batch = {"tokens": tokens, **{key: torch.from_numpy(np.stack([f[key] for f in fields]))
                                  for key in ("position_ids", "document_ids")}}
    with torch.no_grad():
        packed = model(None, batch)
        for b, row in enumerate(rows):
            ends = [i + 1 for i, t in enumerate(row) if t == EOD and i + 1 < seq]
            for start, end in zip([0] + ends, ends + [seq]):
                alone = model(None, {"tokens": tokens[b:b + 1, start:end]})
                torch.testing.assert_close(packed[b:b + 1, start:end], alone, rtol=1e-5, atol=1e-5)


def test_bert_refuses_the_packing_flags_in_one_sentence():
    with pytest.raises(ConfigError, match=r"^--reset-attention-mask separates the documents packed into GPT samples; "
                                          r"pretrain_bert.py's samples are sentence pairs, so drop the flag.$"):
        parse_config("bert", ["--reset-attention-mask"])
