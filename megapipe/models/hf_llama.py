"""Weight mapping between megapipe's canonical state dict and Hugging Face Llama, Mistral and Qwen2.

The three share one layout (``LlamaForCausalLM``'s): RMSNorm, rotary positions, SwiGLU,
grouped-query attention, no biases except Qwen2's on q, k and v. megapipe fuses q, k and v
into rows ordered (group, [its query heads, key, value], head_dim) and gate and up into
(ffn, {gate, up}) pairs, so that contiguous tensor-parallel splits give whole query groups
and matching gate/up rows; these functions reorder between the two.
"""

from __future__ import annotations

import torch

from megapipe.config import ModelConfig

# model_type -> (transformers class, q/k/v bias)
LLAMA_FAMILY = {"llama": ("LlamaForCausalLM", False), "mistral": ("MistralForCausalLM", False),
                "qwen2": ("Qwen2ForCausalLM", True)}


def qkv_from_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[heads d(, h)], [groups d(, h)] x 2 -> megapipe's (group, [q heads, k, v], d) rows."""
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:]).contiguous()


def qkv_to_grouped(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    per_group = qkv.reshape(groups, -1, *qkv.shape[1:])
    q_rows = heads // groups * head_dim
    q, k, v = per_group.split([q_rows, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]).contiguous() for t in (q, k, v))


def gate_up_interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gate and up rows (weights or biases) -> megapipe's (ffn, {gate, up}) pairs."""
    return torch.stack((gate, up), dim=1).reshape(-1, *gate.shape[1:]).contiguous()


def gate_up_split(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = fc1.reshape(-1, 2, *fc1.shape[1:])
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()


def qkv_from_hf(hf_state, prefix: str, config: ModelConfig) -> dict:
    """A layer's fused q/k/v weight (and Qwen's biases), by layer-relative megapipe name, from its
    Hugging Face tensors under ``prefix`` (``model.layers.{i}.``)."""
    return {f"attention.qkv.{kind}": qkv_from_grouped(*(hf_state[f"{prefix}self_attn.{name}_proj.{kind}"]
                                                        for name in "qkv"), config.query_groups)
            for kind in _qkv_kinds(config)}


def qkv_to_hf(state: dict, layer: int, config: ModelConfig) -> dict:
    """The inverse of :func:`qkv_from_hf`: layer-relative Hugging Face names of q, k and v."""
    heads, groups, d = config.num_attention_heads, config.query_groups, config.head_dim
    return {f"self_attn.{name}_proj.{kind}": tensor for kind in _qkv_kinds(config)
            for name, tensor in zip("qkv", qkv_to_grouped(state[f"layers.{layer}.attention.qkv.{kind}"], heads,
                                                         groups, d))}


def _qkv_kinds(config: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if config.add_qkv_bias else ("weight",)


# (megapipe, Hugging Face) names of a layer's norms and attention output, and of the model's ends
NORMS_AND_OUTPUT = [
    ("attention_norm.weight", "input_layernorm.weight"),
    ("attention.dense.weight", "self_attn.o_proj.weight"),
    ("mlp_norm.weight", "post_attention_layernorm.weight"),
]
_LAYER = NORMS_AND_OUTPUT + [("mlp.fc2.weight", "mlp.down_proj.weight")]
GLOBAL = [("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
          ("final_norm.weight", "model.norm.weight")]


def rope_settings(hf_config) -> tuple[float, float]:
    """(rotary base, rotary fraction) of a transformers config; ValueError for scaled RoPE variants."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"RoPE scaling {kind!r} is not supported; megapipe implements the default RoPE")
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return float(base), float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))


def llama_fields(hf_config, qkv_bias: bool | None = None) -> dict:
    """The ModelConfig fields a Llama, Mistral or Qwen2 transformers config gives (the Llama family adds
    its defaults).

    Mistral's sliding window changes nothing for sequences no longer than the window, so the
    model's position limit becomes the window. ``qkv_bias``: whether q, k and v have biases, for
    model types other than this module's (the MoE ones).
    """
    if hf_config.hidden_act != "silu":
        raise ValueError(f"activation {hf_config.hidden_act} is not supported; megapipe's SwiGLU uses silu")
    heads = hf_config.num_attention_heads
    if getattr(hf_config, "head_dim", None) not in (None, hf_config.hidden_size // heads):
        raise ValueError(f"head_dim {hf_config.head_dim} differs from hidden_size / num_attention_heads; megapipe "
                         "needs them equal")
    base, fraction = rope_settings(hf_config)
    positions = hf_config.max_position_embeddings
    window = getattr(hf_config, "sliding_window", None)
    sliding = hf_config.model_type in ("mistral", "mixtral") or getattr(hf_config, "use_sliding_window", False)
    if window and sliding:
        positions = min(positions, window)
    bias = LLAMA_FAMILY[hf_config.model_type][1] if qkv_bias is None else qkv_bias
    fields = dict(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                  num_attention_heads=heads, num_query_groups=hf_config.num_key_value_heads,
                  vocab_size=hf_config.vocab_size, seq_length=positions, max_position_embeddings=positions,
                  ffn_hidden_size=hf_config.intermediate_size, layernorm_epsilon=hf_config.rms_norm_eps,
                  rotary_base=base, rotary_percent=fraction, add_qkv_bias=bias,
                  attention_dropout=getattr(hf_config, "attention_dropout", 0.0),
                  init_method_std=hf_config.initializer_range,
                  untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings)
    return fields


def llama_from_hf(hf_state, config: ModelConfig) -> dict:
    """Canonical megapipe state dict from a Llama-family state dict (any mapping that loads on access)."""
    out = {ours: hf_state[theirs] for ours, theirs in GLOBAL}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        for ours, theirs in _LAYER:
            out[f"layers.{i}.{ours}"] = hf_state[prefix + theirs]
        out.update({f"layers.{i}.{name}": tensor for name, tensor in qkv_from_hf(hf_state, prefix, config).items()})
        out[f"layers.{i}.mlp.fc1.weight"] = gate_up_interleaved(hf_state[prefix + "mlp.gate_proj.weight"],
                                                                hf_state[prefix + "mlp.up_proj.weight"])
    if config.untie_embeddings_and_output_weights:
        out["output_embedding.weight"] = hf_state["lm_head.weight"]
    return {k: v.clone() for k, v in out.items()}


def llama_to_hf(state: dict, config: ModelConfig) -> dict:
    """Llama-family state dict from a canonical megapipe state dict."""
    out = {theirs: state[ours] for ours, theirs in GLOBAL}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        for ours, theirs in _LAYER:
            out[prefix + theirs] = state[f"layers.{i}.{ours}"]
        out.update({prefix + name: tensor for name, tensor in qkv_to_hf(state, i, config).items()})
        out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate_up_split(
            state[f"layers.{i}.mlp.fc1.weight"])
    out["lm_head.weight"] = state.get("output_embedding.weight", state["embedding.word_embeddings.weight"])
    return {k: v.clone() for k, v in out.items()}


def llama_hf_config(model_type: str, config: ModelConfig, **token_ids):
    """The transformers config of a megapipe Llama-shaped model, with ``token_ids`` (bos_token_id ...)
    (ValueError when it has no equal)."""
    import transformers

    wanted = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                  post_layernorm=False, add_qkv_bias=LLAMA_FAMILY[model_type][1])
    for field, value in wanted.items():
        if getattr(config, field) != value:
            raise ValueError(f"a {model_type} model needs {field}={value!r}, this one has "
                             f"{getattr(config, field)!r}")
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config}[model_type]
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rotary_percent != 1.0:
        rope["partial_rotary_factor"] = config.rotary_percent
    extra = {"sliding_window": None} if model_type == "mistral" else {}
    return config_class(num_hidden_layers=config.num_layers, hidden_size=config.hidden_size,
                        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.query_groups,
                        intermediate_size=config.ffn_hidden_size, vocab_size=config.vocab_size,
                        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
                        rope_parameters=rope, attention_dropout=config.attention_dropout,
                        initializer_range=config.init_method_std,
                        tie_word_embeddings=not config.untie_embeddings_and_output_weights, **extra, **token_ids)
