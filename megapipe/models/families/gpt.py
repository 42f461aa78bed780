"""GPT: a causal decoder with learned absolute positions (GPT-2's layout); ``ModelConfig``'s defaults."""

from __future__ import annotations

from megapipe.models import hf_mapping
from megapipe.models.families.family import Family, HFArchitecture
from megapipe.models.gpt import GPTStage

GPT2 = HFArchitecture("gpt2", "GPT2LMHeadModel", hf_mapping.gpt2_model_config, hf_mapping.GPT2_WEIGHTS,
                      hf_mapping.gpt2_hf_config,
                      unsupported={"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                                   "reorder_and_upcast_attn": False, "add_cross_attention": False})

FAMILY = Family(name="gpt", kind="gpt", stage=GPTStage, defaults={}, hf=(GPT2,))
