"""GPT and BERT maths against Hugging Face ``transformers`` (models built from a config, no download).

The same weights go into both through ``megapipe.models.hf_mapping``; logits must agree to
1e-5 relative. Both sides compute the same fp32 operations in a different order (fused QKV
vs separate projections, [s, b, h] vs [b, s, h]), so they differ by float rounding only:
~1e-6 on logits of order 1.
"""

import pytest
import torch
import transformers

from megapipe.models import build_model_chunks
from megapipe.models.families.bert import bert_model_config
from megapipe.models.hf_mapping import bert_from_hf, bert_to_hf, gpt2_from_hf, gpt2_model_config, gpt2_to_hf
from megapipe.models.state_dict import canonical_state_dict, local_state_dict
from megapipe.parallel.state import ParallelState

pytestmark = pytest.mark.unit

RTOL = 1e-5


def assert_close(actual, expected):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * scale)


def _gpt2(untie=False):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=96, n_head=6, vocab_size=300, n_positions=40,
                                  tie_word_embeddings=not untie, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped mapping shows up
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return cfg, hf


def _ours(kind, config, canonical):
    ps = ParallelState.single()
    model = build_model_chunks(kind, config, ps)[0].eval()
    model.load_state_dict(local_state_dict(canonical, model, ps, config))
    return model, ps


@pytest.mark.parametrize("untie", [False, True])
def test_gpt2_logits_match_transformers(untie):
    cfg, hf = _gpt2(untie)
    config = gpt2_model_config(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    model, ps = _ours("gpt", config, gpt2_from_hf(hf.state_dict(), config))
    tokens = torch.randint(0, cfg.vocab_size, (3, 17))
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = model(None, {"tokens": tokens})[..., : cfg.vocab_size]
    assert_close(actual, expected)
    # and back: exporting our weights reproduces the Hugging Face state dict exactly
    exported = gpt2_to_hf(canonical_state_dict([model], ps, config), config)
    assert set(exported) == set(hf.state_dict())
    for key, value in hf.state_dict().items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0)


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                  intermediate_size=160, vocab_size=250, max_position_embeddings=32,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hf = transformers.BertForPreTraining(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return cfg, hf


def test_bert_logits_match_transformers():
    cfg, hf = _bert()
    config = bert_model_config(cfg)
    model, ps = _ours("bert", config, bert_from_hf(hf.state_dict(), config))
    tokens = torch.randint(0, cfg.vocab_size, (3, 19))
    types = torch.randint(0, 2, (3, 19))
    padding = torch.ones(3, 19, dtype=torch.long)
    padding[1, 12:] = 0
    padding[2, 5:] = 0
    with torch.no_grad():
        out = hf(input_ids=tokens, token_type_ids=types, attention_mask=padding)
        lm, binary = model(None, {"tokens": tokens, "types": types, "padding_mask": padding})
    real = padding.bool()  # padded query positions are not compared: both sides output garbage there
    assert_close(lm[..., : cfg.vocab_size][real], out.prediction_logits[real])
    assert_close(binary, out.seq_relationship_logits)
    exported = bert_to_hf(canonical_state_dict([model], ps, config), config)
    assert set(exported) == set(hf.state_dict())
    for key, value in hf.state_dict().items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0)
