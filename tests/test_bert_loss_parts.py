"""BERT reports its masked-LM and sentence-order losses separately (``lm loss``, ``sop loss``).

The parts are checked against an independent computation from the model's own logits (the
same model called without labels returns them): cross-entropy of the LM logits over the
masked positions, and of the binary logits against the sentence-order labels, with plain
``torch.nn.functional.cross_entropy``. Tolerance 1e-6 relative: the model's cross-entropy
(vocabulary-parallel, max-subtracted, with -inf padding rows) and torch's differ only in
the order of fp32 operations. The training loop then logs both names, and the validation
split's ``lm loss``, which is what one compares with the data's unigram entropy.
"""

import re

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.models.families import family
from megapipe.models.loss_parts import parts_of
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from test_training_cli import TINY, run


def bert_batch(config: ModelConfig, b: int = 3, s: int = 16) -> dict:
    g = torch.Generator().manual_seed(3)
    padding = torch.ones(b, s, dtype=torch.long)
    padding[2, 11:] = 0
    loss_mask = (torch.rand(b, s, generator=g) < 0.3).float() * padding
    return {"tokens": torch.randint(0, config.vocab_size, (b, s), generator=g),
            "types": torch.randint(0, 2, (b, s), generator=g), "padding_mask": padding,
            "labels": torch.where(loss_mask.bool(), torch.randint(0, config.vocab_size, (b, s), generator=g), -1),
            "loss_mask": loss_mask, "is_random": torch.tensor([0, 1, 1])}


@pytest.mark.unit
def test_parts_are_the_masked_lm_and_sentence_order_losses():
    config = family("bert").model_config(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                                         seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
                                         make_vocab_size_divisible_by=8)
    model = build_model_chunks("bert", config, ParallelState.single())[0].eval()
    batch = bert_batch(config)
    loss = model(None, batch)
    parts = parts_of(loss)
    assert set(parts) == {"lm loss", "sop loss"}
    with torch.no_grad():
        lm_logits, binary_logits = model(None, {k: v for k, v in batch.items() if k != "labels"})
    mask = batch["loss_mask"].bool()
    lm = F.cross_entropy(lm_logits[..., :config.vocab_size][mask], batch["labels"][mask])
    sop = F.cross_entropy(binary_logits, batch["is_random"])
    assert parts["lm loss"].item() == pytest.approx(lm.item(), rel=1e-6)
    assert parts["sop loss"].item() == pytest.approx(sop.item(), rel=1e-6)
    assert loss.item() == pytest.approx(lm.item() + sop.item(), rel=1e-6)
    assert not parts["lm loss"].requires_grad  # parts are for logging; the sum is what trains


@pytest.mark.system
def test_pretrain_bert_logs_lm_and_sop_loss(tmp_path):
    result = run(TINY + ["--train-iters", "2", "--eval-interval", "2"], cache=tmp_path, script="pretrain_bert.py")
    assert result.returncode == 0, result.stderr
    assert re.search(r"iteration\s+2/2 .*\| lm loss: [0-9.]+E[+-]\d+ \| sop loss: [0-9.]+E[+-]\d+ \|", result.stdout)
    assert re.search(r"validation loss at iteration 2 \| lm loss value: .* \| lm loss PPL: .* \| sop loss value: ",
                     result.stdout)
