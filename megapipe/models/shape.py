"""``ModelShape``: every fact of a model that changes what it costs, built from its ``ModelConfig`` only.

The planner prices a shape (its profile is valid for one shape), so the shape holds all that
changes FLOPs, parameters or activations: the sizes, the MLP (GeLU or SwiGLU's three matrices),
the key/value heads of grouped-query attention, the norm, the biases, the positions, the
vocabulary padding and the tied or untied head, and the mixture of experts. ``from_config`` is
its one constructor, and its FLOPs are the model family's own (``flops_per_sample``).
The fields added after the first profiles (all with defaults) default to what describes a GPT,
so an older profile file reads as the GPT it was measured for.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megapipe.config import ModelConfig
from megapipe.config.moe import LayerFreq, moe_layer_pattern
from megapipe.config.schema import pad_vocab_size
from megapipe.errors import ConfigError
from megapipe.models.families import family_of
from megapipe.models.flops import expert_parameters


@dataclass(frozen=True)
class ModelShape:
    """The shape that makes two models cost the same; a profile is only valid for its own shape."""

    kind: str  # the training script's model kind ("gpt" or "bert")
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int  # the tokenizer's; the logits run over ``padded_vocab_size``
    ffn_hidden_size: int
    tied_embeddings: bool = True
    num_experts: int = 0  # routed experts per MoE block (0: dense MLPs)
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0  # each expert's (0: ffn_hidden_size)
    moe_layer_freq: LayerFreq = 1  # which blocks hold experts (--moe-layer-freq: every N-th, or a 0/1 per block)
    swiglu: bool = False  # three MLP matrices (gate, up, down) instead of two
    query_groups: int = 0  # key/value heads (0: one per attention head)
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True  # an MoE shape has none, as megapipe's experts require
    add_qkv_bias: bool = False
    position_embedding_type: str = "learned_absolute"
    qk_layernorm: bool = False
    qk_layernorm_scope: str = "head"
    make_vocab_size_divisible_by: int = 128
    moe_shared_expert_intermediate_size: int = 0  # 0: no shared expert
    moe_shared_expert_gate: bool = False

    def __post_init__(self):
        if isinstance(self.moe_layer_freq, list):  # read back from JSON
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if not self.query_groups:
            object.__setattr__(self, "query_groups", self.num_attention_heads)
        if self.is_moe:
            object.__setattr__(self, "add_bias_linear", False)

    @staticmethod
    def from_config(kind: str, config: ModelConfig) -> "ModelShape":
        """The shape of a model of ``kind`` (the training script's) with ``config``."""
        moe = config.num_experts is not None
        return ModelShape(kind, config.num_layers, config.hidden_size, config.num_attention_heads, config.seq_length,
                          config.vocab_size, config.ffn_hidden_size, not config.untie_embeddings_and_output_weights,
                          config.num_experts or 0, config.moe_router_topk if moe else 0,
                          config.expert_ffn_hidden_size if moe else 0, config.moe_layer_freq if moe else 1,
                          config.swiglu, config.query_groups, config.normalization, config.add_bias_linear,
                          config.add_qkv_bias, config.position_embedding_type, config.qk_layernorm,
                          config.qk_layernorm_scope, config.make_vocab_size_divisible_by,
                          config.moe_shared_expert_intermediate_size or 0, config.moe_shared_expert_gate)

    def to_config(self, **overrides) -> ModelConfig:
        """A ModelConfig of this shape (dropout and numerics from ``overrides`` or the defaults)."""
        moe = dict(num_experts=self.num_experts, moe_router_topk=self.moe_router_topk,
                   moe_ffn_hidden_size=self.expert_ffn_hidden_size, moe_layer_freq=self.moe_layer_freq,
                   moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size or None,
                   moe_shared_expert_gate=self.moe_shared_expert_gate) if self.is_moe else {}
        groups = None if self.query_groups == self.num_attention_heads else self.query_groups
        return ModelConfig(num_layers=self.num_layers, hidden_size=self.hidden_size,
                           num_attention_heads=self.num_attention_heads, seq_length=self.seq_length,
                           vocab_size=self.vocab_size, ffn_hidden_size=self.ffn_hidden_size,
                           untie_embeddings_and_output_weights=not self.tied_embeddings, swiglu=self.swiglu,
                           num_query_groups=groups, normalization=self.normalization,
                           add_bias_linear=self.add_bias_linear, add_qkv_bias=self.add_qkv_bias,
                           position_embedding_type=self.position_embedding_type, qk_layernorm=self.qk_layernorm,
                           qk_layernorm_scope=self.qk_layernorm_scope,
                           make_vocab_size_divisible_by=self.make_vocab_size_divisible_by, **{**moe, **overrides})

    @property
    def padded_vocab_size(self) -> int:
        """The logit layer's width: the vocabulary padded as the model pads it (on one tensor rank)."""
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, 1)

    @property
    def kv_hidden_size(self) -> int:
        """The width of the keys (and of the values): key/value heads x head size."""
        return self.query_groups * (self.hidden_size // self.num_attention_heads)

    def flops_per_sample(self, recompute: bool) -> float:
        """Model FLOPs of forward and backward over one sequence: the family's own ``flops``."""
        config = self.to_config()
        return family_of(self.kind, config).flops(config, 1, recompute)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (from 0) holds experts instead of a dense MLP."""
        return self.is_moe and moe_layer_pattern(self.moe_layer_freq, self.num_layers)[layer]

    @property
    def moe_layers(self) -> list[int]:
        """The blocks (from 0) that hold experts."""
        return [layer for layer in range(self.num_layers) if self.is_moe_layer(layer)]

    def active_ffn_hidden_size(self, layer: int) -> int:
        """The MLP width one token passes through in block ``layer``: its k experts' together in an MoE block."""
        return self.moe_router_topk * self.expert_ffn_hidden_size if self.is_moe_layer(layer) else self.ffn_hidden_size

    @property
    def expert_params_per_block(self) -> int:
        """The routed experts' parameters of one MoE block (``models.flops.expert_parameters``); expert parallelism
        holds 1/e of them, tensor parallelism 1/t."""
        return expert_parameters(self.to_config()) if self.is_moe else 0

    def check_same(self, other: "ModelShape", source: str) -> None:
        """Raise when ``other`` (the model to plan) differs from this profile's model in any field."""
        for item in fields(self):
            mine, theirs = getattr(self, item.name), getattr(other, item.name)
            if mine != theirs:
                raise ConfigError(f"{source} was measured for a model with {item.name} {mine}, but the model to plan "
                                  f"has {item.name} {theirs}; profile this model with tools/profile_model.py.")
