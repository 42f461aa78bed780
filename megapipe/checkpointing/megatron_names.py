"""Megatron-LM's model arguments and weight names <-> megapipe's ModelConfig and canonical names.

Megatron-core's GPT (``GPTModel``, local or Transformer Engine layer spec) names a layer's
weights ``decoder.layers.{i}.self_attention.linear_qkv.weight`` and so on; this module works on
those names with whole tensors and one key per layer (``megatron_files`` reads and writes the
two on-disk formats). Two layouts differ from megapipe's: ``linear_fc1`` of a SwiGLU MLP is
[gate; up] stacked, megapipe interleaves (ffn, {gate, up}) rows; ``linear_qkv`` is per query
group [its query heads, key, value] in both, so it maps unchanged. QK layernorm (per head) maps
to megapipe's ``--qk-layernorm``. An MoE layer's router, experts and shared expert map to
megapipe's (``--num-experts`` and the other ``--moe-*`` flags, Megatron's names): the local
spec keeps one ``local_experts.{j}`` MLP per expert, ``torch_dist`` stacks them under
``experts.experts``, megapipe stacks them under ``experts``, each expert's SwiGLU rows
interleaved; an export writes torch_dist's stacked form, which Megatron-core's local and grouped experts
both load. What megapipe does not compute (other position embeddings, latent attention ...)
is refused in one sentence.
"""

from __future__ import annotations

import argparse
import re

import torch

from megapipe.config import ModelConfig
from megapipe.errors import CheckpointError
from megapipe.models.hf_llama import gate_up_interleaved, gate_up_split

# (megapipe name, Megatron name); {i} is the layer
_LAYER = [
    ("attention_norm.{w}", "decoder.layers.{i}.input_layernorm.{w}"),
    ("attention.qkv.{w}", "decoder.layers.{i}.self_attention.linear_qkv.{w}"),
    ("attention.dense.{w}", "decoder.layers.{i}.self_attention.linear_proj.{w}"),
    ("mlp_norm.{w}", "decoder.layers.{i}.pre_mlp_layernorm.{w}"),
    ("mlp.fc1.{w}", "decoder.layers.{i}.mlp.linear_fc1.{w}"),
    ("mlp.fc2.{w}", "decoder.layers.{i}.mlp.linear_fc2.{w}"),
]
_GLOBAL = [
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ("embedding.position_embeddings.weight", "embedding.position_embeddings.weight"),
    ("final_norm.{w}", "decoder.final_layernorm.{w}"),
    ("output_embedding.weight", "output_layer.weight"),
]
_VOCAB = ("embedding.word_embeddings.weight", "output_embedding.weight")  # rows: the vocabulary
# Transformer Engine fuses each layer norm into the linear after it; its names (and torch_dist's) -> the local spec's
_FUSED_NORMS = [(re.compile(r"\.self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r".input_layernorm.\1"),
                (re.compile(r"\.mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r".pre_mlp_layernorm.\1")]
_UNFUSED_NORMS = [(re.compile(r"\.input_layernorm\.(weight|bias)$"), r".self_attention.linear_qkv.layer_norm_\1"),
                  (re.compile(r"\.pre_mlp_layernorm\.(weight|bias)$"), r".mlp.linear_fc1.layer_norm_\1")]

_QK_NORMS = [("attention.q_norm.{w}", "decoder.layers.{i}.self_attention.q_layernorm.{w}"),
             ("attention.k_norm.{w}", "decoder.layers.{i}.self_attention.k_layernorm.{w}")]
_EXPERTS = "decoder.layers.{i}.mlp.experts.experts.linear_fc{n}.weight"  # [E, out, in], torch_dist's stacking
_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_MOE_LAYER = [("mlp.router.weight", "decoder.layers.{i}.mlp.router.weight"),
              ("mlp.experts.fc1.weight", _EXPERTS.replace("{n}", "1")),
              ("mlp.experts.fc2.weight", _EXPERTS.replace("{n}", "2"))]
_SHARED_EXPERT = [("mlp.shared_experts.fc1.weight", "decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight"),
                  ("mlp.shared_experts.fc2.weight", "decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight")]
# Megatron's MoE arguments that megapipe's flags of the same name take, with Megatron's defaults
_MOE_ARGS = {"moe_router_topk": 2, "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
             "moe_router_num_groups": None, "moe_router_group_topk": None, "moe_router_enable_expert_bias": False,
             "moe_router_bias_update_rate": 1e-3, "moe_router_load_balancing_type": "aux_loss",
             "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None, "moe_expert_capacity_factor": None,
             "moe_token_drop_policy": "probs", "moe_pad_expert_input_to_capacity": False,
             "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
             "moe_grouped_gemm": False}

# Megatron arguments that, set, make a model megapipe has no equal of: name -> what they add
UNSUPPORTED = {
    "multi_latent_attention": "multi-latent attention",
    "moe_router_topk_scaling_factor": "scaled routing weights",
    "moe_input_jitter_eps": "router input jitter",
    "rotary_interleaved": "interleaved rotary embeddings",
    "use_rope_scaling": "scaled RoPE",
    "squared_relu": "a squared-ReLU MLP",
    "apply_residual_connection_post_layernorm": "residual connections after the layer norm",
    "mtp_num_layers": "multi-token prediction layers",
}
POSITIONS = ("learned_absolute", "rope", "none")


def local_name(name: str) -> str:
    """A Megatron weight name as the local layer spec's ``state_dict`` spells it."""
    for pattern, replacement in _FUSED_NORMS:
        name = pattern.sub(replacement, name)
    return name


def fused_name(name: str) -> str:
    """A Megatron weight name as Transformer Engine and ``sharded_state_dict`` spell it."""
    for pattern, replacement in _UNFUSED_NORMS:
        name = pattern.sub(replacement, name)
    return name


def _arg(args, name: str, default=None):
    return getattr(args, name, default)


def _activation(args) -> str:
    """Megatron's GeLU: tanh-approximated by --openai-gelu, and by its bias-GeLU fusion (on by default, used
    with biases), else exact."""
    fused = _arg(args, "bias_gelu_fusion", True) and _arg(args, "add_bias_linear", True) and not _arg(args, "swiglu")
    return "gelu_tanh" if _arg(args, "openai_gelu", False) or fused else "gelu"


def model_config(args, source: str) -> ModelConfig:
    """The megapipe ModelConfig of a Megatron checkpoint's ``args``; CheckpointError for a model megapipe lacks."""
    if args is None:
        raise CheckpointError(f"{source} holds no Megatron arguments ('args'), so the model's shape is unknown; "
                              "save it with Megatron-LM's training loop, which stores them.")
    for name, meaning in UNSUPPORTED.items():
        if _arg(args, name) not in (None, False, 0):
            raise CheckpointError(f"{source} is a Megatron model with {meaning} ({name}={_arg(args, name)!r}), "
                                  "which megapipe does not have; only GPT and Llama-style models (with MoE layers) "
                                  "convert.")
    position = _arg(args, "position_embedding_type", "rope" if _arg(args, "use_rotary_position_embeddings")
                    else "learned_absolute")
    if position not in POSITIONS:
        raise CheckpointError(f"{source} uses position embedding {position!r}, which megapipe does not have; "
                              f"it computes {', '.join(POSITIONS)}.")
    heads, hidden = args.num_attention_heads, args.hidden_size
    kv_channels = _arg(args, "kv_channels") or hidden // heads
    if kv_channels * heads != hidden:
        raise CheckpointError(f"{source} has kv_channels {kv_channels} x {heads} heads != hidden size {hidden}; "
                              "megapipe needs heads x head size = hidden size.")
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention") else None
    # the tokenizer's size where the arguments keep it (megapipe's exports do), else every padded row
    vocab = _arg(args, "vocab_size") or _arg(args, "padded_vocab_size")
    if not vocab:
        raise CheckpointError(f"{source}: the Megatron arguments name no (padded) vocabulary size.")
    positions = _arg(args, "max_position_embeddings") or _arg(args, "seq_length")
    fields = dict(num_layers=args.num_layers, hidden_size=hidden, num_attention_heads=heads,
                  ffn_hidden_size=_arg(args, "ffn_hidden_size") or 4 * hidden, num_query_groups=groups,
                  max_position_embeddings=positions, seq_length=min(_arg(args, "seq_length") or positions, positions),
                  position_embedding_type=position, normalization=_arg(args, "normalization", "LayerNorm"),
                  swiglu=bool(_arg(args, "swiglu", False)),
                  untie_embeddings_and_output_weights=bool(_arg(args, "untie_embeddings_and_output_weights", False)),
                  add_bias_linear=bool(_arg(args, "add_bias_linear", True)),
                  add_qkv_bias=bool(_arg(args, "add_qkv_bias", False)), vocab_size=vocab,
                  make_vocab_size_divisible_by=_arg(args, "make_vocab_size_divisible_by", 128),
                  rotary_base=float(_arg(args, "rotary_base", 10000)),
                  rotary_percent=float(_arg(args, "rotary_percent", 1.0)),
                  layernorm_epsilon=float(_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))),
                  activation=_activation(args),
                  hidden_dropout=float(_arg(args, "hidden_dropout", 0.1)),
                  attention_dropout=float(_arg(args, "attention_dropout", 0.1)),
                  init_method_std=float(_arg(args, "init_method_std", 0.02)))
    fields.update(_moe_fields(args))
    if fields["normalization"] not in ("LayerNorm", "RMSNorm"):
        raise CheckpointError(f"{source} uses normalization {fields['normalization']!r}, which megapipe does not "
                              "have; it computes LayerNorm and RMSNorm.")
    return ModelConfig(**fields)


def _moe_fields(args) -> dict:
    """QK layernorm and the MoE fields of Megatron's arguments (none for a dense model)."""
    fields = {"qk_layernorm": bool(_arg(args, "qk_layernorm", False))}
    experts = _arg(args, "num_experts")
    if not experts:
        return fields
    fields.update({name: default if _arg(args, name) is None else _arg(args, name)
                   for name, default in _MOE_ARGS.items()})
    freq = _arg(args, "moe_layer_freq", 1)
    fields.update(num_experts=experts, moe_ffn_hidden_size=_arg(args, "moe_ffn_hidden_size"),
                  moe_layer_freq=freq if isinstance(freq, int) else tuple(int(x) for x in freq))
    return fields


def megatron_args(config: ModelConfig) -> argparse.Namespace:
    """The Megatron-LM arguments (model shape) of a megapipe ModelConfig, for one tensor and pipeline rank
    (torch_dist does not depend on them)."""
    moe = _moe_args(config)
    if config.qk_layernorm and config.qk_layernorm_scope != "head":
        raise CheckpointError("Megatron's QK layernorm normalises each head; this model normalises whole "
                              "projections (--qk-layernorm-scope projection), which Megatron-LM cannot load.")
    tanh = config.activation == "gelu_tanh"
    heads = config.num_attention_heads
    return argparse.Namespace(qk_layernorm=config.qk_layernorm,
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=heads, kv_channels=config.head_dim,
        group_query_attention=config.num_query_groups is not None, num_query_groups=config.query_groups,
        max_position_embeddings=config.max_position_embeddings, seq_length=config.seq_length,
        position_embedding_type=config.position_embedding_type, normalization=config.normalization,
        swiglu=config.swiglu, untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        padded_vocab_size=config.padded_vocab_size(1), vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by, rotary_base=config.rotary_base,
        rotary_percent=config.rotary_percent, norm_epsilon=config.layernorm_epsilon,
        openai_gelu=tanh, bias_gelu_fusion=tanh and config.add_bias_linear and not config.swiglu,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout, init_method_std=config.init_method_std,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, **moe)


def _moe_args(config: ModelConfig) -> dict:
    """Megatron's MoE arguments of ``config`` (``num_experts`` None for a dense model): the ``--moe-*`` flags of
    the same names; ``moe_layer_freq`` an int or, as Megatron-LM parses ``--moe-layer-freq [1,0,...]``, a list."""
    if config.num_experts is None:
        return {"num_experts": None}
    freq = config.moe_layer_freq
    return dict({name: getattr(config, name) for name in _MOE_ARGS}, num_experts=config.num_experts,
                moe_ffn_hidden_size=config.moe_ffn_hidden_size,
                moe_layer_freq=freq if isinstance(freq, int) else list(freq))


def _pairs(config: ModelConfig):
    """(megapipe name, Megatron name) of every weight a model with ``config`` has."""
    kinds = ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
    linear = ("weight", "bias") if config.add_bias_linear else ("weight",)
    qkv = ("weight", "bias") if config.add_bias_linear or config.add_qkv_bias else ("weight",)
    for ours, theirs in _GLOBAL:
        if ours.startswith("embedding.position") and config.position_embedding_type != "learned_absolute":
            continue
        if ours.startswith("output") and not config.untie_embeddings_and_output_weights:
            continue
        for w in kinds if "norm" in ours else ("weight",):
            yield ours.format(w=w), theirs.format(w=w)
    for i in range(config.num_layers):
        moe = config.num_experts is not None and config.is_moe_layer(i)
        layer = [pair for pair in _LAYER if not (moe and pair[0].startswith("mlp.fc"))]
        layer += _QK_NORMS if config.qk_layernorm else []
        for ours, theirs in layer:
            for w in kinds if "norm" in ours else qkv if "qkv" in ours else linear:
                yield f"layers.{i}." + ours.format(w=w), theirs.format(i=i, w=w)
        if moe:
            yield from ((f"layers.{i}." + ours, theirs.format(i=i)) for ours, theirs in _moe_pairs(config))


def _moe_pairs(config: ModelConfig):
    """(megapipe name, Megatron name) of one MoE layer's tensors ({i}: the layer)."""
    pairs = list(_MOE_LAYER)
    if config.moe_router_enable_expert_bias:
        pairs.append(("mlp.router.expert_bias", "decoder.layers.{i}.mlp.router.expert_bias"))
    if config.moe_shared_expert_intermediate_size is not None:
        pairs += _SHARED_EXPERT
        if config.moe_shared_expert_gate:
            pairs.append(("mlp.shared_experts.gate.weight", "decoder.layers.{i}.mlp.shared_experts.gate_weight"))
    return pairs


def _stack_local_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The local spec's one tensor per expert (``experts.local_experts.{j}.linear_fc1.weight``) stacked by expert,
    under torch_dist's name (``experts.experts.linear_fc1.weight``); other tensors as they are."""
    out, experts = {}, {}
    for name, value in state.items():
        match = _LOCAL_EXPERT.match(name)
        if match is None:
            out[name] = value
        else:
            experts.setdefault(f"{match[1]}.experts.{match[3]}", {})[int(match[2])] = value
    for name, by_index in experts.items():
        out[name] = torch.stack([by_index[j] for j in range(len(by_index))])
    return out


def _is_swiglu_fc1(name: str, config: ModelConfig) -> bool:
    return config.swiglu and ".linear_fc1." in name


def _per_expert(value: torch.Tensor, rows) -> torch.Tensor:
    """``rows`` applied to a SwiGLU fc1 weight or bias, or to each expert's of stacked experts [E, 2 ffn, h]."""
    return torch.stack([rows(expert) for expert in value]) if value.dim() == 3 else rows(value)


def from_megatron(state: dict[str, torch.Tensor], config: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """Canonical megapipe tensors (fp32) of whole Megatron tensors in local-spec names (one key per layer)."""
    state = _stack_local_experts(state)
    out, left = {}, set(state)
    for ours, theirs in _pairs(config):
        if theirs not in state:
            raise CheckpointError(f"{source} has no tensor {theirs!r}, which its arguments' model needs; the "
                                  "checkpoint is incomplete or its arguments do not describe it.")
        left.discard(theirs)
        value = state[theirs].float()
        if _is_swiglu_fc1(theirs, config):
            value = _per_expert(value, lambda rows: gate_up_interleaved(*rows.chunk(2, dim=0)))
        if ours in _VOCAB:
            value = value[: config.vocab_size]  # Megatron's vocabulary padding
        out[ours] = value.clone()
    left.discard("output_layer.weight")  # the last stage's copy of tied embeddings
    if left:
        raise CheckpointError(f"{source} holds {len(left)} tensors megapipe has no place for (first: {min(left)}); "
                              "it is not a GPT or Llama-style model.")
    return out


def to_megatron(canonical: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Whole Megatron tensors (local-spec names, one key per layer) of canonical megapipe tensors; the vocabulary
    is padded as Megatron pads it for one tensor rank."""
    out = {}
    for ours, theirs in _pairs(config):
        value = canonical[ours]
        if _is_swiglu_fc1(theirs, config):
            value = _per_expert(value, lambda rows: torch.cat(gate_up_split(rows), dim=0))
        if ours in _VOCAB:
            value = torch.cat([value, value.new_zeros(config.padded_vocab_size(1) - value.shape[0], value.shape[1])])
        out[theirs] = value.contiguous()
    return out
