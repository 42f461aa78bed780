"""Every model family's Hugging Face weight table maps a tiny model of that family there and back exactly.

For each family in the registry: random weights of a tiny model, exported through the family's table
and imported again, come back bit for bit, and exporting the import gives the same Hugging Face
tensors. The tiny models (the family's options and a few variants) between them walk every rule of
the table, so a rule no model reaches fails here instead of on a real checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from model_families import family_config
from megapipe.models import build_model_chunks
from megapipe.models.families import FAMILIES
from megapipe.models.state_dict import canonical_state_dict
from megapipe.parallel.state import ParallelState

pytestmark = pytest.mark.unit

SIZES = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=64, seq_length=16,
             max_position_embeddings=16)
# options of a family whose tensors its default tiny model lacks
VARIANTS = {
    "bert": [dict(bert_binary_head=True)],
    "llama": [dict(add_qkv_bias=True), dict(untie_embeddings_and_output_weights=True)],
    "moe": [dict(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True, moe_layer_freq=(0, 1),
                 add_qkv_bias=True),
            dict(qk_layernorm=True, untie_embeddings_and_output_weights=True)],
}


def _random_canonical(kind: str, config) -> dict:
    ps = ParallelState.single()
    state = canonical_state_dict(build_model_chunks(kind, config, ps), ps, config)
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(value.shape, generator=generator).to(value.dtype) for name, value in state.items()}


def _assert_identical(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_table_round_trips_a_tiny_model_exactly(name):
    family = FAMILIES[name]
    assert family.hf, f"the {name} family has no Hugging Face architecture"
    walked = set()
    for options in [{}] + VARIANTS.get(name, []):
        config = family_config(name, **SIZES, **options)
        canonical = _random_canonical(family.kind, config)
        for table in {id(arch.weights): arch.weights for arch in family.hf}.values():
            hf_state = table.to_hf(canonical, config)
            imported = table.from_hf(hf_state, config)
            assert imported.keys() == canonical.keys()
            for key, tensor in canonical.items():
                assert torch.equal(imported[key], tensor), key
            _assert_identical(table.to_hf(imported, config), hf_state)
            walked |= {(id(table), id(rule)) for rule, _, _ in table.rules(config)}
    unwalked = [rule for arch in family.hf for rule in arch.weights.layer + arch.weights.before + arch.weights.after
                if (id(arch.weights), id(rule)) not in walked]
    assert not unwalked, f"no tiny {name} model has {unwalked[0].ours}: add a VARIANTS entry with those tensors."
