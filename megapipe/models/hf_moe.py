"""Weight and config mapping between megapipe's MoE models and Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE
and OLMoE (transformers' in-memory layout: stacked ``experts.gate_up_proj`` [E, 2f, h], ``down_proj`` [E, h, f]).

All four are Llama-shaped except the MLP and a detail of attention: Qwen2-MoE has q/k/v biases,
Qwen3-MoE normalises each query and key head, OLMoE the whole q and k projections. Routing:
Mixtral and Qwen3-MoE (``norm_topk_prob``) weigh the k chosen experts by their renormalised
probabilities (megapipe's softmax after the top-k), Qwen2-MoE and OLMoE by the plain softmax over
all experts (``--moe-router-pre-softmax``). Qwen2-MoE adds a shared expert with a sigmoid gate and,
like Qwen3-MoE, may keep dense MLPs in some layers (``mlp_only_layers``, ``decoder_sparse_step``).

transformers' auxiliary loss pools every layer's routing into one Switch loss that does not divide
by k; megapipe adds one loss per MoE layer in Megatron's normalisation, so ``router_aux_loss_coef``
becomes ``--moe-aux-loss-coeff`` = coef x k / (MoE layers), the same weight on a layer's imbalance.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megapipe.config import ModelConfig
from megapipe.models.hf_llama import GLOBAL, LAYER_PREFIX, NORMS_AND_OUTPUT, QKV, gate_up, llama_fields
from megapipe.models.hf_table import HFMapping, Rule, rename


class MoEArchitecture(NamedTuple):
    hf_class: str
    config_class: str
    qkv_bias: bool
    qk_norm: str | None  # None, "head" or "projection"
    shared_expert: bool
    unsupported: dict


MOE_FAMILY = {
    "mixtral": MoEArchitecture("MixtralForCausalLM", "MixtralConfig", False, None, False,
                               {"router_jitter_noise": 0.0}),
    "qwen2_moe": MoEArchitecture("Qwen2MoeForCausalLM", "Qwen2MoeConfig", True, None, True,
                                 {"use_sliding_window": False}),
    "qwen3_moe": MoEArchitecture("Qwen3MoeForCausalLM", "Qwen3MoeConfig", False, "head", False,
                                 {"attention_bias": False, "use_sliding_window": False}),
    "olmoe": MoEArchitecture("OlmoeForCausalLM", "OlmoeConfig", False, "projection", False,
                             {"attention_bias": False, "clip_qkv": None}),
}


def _experts(hf_config) -> int:
    return getattr(hf_config, "num_local_experts", None) or hf_config.num_experts


def _moe_pattern(hf_config) -> tuple:
    """Which layers are MoE layers (transformers' rule for the Qwen models; every layer otherwise)."""
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return tuple(int(i not in dense and (i + 1) % step == 0) for i in range(hf_config.num_hidden_layers))


def moe_fields(hf_config) -> dict:
    """The ModelConfig fields of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE transformers config."""
    arch = MOE_FAMILY[hf_config.model_type]
    fields = llama_fields(hf_config, qkv_bias=arch.qkv_bias)
    pattern = _moe_pattern(hf_config)
    k = hf_config.num_experts_per_tok
    expert_ffn = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    fields.update(num_experts=_experts(hf_config), moe_router_topk=k, moe_ffn_hidden_size=expert_ffn,
                  moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", hf_config.model_type == "mixtral"),
                  moe_layer_freq=1 if all(pattern) else pattern,
                  moe_aux_loss_coeff=hf_config.router_aux_loss_coef * k / max(1, sum(pattern)))
    if arch.qk_norm is not None:
        fields.update(qk_layernorm=True, qk_layernorm_scope=arch.qk_norm)
    if arch.shared_expert:
        fields.update(moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
    return fields


def stacked_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' [E, (gate f | up f), h] -> megapipe's [E, (f, {gate, up}), h]."""
    gate, up = gate_up.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).reshape(gate_up.shape).contiguous()


def _to_stacked(config: ModelConfig, gate_up: torch.Tensor) -> tuple:
    return (stacked_gate_up(gate_up),)


def _to_split(config: ModelConfig, fc1: torch.Tensor) -> tuple:
    """megapipe's [E, (f, {gate, up}), h] -> transformers' [E, (gate f | up f), h]."""
    e, width, h = fc1.shape
    pairs = fc1.reshape(e, width // 2, 2, h)
    return (torch.cat((pairs[:, :, 0], pairs[:, :, 1]), dim=1).contiguous(),)


def _dense(config: ModelConfig, layer: int) -> bool:
    return not config.is_moe_layer(layer)


def _moe(config: ModelConfig, layer: int) -> bool:
    return config.is_moe_layer(layer)


def _shared(config: ModelConfig, layer: int) -> bool:
    return config.is_moe_layer(layer) and config.moe_shared_expert_intermediate_size is not None


def _qk_norm(config: ModelConfig, layer: int) -> bool:
    return config.qk_layernorm


# a Llama layer whose MLP is dense, or a router with stacked experts (and maybe a gated shared expert)
MOE_WEIGHTS = HFMapping(LAYER_PREFIX, before=GLOBAL, lm_head="lm_head.weight", layer=(
    *NORMS_AND_OUTPUT,
    rename("mlp.fc2.weight", "mlp.down_proj.weight", when=_dense),
    rename("mlp.router.weight", "mlp.gate.weight", when=_moe),
    rename("mlp.experts.fc2.weight", "mlp.experts.down_proj", when=_moe),
    rename("mlp.shared_experts.fc2.weight", "mlp.shared_expert.down_proj.weight", when=_shared),
    rename("mlp.shared_experts.gate.weight", "mlp.shared_expert_gate.weight", when=_shared),
    rename("attention.q_norm.weight", "self_attn.q_norm.weight", when=_qk_norm),
    rename("attention.k_norm.weight", "self_attn.k_norm.weight", when=_qk_norm),
    *QKV,
    gate_up("mlp.fc1.weight", "mlp.", _dense),
    gate_up("mlp.shared_experts.fc1.weight", "mlp.shared_expert.", _shared),
    Rule(("mlp.experts.fc1.weight",), ("mlp.experts.gate_up_proj",), _to_stacked, _to_split, _moe)))


def _check_exportable(model_type: str, config: ModelConfig) -> None:
    """ValueError naming the first option of ``config`` that ``model_type`` cannot express."""
    arch = MOE_FAMILY[model_type]
    wanted = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                  post_layernorm=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm is not None,
                  moe_router_score_function="softmax", moe_router_num_groups=None,
                  moe_router_enable_expert_bias=False, moe_shared_expert_gate=arch.shared_expert)
    if arch.qk_norm is not None:
        wanted["qk_layernorm_scope"] = arch.qk_norm
    if not arch.shared_expert:
        wanted["moe_shared_expert_intermediate_size"] = None
    if model_type in ("mixtral", "olmoe"):
        wanted["moe_layer_freq"] = 1
    if model_type == "mixtral":
        wanted["moe_router_pre_softmax"] = False
    for field, value in wanted.items():
        if getattr(config, field) != value:
            raise ValueError(f"a {model_type} model needs {field}={value!r}, this one has {getattr(config, field)!r}")


def moe_hf_config(model_type: str, config: ModelConfig, **token_ids):
    """The transformers config of a megapipe MoE model (ValueError when ``model_type`` has no equal)."""
    import transformers

    _check_exportable(model_type, config)
    pattern = [int(config.is_moe_layer(i)) for i in range(config.num_layers)]
    k = config.moe_router_topk
    common = dict(num_hidden_layers=config.num_layers, hidden_size=config.hidden_size,
                  num_attention_heads=config.num_attention_heads, num_key_value_heads=config.query_groups,
                  vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
                  rms_norm_eps=config.layernorm_epsilon,
                  rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base},
                  attention_dropout=config.attention_dropout, initializer_range=config.init_method_std,
                  tie_word_embeddings=not config.untie_embeddings_and_output_weights, num_experts_per_tok=k,
                  router_aux_loss_coef=config.moe_aux_loss_coeff * sum(pattern) / k, **token_ids)
    if config.rotary_percent != 1.0:
        common["rope_parameters"]["partial_rotary_factor"] = config.rotary_percent
    expert_ffn = config.expert_ffn_hidden_size
    if model_type == "mixtral":
        extra = dict(num_local_experts=config.num_experts, intermediate_size=expert_ffn, sliding_window=None)
    else:
        extra = dict(num_experts=config.num_experts, norm_topk_prob=not config.moe_router_pre_softmax)
        extra.update(dict(intermediate_size=expert_ffn) if model_type == "olmoe" else dict(
            intermediate_size=config.ffn_hidden_size, moe_intermediate_size=expert_ffn, decoder_sparse_step=1,
            mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe]))
    if model_type == "qwen2_moe":
        extra.update(shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size, qkv_bias=True)
    if model_type == "qwen3_moe":
        extra.update(head_dim=config.head_dim)
    return getattr(transformers, MOE_FAMILY[model_type].config_class)(**common, **extra)
