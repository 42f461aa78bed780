"""Weight mapping between megapipe's canonical state dict and Hugging Face Llama, Mistral and Qwen2.

The three share one layout (``LlamaForCausalLM``'s): RMSNorm, rotary positions, SwiGLU,
grouped-query attention, no biases except Qwen2's on q, k and v. megapipe fuses q, k and v
into rows ordered (group, [its query heads, key, value], head_dim) and gate and up into
(ffn, {gate, up}) pairs, so that contiguous tensor-parallel splits give whole query groups
and matching gate/up rows; the table's transforms reorder between the two (the MoE table
reuses its rules).
"""

from __future__ import annotations

import torch

from megapipe.config import ModelConfig
from megapipe.models.hf_table import HFMapping, Rule, always, rename

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


def _qkv_from_grouped(config: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    return (qkv_from_grouped(q, k, v, config.query_groups),)


def _qkv_to_grouped(config: ModelConfig, qkv: torch.Tensor) -> tuple:
    return qkv_to_grouped(qkv, config.num_attention_heads, config.query_groups, config.head_dim)


def _has_qkv_bias(config: ModelConfig, layer: int) -> bool:
    return config.add_qkv_bias


def _gate_up_interleaved(config: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> tuple:
    return (gate_up_interleaved(gate, up),)


def _gate_up_split(config: ModelConfig, fc1: torch.Tensor) -> tuple:
    return gate_up_split(fc1)


def gate_up(ours: str, theirs: str, when=always) -> Rule:
    """megapipe's interleaved fc1 ``ours`` <-> Hugging Face's ``{theirs}gate_proj`` and ``{theirs}up_proj``."""
    return Rule((ours,), (theirs + "gate_proj.weight", theirs + "up_proj.weight"), _gate_up_interleaved,
                _gate_up_split, when)


LAYER_PREFIX = "model.layers.{i}."
# a layer's fused q/k/v weight (and Qwen's biases), its norms and attention output, and the model's ends
QKV = tuple(Rule((f"attention.qkv.{kind}",), tuple(f"self_attn.{name}_proj.{kind}" for name in "qkv"),
                 _qkv_from_grouped, _qkv_to_grouped, when)
            for kind, when in (("weight", always), ("bias", _has_qkv_bias)))
NORMS_AND_OUTPUT = (rename("attention_norm.weight", "input_layernorm.weight"),
                    rename("attention.dense.weight", "self_attn.o_proj.weight"),
                    rename("mlp_norm.weight", "post_attention_layernorm.weight"))
GLOBAL = (rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
          rename("final_norm.weight", "model.norm.weight"))


LLAMA_WEIGHTS = HFMapping(LAYER_PREFIX, before=GLOBAL, lm_head="lm_head.weight",
                          layer=(*NORMS_AND_OUTPUT, rename("mlp.fc2.weight", "mlp.down_proj.weight"), *QKV,
                                 gate_up("mlp.fc1.weight", "mlp.")))
llama_from_hf = LLAMA_WEIGHTS.from_hf


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
