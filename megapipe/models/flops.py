"""Model FLOPs of a GPT/BERT/Llama iteration, seed 002 equations 4.2-4.3: the one place they are computed.

Every other count (the trainer's TFLOP/s, the planner's analytic profile and cost model, the
benchmarks) calls these functions; a model family's registry entry names the formula it uses.

Per transformer layer and sequence, a forward pass costs 24 s h^2 + 4 s^2 h multiply-adds x 2
(QKV, scores, attention over values, output projection, the h -> 4h -> h MLP); a backward
pass costs twice a forward, and full recomputation adds one more forward. The logit layer
costs 2 s h V forward and 4 s h V backward and is never recomputed. With recomputation this
is exactly eq. 4.2: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)). Grouped-query attention shrinks
the key/value projections and SwiGLU has three MLP matrices instead of two
(``block_forward_flops``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megapipe.errors import ConfigError

# Dense bf16 (V100: fp16) tensor-core peaks in TFLOP/s, from the vendor's data sheets, by a part of the
# name CUDA reports ("NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe", "NVIDIA H100 NVL");
# the first match counts, so a variant comes before its family.
KNOWN_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("H200 NVL", 835.0), ("H200", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("V100", 125.0), ("A10", 125.0), ("L4", 121.0),
)

if TYPE_CHECKING:
    from megapipe.config import ModelConfig


def mlp_forward_flops(tokens: float, hidden: int, ffn: int, swiglu: bool) -> float:
    """A dense MLP's forward FLOPs: 4 t h f (GeLU) or 6 t h f (SwiGLU: gate, up and down)."""
    return (6 if swiglu else 4) * tokens * hidden * ffn


def moe_mlp_forward_flops(tokens: float, config: "ModelConfig") -> float:
    """An MoE layer's forward FLOPs: each token through its k experts, the router's 2 t h E, and the shared
    expert with its gate (dropped tokens not subtracted: the count of the model, not of one batch)."""
    h = config.hidden_size
    flops = (config.moe_router_topk * mlp_forward_flops(tokens, h, config.expert_ffn_hidden_size, config.swiglu)
             + 2 * tokens * h * config.num_experts)
    if config.moe_shared_expert_intermediate_size is not None:
        flops += mlp_forward_flops(tokens, h, config.moe_shared_expert_intermediate_size, config.swiglu)
        flops += 2 * tokens * h if config.moe_shared_expert_gate else 0
    return flops


def block_forward_flops(tokens: float, seq_length: int, hidden: int, ffn: int, kv_hidden: int | None = None,
                        swiglu: bool = False) -> float:
    """One layer's forward FLOPs over ``tokens`` tokens in sequences of ``seq_length``.

    QKV 2 t h (h + 2 h_kv) with h_kv = query groups x head size (``kv_hidden``; h under
    multi-head attention), scores and values 4 t s h, output projection 2 t h^2, MLP 4 t h f
    (GeLU) or 6 t h f (SwiGLU: gate, up and down). With h_kv = h and f = 4h this is eq. 4.2's
    24 t h^2 + 4 t s h.
    """
    h = hidden
    h_kv = h if kv_hidden is None else kv_hidden
    mlp = mlp_forward_flops(tokens, h, ffn, swiglu)
    return 2 * tokens * h * (h + 2 * h_kv) + 4 * tokens * seq_length * h + 2 * tokens * h * h + mlp


def head_forward_flops(tokens: float, hidden: int, vocab: int) -> float:
    """The logit layer's forward FLOPs: 2 t h V (its backward is twice that, and it is never recomputed)."""
    return 2 * tokens * hidden * vocab


def transformer_flops(tokens: float, seq_length: int, num_layers: int, hidden: int, ffn: int, vocab: int,
                      recompute: bool, kv_hidden: int | None = None, swiglu: bool = False) -> float:
    """Model FLOPs of forward and backward over ``tokens`` tokens: 3 passes of every layer (4 with full
    recomputation) and 3 of the logit layer; with f = 4h and multi-head attention, eq. 4.2."""
    passes = 4 if recompute else 3
    return (passes * num_layers * block_forward_flops(tokens, seq_length, hidden, ffn, kv_hidden, swiglu)
            + 3 * head_forward_flops(tokens, hidden, vocab))


def flops_per_iteration(config: "ModelConfig", global_batch_size: int, recompute: bool) -> float:
    """Model FLOPs of one training iteration over ``global_batch_size`` sequences."""
    s = config.seq_length
    # the logit matmul runs over the padded vocabulary
    return transformer_flops(global_batch_size * s, s, config.num_layers, config.hidden_size, config.ffn_hidden_size,
                             config.padded_vocab_size(1), recompute, config.query_groups * config.head_dim,
                             config.swiglu)


def moe_flops_per_iteration(config: "ModelConfig", global_batch_size: int, recompute: bool) -> float:
    """``flops_per_iteration`` with each MoE layer's MLP counted as ``moe_mlp_forward_flops``."""
    tokens = global_batch_size * config.seq_length
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    difference = (moe_mlp_forward_flops(tokens, config)
                  - mlp_forward_flops(tokens, config.hidden_size, config.ffn_hidden_size, config.swiglu))
    return flops_per_iteration(config, global_batch_size, recompute) + (4 if recompute else 3) * moe_layers * difference


def head_flops_per_iteration(config: "ModelConfig", global_batch_size: int) -> float:
    """The logit layer's share of ``flops_per_iteration``."""
    return 3 * head_forward_flops(global_batch_size * config.seq_length, config.hidden_size,
                                  config.padded_vocab_size(1))


def layer_forward_flops(tokens: float, config: "ModelConfig", layer: int) -> float:
    """Transformer layer ``layer``'s forward FLOPs over ``tokens`` tokens: attention and the dense MLP, or
    attention and the mixture of experts where ``config.is_moe_layer(layer)`` (``--moe-layer-freq``)."""
    h, f = config.hidden_size, config.ffn_hidden_size
    dense = block_forward_flops(tokens, config.seq_length, h, f, config.query_groups * config.head_dim, config.swiglu)
    if not config.is_moe_layer(layer):
        return dense
    return dense - mlp_forward_flops(tokens, h, f, config.swiglu) + moe_mlp_forward_flops(tokens, config)


def expert_parameters(config: "ModelConfig") -> int:
    """The routed experts' parameters of one MoE layer (no biases: megapipe's experts have none)."""
    return config.num_experts * (3 if config.swiglu else 2) * config.hidden_size * config.expert_ffn_hidden_size


def layer_parameters(config: "ModelConfig", layer: int) -> tuple[int, int]:
    """(all, replicated) parameters of transformer layer ``layer``: attention, norms and its dense MLP or, where
    ``config.is_moe_layer(layer)``, its experts, router and shared expert. Replicated are those every
    tensor-parallel rank holds whole: norms, the row-parallel layers' biases, the router and the shared gate."""
    h, h_kv, f = config.hidden_size, config.query_groups * config.head_dim, config.ffn_hidden_size
    bias, matrices = config.add_bias_linear, 3 if config.swiglu else 2
    qkv = h * (h + 2 * h_kv) + (h + 2 * h_kv) * (bias or config.add_qkv_bias)
    norms = 2 * h * (2 if config.normalization == "LayerNorm" else 1)
    if config.qk_layernorm:
        qk_width = h + h_kv if config.qk_layernorm_scope == "projection" else 2 * config.head_dim
        norms += qk_width * (2 if config.normalization == "LayerNorm" else 1)
    if config.is_moe_layer(layer):
        replicated_mlp = config.num_experts * h + h * config.moe_shared_expert_gate
        mlp = expert_parameters(config) + replicated_mlp
        if config.moe_shared_expert_intermediate_size is not None:
            mlp += matrices * h * config.moe_shared_expert_intermediate_size
    else:
        replicated_mlp = bias * h
        mlp = matrices * h * f + bias * ((2 if config.swiglu else 1) * f + h)
    return qkv + h * h + bias * h + mlp + norms, norms + bias * h + replicated_mlp


def parameter_count(config: "ModelConfig") -> float:
    """Parameters, counted term by term (for GPT-2 shapes, eq. 4.3's 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))
    plus the final norm); grouped-query attention, SwiGLU, RMSNorm, q/k norms, biases, an untied head and MoE
    layers included (``layer_parameters``)."""
    v, h, s = config.vocab_size, config.hidden_size, config.seq_length
    positions = s * h if config.position_embedding_type == "learned_absolute" else 0
    head = v * h if config.untie_embeddings_and_output_weights else 0
    final_norm = h * (2 if config.normalization == "LayerNorm" else 1)
    layers = sum(layer_parameters(config, i)[0] for i in range(config.num_layers))
    return layers + v * h + positions + head + final_norm


def device_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its CUDA name; None for a device not in the table."""
    return next((peak for part, peak in KNOWN_PEAK_TFLOPS if part in device_name), None)


def check_device_peak(value: float | None) -> None:
    """``--device-peak-tflops`` is a positive number of TFLOP/s (or unset: looked up by name)."""
    if value is not None and not value > 0:
        raise ConfigError(f"--device-peak-tflops {value:g} must be above 0: it is one device's dense bf16 peak "
                          "in TFLOP/s (989 for an H100 SXM); drop the flag to look up a known GPU by name.")
