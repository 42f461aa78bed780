"""Mixture-of-experts Llama-shaped models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a Llama whose MLPs are
(some of them) mixtures of experts. They train under ``pretrain_gpt.py`` with ``--num-experts`` and the
other ``--moe-*`` flags (``ModelConfig`` fields, so a GPT can use them too); this entry holds the
Hugging Face mapping (``models/hf_moe.py``), the FLOPs formula and ``--model-preset`` shapes.
"""

from __future__ import annotations

from megapipe.config import ModelConfig
from megapipe.models import hf_moe
from megapipe.models.families.family import Family, HFArchitecture
from megapipe.models.families.llama import DEFAULTS, FLAGS
from megapipe.models.flops import moe_flops_per_iteration
from megapipe.models.gpt import GPTStage

PRESETS = {
    "mixtral-tiny": dict(FLAGS, num_layers=4, hidden_size=128, num_attention_heads=8, group_query_attention=True,
                         num_query_groups=2, ffn_hidden_size=256, seq_length=128, num_experts=8, moe_router_topk=2,
                         moe_aux_loss_coeff=0.01),
    "mixtral-8x7b": dict(FLAGS, num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
                         num_query_groups=8, ffn_hidden_size=14336, seq_length=4096, rotary_base=1000000.0,
                         num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.02),
    "olmoe-1b-7b": dict(FLAGS, num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=1024,
                        seq_length=4096, num_experts=64, moe_router_topk=8, moe_router_pre_softmax=True,
                        qk_layernorm=True, qk_layernorm_scope="projection", moe_aux_loss_coeff=0.01,
                        moe_z_loss_coeff=0.001),
}


def claims(config: ModelConfig) -> bool:
    return config.num_experts is not None


def export_type(config: ModelConfig) -> str:
    """The Hugging Face architecture whose options the model's match (errors name the mismatch on export)."""
    if config.qk_layernorm:
        return "olmoe" if config.qk_layernorm_scope == "projection" else "qwen3_moe"
    return "qwen2_moe" if config.moe_shared_expert_intermediate_size is not None or config.add_qkv_bias else "mixtral"


def moe_model_config(hf_config, **overrides) -> ModelConfig:
    """A megapipe ModelConfig equal to a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE transformers config."""
    return ModelConfig(**{**DEFAULTS, **hf_moe.moe_fields(hf_config), **overrides})


def _architecture(model_type: str) -> HFArchitecture:
    arch = hf_moe.MOE_FAMILY[model_type]
    return HFArchitecture(model_type, arch.hf_class, moe_model_config, hf_moe.MOE_WEIGHTS,
                          lambda config, **token_ids: hf_moe.moe_hf_config(model_type, config, **token_ids),
                          unsupported=arch.unsupported)


FAMILY = Family(name="moe", kind="gpt", stage=GPTStage, defaults=DEFAULTS,
                hf=tuple(_architecture(model_type) for model_type in hf_moe.MOE_FAMILY), presets=PRESETS,
                claims=claims, export_type=export_type, flops=moe_flops_per_iteration)
