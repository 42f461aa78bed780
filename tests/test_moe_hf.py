"""Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE against Hugging Face ``transformers`` on one process.

Each architecture is a small random model of transformers' own class, saved to disk (Qwen2-MoE
with a dense layer among its MoE layers and a gated shared expert; Qwen3-MoE with per-head q/k norms;
OLMoE with q/k norms over the projections; routers and norms perturbed so routing and mapping errors
show). Imported through ``import_hf`` (the reading behind ``tools/convert_checkpoint.py import-hf``):
- logits equal transformers' within 1e-5 of their scale (fp32, another order of operations);
- greedy generation equals transformers' ``generate`` token for token;
- ``export_hf`` writes a directory transformers loads into exactly the original weights.
"""

import pytest
import torch
import transformers

from megapipe.checkpointing.hf import export_hf, import_hf
from megapipe.inference import SamplingParams, generate
from megapipe.models import build_model_chunks
from megapipe.models.state_dict import canonical_state_dict, local_state_dict
from megapipe.parallel.state import ParallelState

pytestmark = pytest.mark.unit

RTOL = 1e-5
VOCAB = 97
NEW = 8  # tokens generated
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=48,
                       num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                       head_dim=8, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2)),
}


def hf_model(name: str, seed: int):
    """A random transformers model of ``name`` with decisive routing and non-trivial norms and biases."""
    config_class, model_class, extra = MODELS[name]
    torch.manual_seed(seed)
    hf_config = getattr(transformers, config_class)(**COMMON, **extra, eos_token_id=None, bos_token_id=None)
    model = getattr(transformers, model_class)(hf_config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or key.endswith("bias") or key.endswith("gate.weight"):
                p.add_(torch.randn_like(p) * (1.0 if "gate" in key else 0.2))
    return model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3)]


def reference_generation(model) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """model_type -> (transformers model, megapipe chunk, config)."""
    root = tmp_path_factory.mktemp("moe-hf")
    out = {}
    for seed, name in enumerate(MODELS):
        model = hf_model(name, seed)
        model.save_pretrained(root / name)
        imported = import_hf(str(root / name))
        assert imported.model_type == name
        ps = ParallelState.single()
        chunk = build_model_chunks("gpt", imported.config, ps)[0].eval()
        chunk.load_state_dict(local_state_dict(imported.canonical, chunk, ps, imported.config))
        out[name] = model, chunk, imported.config
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_imported_logits_equal_transformers(saved, name):
    model, chunk, config = saved[name]
    tokens = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(tokens).logits
        actual = chunk(None, {"tokens": tokens})[..., :VOCAB]
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_equals_transformers(saved, name):
    model, chunk, config = saved[name]
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    assert generate([chunk], ParallelState.single(), config, prompts(), greedy, padding="left") == \
        reference_generation(model)


@pytest.mark.parametrize("name", list(MODELS))
def test_export_reloads_in_transformers_bit_exact(saved, tmp_path, name):
    model, chunk, config = saved[name]
    export_hf("gpt", config, canonical_state_dict([chunk], ParallelState.single(), config), str(tmp_path / "out"))
    back = type(model).from_pretrained(tmp_path / "out")
    assert set(back.state_dict()) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
